"""The GPU scenario set (issue 61 item 6): the two causes this CPU cannot produce, ready for
a lent GPU, as one command that fits its 15 minutes.

    bench/device/scenarios.py [--cpu] [--budget S] [--steps N] [--workdir DIR]

Design decision: the CPU's tiny model produces the LR, Adam's plateau and the attention-logit
stall (``bench/zoo.py --set real``); output-logit divergence and a bf16 precision failure
need more steps and a larger output layer than 2 cores train in a session (Wortsman et al.
2023: 2.4 M non-embedding parameters, LR 0.1, no weight decay, a 32k vocabulary, long
horizons). So this script runs them on the model they need (``wortsman_small``: 4 layers,
dim 256, a 32,768-token output layer over the bundled 2,048-token tokenizer, 256 x 32
tokens a step), each beside the run that carries its fix, and says whether the pair shows
the cause -- in order, within a wall-clock budget (what no longer fits is listed under
``not_run``, the JSON still printed):

* ``output_logits`` / ``output_logits_zloss``: LR 0.1 after a 5% warm-up, no weight decay,
  cosine decay; without and with z-loss 1e-4 (PaLM's fix). Shows the cause when log Z's max
  drifts (its last tenth's median >= 2x its first tenth's) without z-loss and at most half
  as far with it, or when the run without z-loss is flagged (a spike or the stall rule)
  and the one with it is not.
* ``bf16`` / ``fp32``: the same model at LR 3e-3 with weight decay 0.1, pure bf16 (bf16
  master weights and Adam moments, ``--training.dtype bfloat16``) against fp32. Shows the
  cause when the precision audit fails at start in bf16 only and bf16's last-100-step
  median loss is higher than fp32's (weight decay rounds away under bf16's spacing).

``--cpu`` runs the same code on the CPU at a few dozen steps (25 s for the four runs;
``tests/bench/test_gpu_scenarios_cpu.py`` runs it in CI; nothing is expected to show
there). Never run on a GPU yet: no GPU was lent to the sessions that wrote it. Logs and ``scenarios.json`` go to ``--workdir`` (default
``$OUT/gpu_scenarios`` when ``$OUT`` is set, else ``outputs/gpu_scenarios``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from pack import Guard, pick_device, run_child  # noqa: E402

#: what each mode trains: the CUDA plan sized for one H100/H200 within 15 minutes (a step of
#: this model is a few ms there: 4,000 steps a run, four runs); the CPU plan only the code path
PLANS = {
    "cuda": {"config": "wortsman_small", "steps": 4000, "extra": [], "budget_s": 780.0},
    "cpu": {"config": "tiny_cpu", "steps": 30, "extra": ["--training.local_batch_size", "2"], "budget_s": 300.0},
}
BASE = ["--parallelism.data_parallel_shard_degree", "1", "--metrics.log_freq", "100", "--ledger.update_norm",
        "--lr_scheduler.decay_type", "cosine"]
LOGITS = ["--optimizer.lr", "0.1", "--optimizer.weight_decay", "0"]
PRECISION = ["--optimizer.lr", "3e-3", "--optimizer.weight_decay", "0.1"]
#: (name, flags) in the order they run: each cause beside its fix
RUNS = [("output_logits", LOGITS), ("output_logits_zloss", [*LOGITS, "--loss.z_loss_weight", "1e-4"]),
        ("bf16", [*PRECISION, "--training.dtype", "bfloat16"]), ("fp32", PRECISION)]


def train(name: str, flags: list[str], plan: dict, work: Path, guard: Guard, device: str) -> dict:
    """One run of ``plan``'s model: its rc, and what the ledger says of it (:func:`read`)."""
    started = time.time()
    steps = plan["steps"]
    cmd = [sys.executable, "-m", "titan_ledger.train", "--job.config", plan["config"], "--training.steps",
           str(steps), "--lr_scheduler.warmup_steps", str(max(1, steps // 20)), *BASE, *plan["extra"], *flags,
           "--job.dump_folder", str(work / name)]
    rc, tail = run_child(cmd, work / f"{name}.log", guard.left(), device)
    guard.note(name, started, rc=rc)
    out = {"rc": rc, **read(work / name)}
    if rc != 0:
        out["log_tail"] = tail[-1500:]
    return out


def read(dump: Path) -> dict:
    """A run's ledger in numbers: log Z's max over the first and last tenth, the last 100
    steps' median loss, its flags (spikes, stalls) and the precision audit's failures."""
    from titan_ledger.format.reader import RunLedger

    try:
        led = RunLedger(dump)
        rows = led.trained_rows()
    except Exception as e:  # a run that died before its ledger: the rc says so
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    if not rows:
        return {"steps": 0}
    tenth = max(1, len(rows) // 10)

    def med(rs, key):
        xs = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        return round(statistics.median(xs), 4) if xs else None

    return {"steps": rows[-1]["step"], "logz_first_tenth": med(rows[:tenth], "logz_max"),
            "logz_last_tenth": med(rows[-tenth:], "logz_max"), "loss_last100": med(rows[-100:], "loss"),
            "max_logit_last_tenth": med(rows[-tenth:], "max_logit"), "spikes": led.spike_steps(),
            "stalls": [int(e["step"]) for e in led.response_events() if e.get("stall")],
            "audit_failed": [c["check"] for c in (led.precision() or []) if c.get("ok") is False]}


def shows(runs: dict) -> dict:
    """Whether each pair shows its cause (pure: the runs' :func:`read`)."""
    out = {}
    a, b = runs.get("output_logits"), runs.get("output_logits_zloss")
    if a and b and a.get("logz_first_tenth") and b.get("logz_first_tenth"):
        drift = a["logz_last_tenth"] / a["logz_first_tenth"]
        fixed = b["logz_last_tenth"] / b["logz_first_tenth"]
        flagged = bool(a["spikes"] or a["stalls"]) and not (b["spikes"] or b["stalls"])
        out["output_logits"] = {"drift": round(drift, 3), "drift_with_zloss": round(fixed, 3),
                                "flagged_without_zloss_only": flagged,
                                "shown": (drift >= 2 and fixed - 1 <= (drift - 1) / 2) or flagged}
    c, d = runs.get("bf16"), runs.get("fp32")
    if c and d and c.get("loss_last100") is not None and d.get("loss_last100") is not None:
        out["bf16"] = {"audit_failed_bf16": c["audit_failed"], "audit_failed_fp32": d["audit_failed"],
                       "loss_bf16": c["loss_last100"], "loss_fp32": d["loss_last100"],
                       "shown": bool(c["audit_failed"]) and not d["audit_failed"]
                       and c["loss_last100"] > d["loss_last100"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the code path on the CPU (a few dozen steps)")
    ap.add_argument("--budget", type=float, help="seconds for every run together (default 780 CUDA, 300 CPU)")
    ap.add_argument("--steps", type=int, help="steps a run (default 4000 CUDA, 30 CPU)")
    ap.add_argument("--workdir", help="logs and scenarios.json (default $OUT/gpu_scenarios or outputs/gpu_scenarios)")
    args = ap.parse_args(argv)
    device = pick_device(args.cpu)
    plan = dict(PLANS[device])
    plan["steps"] = args.steps or plan["steps"]
    guard = Guard(args.budget or plan["budget_s"])
    work = Path(args.workdir or (Path(os.environ["OUT"]) / "gpu_scenarios" if os.environ.get("OUT")
                                 else ROOT / "outputs" / "gpu_scenarios"))
    work.mkdir(parents=True, exist_ok=True)
    runs, not_run = {}, []
    for name, flags in RUNS:
        # a run needs its share of what is left: a pair is useless without its second half
        if guard.left() < 30:
            not_run.append(name)
            continue
        runs[name] = train(name, flags, plan, work, guard, device)
    result = {"scenarios": "titan_ledger GPU scenario set (issue 61)", "mode": device, "config": plan["config"],
              "steps": plan["steps"], "runs": runs, "shows": shows(runs), "not_run": not_run,
              "elapsed_s": round(guard.elapsed(), 1), "time_log": guard.log}
    (work / "scenarios.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    ok = not not_run and all(r.get("rc") == 0 for r in runs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
