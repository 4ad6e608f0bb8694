"""Data ledger costs: tagging on vs off vs torchtitan's loader (paired), and skip cost.

    python bench/bench_data.py [--steps 16] [--repeats 2] [--warmup 3] [--skip-only]

Training (2 gloo ranks, FSDP2, ``debug_cpu``), repetitions interleaved:
  stock Trainer + torchtitan's HuggingFaceTextDataLoader,
  LedgerTrainer + LedgerDataLoader, tagging on / off.
Per variant: median step time (torchtitan's ``time_metrics/end_to_end(s)``) and
median data-loading time per step (``time_metrics/data_loading(s)``), and the
ratios against tagging off.

Skip: batches/s of ``LedgerDataLoader.skip`` for the text stream (tokenizer walk,
no tensors) and the indexed corpus (arithmetic), then a training run with
``skip_steps = ["3-1000002"]`` on the indexed corpus against one without.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from helpers import explain, read_tb, torchrun  # noqa: E402

COMMON = ["--parallelism.data_parallel_shard_degree", "2", "--metrics.log_freq", "1",
          "--metrics.enable_tensorboard", "--debug.seed", "0"]
VARIANTS = {
    "stock loader": ["--module", "bench.stock_cpu", "--config", "debug_cpu_stock"],
    "tagging off": ["--module", "titan_ledger", "--config", "debug_cpu", "--dataloader.no_tagging"],
    "tagging on": ["--module", "titan_ledger", "--config", "debug_cpu"],
}


def train_bench(steps: int, repeats: int, warmup: int) -> None:
    step_t = {v: [] for v in VARIANTS}
    load_t = {v: [] for v in VARIANTS}
    for rep in range(repeats):
        for name, variant in VARIANTS.items():
            with tempfile.TemporaryDirectory() as out:
                proc = torchrun(variant + COMMON + ["--training.steps", str(steps), "--dump_folder", out])
                if proc.returncode != 0:
                    sys.exit(explain(proc))
                e2e = read_tb(Path(out), "time_metrics/end_to_end(s)")
                dl = read_tb(Path(out), "time_metrics/data_loading(s)")
                step_t[name] += [t for s, t in e2e.items() if s > warmup]
                load_t[name] += [t for s, t in dl.items() if s > warmup]
            print(f"repeat {rep + 1}/{repeats}: {name} done", file=sys.stderr)
    base = "tagging off"
    for n in VARIANTS:
        ms, ml = statistics.median(step_t[n]), statistics.median(load_t[n])
        print(f"{n:<14} step {ms:.4f} s (ratio {ms / statistics.median(step_t[base]):.4f})  "
              f"data_loading {ml * 1e3:.3f} ms (ratio {ml / statistics.median(load_t[base]):.3f})  "
              f"n={len(step_t[n])}")


def skip_bench() -> None:
    from titan_ledger.rehearsal import backend

    backend.install("cpu")
    from titan_ledger.config_registry import CORPUS_DIR, TOKENIZER_DIR
    from titan_ledger.data.loader import LedgerDataLoader
    from titan_ledger.data.prepare import load_tokenizer, prepare

    tok = load_tokenizer(TOKENIZER_DIR)
    with tempfile.TemporaryDirectory() as d:
        prefix = str(Path(d) / "bundled")
        prepare([str(CORPUS_DIR)], prefix, tokenizer=tok, progress=False)
        for source in ("text", "indexed"):
            cfg = LedgerDataLoader.Config(dataset="stdlib_docs", dataset_path=str(CORPUS_DIR), source=source,
                                          paths=[prefix] if source == "indexed" else [])
            dl = LedgerDataLoader(cfg, dp_world_size=2, dp_rank=0, tokenizer=tok, seq_len=256,
                                  local_batch_size=4)
            n = 500 if source == "text" else 8 * 10 ** 6  # indexed: 10^6 steps of 8 batches
            t0 = time.perf_counter()
            dl.skip(n)
            dt = time.perf_counter() - t0
            print(f"skip {source:<8} {n} batches in {dt * 1e3:.3f} ms = {n / dt:,.0f} batches/s")
        base = ["--job.config_file", str(ROOT / "train_configs/debug_cpu_indexed.toml"),
                "--dataloader.paths", prefix, "--dataloader.prepare_from", "", "--metrics.log_freq", "1"]
        for name, extra in (("6 steps", ["--training.steps", "6"]),
                            ("skip 3-1000002", ["--training.steps", "1000006",
                                                "--ledger.skip.steps", "3-1000002"])):
            with tempfile.TemporaryDirectory() as out:
                t0 = time.perf_counter()
                p = torchrun(base + extra + ["--dump_folder", out])
                wall = time.perf_counter() - t0
                if p.returncode:
                    sys.exit(explain(p))
                from titan_ledger.format.records import read_ledger

                rows = read_ledger(Path(out) / "ledger" / "signals.jsonl").history
                skip = [r["step_time_s"] for r in rows if r["skipped"]]
                trained = sorted(r["step_time_s"] for r in rows if not r["skipped"])
                print(f"run {name:<15} wall {wall:.1f} s, trained steps {len(trained)}, median step "
                      f"{statistics.median(trained):.3f} s, skip row {skip[0] * 1e3 if skip else 0:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-only", action="store_true")
    a = ap.parse_args()
    if not a.skip_only:
        train_bench(a.steps, a.repeats, a.warmup)
    skip_bench()


if __name__ == "__main__":
    main()
