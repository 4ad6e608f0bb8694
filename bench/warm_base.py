"""A warm base for evidence runs (issue 24, item 1): the debug model trained well below the unigram level.

    python bench/warm_base.py [--steps N] [--force] [--json]

The cold debug model sits at loss ~6-7 in every bench, where most documents look
alike to it. This builds once, and caches, a checkpoint of the ``debug_cpu`` model
(llama3 debugmodel, FSDP over 2 gloo ranks, 4 rows x 256 tokens per rank, fp32)
trained on the heterogeneous clean corpus (``bench/corpora.py``: bundled
docstrings, standard-library source, licence texts, numeric tables) at a higher LR
than the benches (``TRAIN_FLAGS``: 2e-3, 50 warmup steps, linear decay to 0.1x),
and prints its final loss next to the corpus's unigram entropy (the loss of the
best context-free model).

Cache: ``outputs/warm_base/<hash>/`` where ``<hash>`` covers every input -- the
corpus manifest hash, the training flags and steps, and the code that defines the
model (torch and torchtitan versions, the ``debug_cpu`` config function's source,
``train_configs/debug_cpu.toml``). A matching folder with ``base.json`` is reused;
anything else is rebuilt (an interrupted build resumes from its last full
checkpoint, every ``CKPT_INTERVAL`` steps). The base is the checkpoint written at
the last step (``run/checkpoint/step-N``, fp32; it holds the optimizer state too,
which a start from it leaves out); the interval checkpoints are deleted.

A later run starts from it at step 1 (fresh optimizer, fresh LR schedule, fresh
spike-detector history) with ``start_flags(base)``::

    --checkpoint.enable --checkpoint.initial_load_path <base>/run/checkpoint/step-N
    --checkpoint.initial_load_model_only --checkpoint.load_only

(torchtitan 0.3.0 ``Checkpoint.Config``: ``initial_load_path`` is read only while the
run's own checkpoint folder is empty, ``initial_load_model_only`` loads the model
weights alone, ``load_only`` keeps the run from saving checkpoints of its own). The
weights do not depend on ``seq_len`` (RoPE's cache is not persistent), so a run
with a shorter ``seq_len`` or another DP size loads them too (DCP reshards).

Measured here (2 shared cores, load average 3-4): 1,500 steps (3.07 M tokens, 0.98
of the corpus's 3.15 M: every token seen once at most) in 1,708 s (28 min, 1.14
s/step); loss 8.18 at step 1, 4.81 at 50, 3.57 at 250, 2.77 at 500; final loss
2.50 (mean of the last 50 steps) against a unigram entropy of 5.91 nats: 3.4 nats
below. A warm run on the same corpus starts at 2.3-2.5.
Rebuilt on a slower day (nothing else running): 2,517 s (1.68 s/step); 4.81 at 50, 3.57
at 250, 2.76 at 500, final loss 2.499.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import corpora  # noqa: E402

OUT = ROOT / "outputs" / "warm_base"
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
STEPS = 1500
CKPT_INTERVAL = 250
TRAIN_FLAGS = ("--training.local_batch_size", "4", "--training.seq_len", "256",
               "--parallelism.data_parallel_shard_degree", "2",
               "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "50",
               "--lr_scheduler.decay_ratio", "1.0", "--lr_scheduler.min_lr_factor", "0.1",
               "--debug.seed", "0", "--dataloader.seed", "0", "--metrics.log_freq", "50")
NPROC = 2
TAIL = 50  # the final loss: the mean of the last TAIL steps' training loss


def code_version() -> dict:
    """What defines the model: library versions, the debug_cpu config function, its toml."""
    import torch
    import torchtitan

    src = (ROOT / "titan_ledger" / "config_registry.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "debug_cpu")
    return {"torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", "?"),
            "debug_cpu": corpora.sha(ast.get_source_segment(src, fn))[:16],
            "debug_cpu.toml": corpora.sha(CONFIG.read_bytes())[:16]}


def inputs(prefix: Path, steps: int) -> dict:
    m = json.loads((prefix.parent / "manifest.json").read_text())
    return {"corpus": corpora.manifest_hash(m), "steps": steps, "nproc": NPROC, "flags": list(TRAIN_FLAGS),
            "ckpt_interval": CKPT_INTERVAL, "code": code_version()}


def inputs_hash(inp: dict) -> str:
    return corpora.sha(json.dumps(inp, sort_keys=True, separators=(",", ":")))[:12]


def train_cmd(prefix: Path, steps: int, dump: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
            "-m", "titan_ledger.train", "--job.config_file", str(CONFIG), "--training.steps", str(steps),
            "--dataloader.source", "indexed", "--dataloader.paths", str(prefix), *TRAIN_FLAGS,
            "--checkpoint.enable", "--checkpoint.interval", str(CKPT_INTERVAL), "--checkpoint.keep_latest_k", "2",
            "--dump_folder", str(dump)]


def read_rows(path: Path) -> list[dict]:
    """A ledger JSONL file's rows (segment headers dropped; a later segment's row for a
    step replaces an earlier one, as after a resume)."""
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if "schema" in r:
            continue
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def loss_curve(dump: Path) -> list[tuple[int, float]]:
    return [(r["step"], float(r["loss"])) for r in read_rows(dump / "ledger" / "signals.jsonl")
            if not r.get("skipped") and r.get("loss") is not None]


def ensure(steps: int = STEPS, force: bool = False, log=print) -> dict:
    """The warm base (built if no folder matches its inputs); returns its base.json."""
    prefix = corpora.prepare("hetero")
    inp = inputs(prefix, steps)
    folder = OUT / inputs_hash(inp)
    done = folder / "base.json"
    if done.is_file() and not force:
        info = json.loads(done.read_text())
        if Path(info["checkpoint"], ".metadata").is_file():
            return {**info, "cached": True}
    if force:
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "inputs.json").write_text(json.dumps(inp, indent=1) + "\n")
    dump = folder / "run"
    log(f"warm base: training {steps} steps on {prefix} into {dump} (log: {folder / 'train.log'})")
    t0 = time.monotonic()
    with open(folder / "train.log", "a") as f:
        rc = subprocess.run(train_cmd(prefix, steps, dump), cwd=ROOT, env=corpora.env(), stdout=f,
                            stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - t0
    ckpt = dump / "checkpoint" / f"step-{steps}"
    if rc != 0 or not (ckpt / ".metadata").is_file():
        raise SystemExit(f"warm base: training failed (exit {rc}); log: {folder / 'train.log'}")
    for d in (dump / "checkpoint").iterdir():  # the interval checkpoints only served a resume
        if d.is_dir() and d.name != ckpt.name:
            shutil.rmtree(d, ignore_errors=True)
    curve = loss_curve(dump)
    cinfo = corpora.info(prefix)
    tail = [x for _, x in curve[-TAIL:]]
    info = {"hash": folder.name, "checkpoint": str(ckpt), "steps": steps, "build_s": round(seconds, 1),
            "s_per_step": round(seconds / steps, 3),
            "final_loss": round(sum(tail) / len(tail), 4), "last_loss": round(curve[-1][1], 4),
            "loss_at": {s: round(x, 4) for s, x in curve if s in (1, 10, 50, 100, 250, 500, 1000, 1500, 2000, 3000)},
            "unigram_entropy": cinfo["unigram_entropy"], "corpus_tokens": cinfo["tokens"],
            "tokens_trained": steps * 2 * 4 * 256, "corpus": str(prefix), "inputs": inp}
    info["below_unigram"] = round(info["unigram_entropy"] - info["final_loss"], 4)
    done.write_text(json.dumps(info, indent=1) + "\n")
    return {**info, "cached": False}


def start_flags(info: dict) -> list[str]:
    """Flags that start a run at step 1 from the warm base's weights (and save nothing)."""
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(info["checkpoint"]),
            "--checkpoint.initial_load_model_only", "--checkpoint.load_only"]


def cached(steps: int = STEPS) -> dict | None:
    """The warm base's base.json if it is built for the current inputs, else None (builds nothing
    beyond the corpus)."""
    prefix = corpora.prepare("hetero")
    done = OUT / inputs_hash(inputs(prefix, steps)) / "base.json"
    if not done.is_file():
        return None
    info = json.loads(done.read_text())
    return info if Path(info["checkpoint"], ".metadata").is_file() else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--force", action="store_true", help="rebuild even when a base with these inputs exists")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    info = ensure(a.steps, a.force, log=(lambda *_: None) if a.json else print)
    if a.json:
        print(json.dumps({k: v for k, v in info.items() if k != "inputs"}))
    else:
        print(f"warm base {'(cached) ' if info['cached'] else ''}{info['checkpoint']}\n"
              f"  {info['steps']} steps, built in {info['build_s']:.0f} s ({info['s_per_step']:.2f} s/step)\n"
              f"  final loss {info['final_loss']:.3f} (mean of the last {TAIL} steps; last {info['last_loss']:.3f})"
              f" vs unigram entropy {info['unigram_entropy']:.3f}: {info['below_unigram']:.2f} nats below\n"
              f"  loss by step {info['loss_at']}\n"
              f"  corpus {info['corpus_tokens']:,} tokens, {info['tokens_trained']:,} trained\n"
              f"  start a run from it with: {' '.join(start_flags(info))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
