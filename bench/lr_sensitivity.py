"""LR sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
training instabilities"): how much final loss a prevention feature saves across a grid
of learning rates.

    python bench/lr_sensitivity.py [--corpus copy hetero] [--lr 1e-3 3e-3 1e-2 3e-2 1e-1]
        [--variant baseline qk_norm z_loss qk_norm+z_loss qk_clip] [--steps 200] [--folder DIR] [--json]

Definition (their §3.1): for a grid of LRs, LR sensitivity =
mean over the grid of ``min(final loss(lr), loss at init) - min over the grid of final loss``:
0 when every LR trains as well as the best one; a diverged LR counts as the loss at
init (so one divergence costs ``init - best``, not infinity); it is negative only when
the best LR ends above some run's loss at init (nothing trained: too few steps). Here
"final loss" is the mean training loss of the last 10% of steps (``signals.jsonl``),
"loss at init" step 1's.

Each (corpus, variant, LR) is one fresh one-process run of ``debug_cpu`` (llama3 debug
model, 2 x 128 tokens a step, ``--debug.seed 0``, the indexed bench corpus from
``bench/corpora.py``, warm-up 10% of the steps, torchtitan's schedule otherwise),
recorded under ``--folder`` and reused when complete (``--fresh`` retrains). Variants:
``baseline``; ``qk_norm`` (``--model.qk_norm``); ``z_loss`` (``--loss.z_loss_weight
1e-4``); ``qk_norm+z_loss``; ``qk_clip`` (``--qk_clip.enable --qk_clip.threshold 100``,
Kimi K2's and Megatron's threshold). The table
per variant: final loss at each LR, the largest max attention logit, its median over
the last half of the steps (``late_max_logit``: where the logits sit, not one step's
excursion) and the largest log Z seen (``logz_max``), and the sensitivity.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import corpora  # noqa: E402
from bench.warm_base import read_rows  # noqa: E402

# the launch prefix: $TITAN_LEDGER_TORCHRUN (a site wrapper; the test suite's warm launcher) or torchrun
from titan_ledger.tools.runs import torchrun_prefix  # noqa: E402

CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
OUT = ROOT / "outputs" / "lr_sensitivity"
LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
VARIANTS = {
    "baseline": [],
    "qk_norm": ["--model.qk_norm"],
    "z_loss": ["--loss.z_loss_weight", "1e-4"],
    "qk_norm+z_loss": ["--model.qk_norm", "--loss.z_loss_weight", "1e-4"],
    "qk_clip": ["--qk_clip.enable", "--qk_clip.threshold", "100"],
}


# --------------------------------------------------------------------------- the math (pure)
def final_loss(losses: list[float], tail: float = 0.1) -> float:
    """Mean of the last ``tail`` fraction of the losses (at least one); inf when any of
    them is not finite (a diverged run)."""
    if not losses:
        return math.inf
    k = max(1, int(round(len(losses) * tail)))
    last = losses[-k:]
    return sum(last) / k if all(math.isfinite(x) for x in last) else math.inf


def sensitivity(finals: dict[float, float], inits: dict[float, float]) -> float:
    """Wortsman et al.'s LR sensitivity over the LRs of ``finals`` (each capped at its
    loss at init)."""
    best = min(finals.values())
    if not math.isfinite(best):
        return math.nan  # nothing trained: undefined
    return sum(min(finals[lr], inits[lr]) - best for lr in finals) / len(finals)


# --------------------------------------------------------------------------- runs
def run_name(corpus: str, variant: str, lr: float, steps: int) -> str:
    return f"{corpus}_{variant.replace('+', '_')}_lr{lr:g}_{steps}st"


def train_cmd(prefix: Path, dump: Path, variant: str, lr: float, steps: int) -> list[str]:
    return [*torchrun_prefix(), "--standalone", "--nproc_per_node", "1",
            "-m", "titan_ledger.train", "--job.config_file", str(CONFIG), "--training.steps", str(steps),
            "--training.local_batch_size", "2", "--training.seq_len", "128",
            "--parallelism.data_parallel_shard_degree", "1", "--optimizer.lr", f"{lr:g}",
            "--lr_scheduler.warmup_steps", str(max(1, steps // 10)),
            "--dataloader.source", "indexed", "--dataloader.paths", str(prefix),
            "--debug.seed", "0", "--metrics.log_freq", "50", "--ledger.response.action", "none",
            *VARIANTS[variant], "--dump_folder", str(dump)]


def trained(dump: Path, steps: int) -> list[dict] | None:
    sig = dump / "ledger" / "signals.jsonl"
    rows = read_rows(sig) if sig.is_file() else []
    return rows if rows and rows[-1]["step"] >= steps else None


def train(corpus: str, variant: str, lr: float, steps: int, folder: Path, fresh: bool, log) -> list[dict]:
    dump = folder / run_name(corpus, variant, lr, steps)
    rows = None if fresh else trained(dump, steps)
    if rows is not None:
        return rows
    shutil.rmtree(dump, ignore_errors=True)
    prefix = corpora.prepare(corpus)
    logf = folder / f"{dump.name}.log"
    t0 = time.monotonic()
    with open(logf, "w") as f:
        rc = subprocess.run(train_cmd(prefix, dump, variant, lr, steps), cwd=ROOT, env=corpora.env(),
                            stdout=f, stderr=subprocess.STDOUT).returncode
    rows = read_rows(dump / "ledger" / "signals.jsonl") if (dump / "ledger" / "signals.jsonl").is_file() else []
    log(f"{dump.name}: exit {rc}, {len(rows)} steps in {time.monotonic() - t0:.0f} s")
    if not rows:
        raise SystemExit(f"{dump.name}: no signals recorded (exit {rc}); log: {logf}")
    return rows  # a run stopped by a non-finite loss (exit 1) is a diverged run, kept as such


def _num(x) -> float:
    return math.nan if x is None else float(x)


def summarize(rows: list[dict], steps: int) -> dict:
    losses = [_num(r.get("loss")) for r in rows if not r.get("skipped")]
    if len(losses) < steps:  # stopped early (non-finite loss): diverged
        losses = losses + [math.inf]
    ml = [_num(r.get("max_logit")) for r in rows]
    lz = [_num(r.get("logz_max")) for r in rows]
    late = sorted(x for x in ml[len(ml) // 2:] if math.isfinite(x))
    return {"init": losses[0], "final": final_loss(losses), "steps": len(rows),
            "max_logit": max((x for x in ml if math.isfinite(x)), default=math.nan),
            # where the logits sit, not one step's excursion (QK-clip's hold)
            "late_max_logit": late[len(late) // 2] if late else math.nan,
            "max_logz": max((x for x in lz if math.isfinite(x)), default=math.nan)}


def table(res: dict) -> list[str]:
    lines = []
    for corpus, by_variant in res.items():
        lrs = sorted({lr for v in by_variant.values() for lr in v["runs"]})
        lines.append(f"{corpus}: final loss at each LR (largest max logit / its median over the last half "
                     f"of the steps / largest log Z); sensitivity")
        lines.append("  " + "variant".ljust(16) + "".join(f"{lr:>29g}" for lr in lrs) + "   sensitivity")
        for variant, v in by_variant.items():
            cells = []
            for lr in lrs:
                r = v["runs"][lr]
                cells.append(f"{r['final']:>7.3f} ({r['max_logit']:>5.0f}/{r['late_max_logit']:>5.0f}/"
                             f"{r['max_logz']:>5.1f})".rjust(29))
            lines.append("  " + variant.ljust(16) + "".join(cells) + f"   {v['sensitivity']:.3f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", nargs="+", choices=corpora.CORPORA, default=["copy", "hetero"])
    ap.add_argument("--lr", nargs="+", type=float, default=list(LRS))
    ap.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--folder", type=Path, default=OUT)
    ap.add_argument("--fresh", action="store_true", help="retrain runs already recorded")
    ap.add_argument("--json", action="store_true", help="one JSON object at the end (progress on stderr)")
    a = ap.parse_args(argv)
    a.folder.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr if a.json else sys.stdout, flush=True)

    res: dict = {}
    for corpus in a.corpus:
        for variant in a.variant:
            runs = {lr: summarize(train(corpus, variant, lr, a.steps, a.folder, a.fresh, log), a.steps)
                    for lr in a.lr}
            res.setdefault(corpus, {})[variant] = {
                "runs": runs,
                "sensitivity": sensitivity({lr: r["final"] for lr, r in runs.items()},
                                           {lr: r["init"] for lr, r in runs.items()})}
    if a.json:
        print(json.dumps({"steps": a.steps, "results": {c: {v: {**x, "runs": {f"{lr:g}": r for lr, r in x["runs"].items()}}
                                                              for v, x in bv.items()} for c, bv in res.items()}},
                         default=str))
    else:
        print("\n".join(table(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
