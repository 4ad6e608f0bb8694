"""Step time of LedgerTrainer (signals every step) vs stock torchtitan Trainer.

    python bench/bench_ledger_overhead.py [--steps 20] [--repeats 3] [--warmup 3]

Same config (titan_ledger's ``debug_cpu``: llama3 debugmodel, bundled corpus,
FSDP2 over 2 gloo ranks), same seed, repetitions interleaved (stock, ledger, ...). Step time is torchtitan's own ``time_metrics/end_to_end(s)``
(log_freq 1 for both, so both pay torchtitan's per-step logging). Prints the
median of each and the ratio ledger / stock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers import explain, read_tb, torchrun  # noqa: E402

COMMON = ["--training.steps", None, "--parallelism.data_parallel_shard_degree", "2",
          "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "--debug.seed", "0"]
VARIANTS = {
    "stock Trainer": ["--module", "bench.stock_cpu", "--config", "debug_cpu_stock"],
    "LedgerTrainer": ["--module", "titan_ledger", "--config", "debug_cpu"],
    # the same without the max attention logit: on CPU it is one extra QK^T per layer
    # (on GPU Flex returns it from the attention kernel itself)
    "Ledger, no max_logit": ["--module", "titan_ledger", "--config", "debug_cpu", "--ledger.no_max_logit"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped from each run")
    args = ap.parse_args()
    common = list(COMMON)
    common[1] = str(args.steps)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for name, variant in VARIANTS.items():
            with tempfile.TemporaryDirectory() as out:
                proc = torchrun(variant + common + ["--dump_folder", out])
                if proc.returncode != 0:
                    sys.exit(explain(proc))
                per_step = read_tb(Path(out), "time_metrics/end_to_end(s)")
                times[name] += [t for s, t in per_step.items() if s > args.warmup]
            print(f"repeat {rep + 1}/{args.repeats}: {name} done", file=sys.stderr)
    med = {n: statistics.median(t) for n, t in times.items()}
    for n, t in times.items():
        print(f"{n:<22} median {med[n]:.4f} s/step  (n={len(t)}, min {min(t):.4f}, max {max(t):.4f})")
    for n in VARIANTS:
        if n != "stock Trainer":
            print(f"ratio {n} / stock Trainer: median {med[n] / med['stock Trainer']:.4f}, "
                  f"min {min(times[n]) / min(times['stock Trainer']):.4f}")


if __name__ == "__main__":
    main()
