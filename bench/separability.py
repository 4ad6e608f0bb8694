"""Are the real set's truths separable? Each scenario trained under every cause's prevention (issue 51 item 1).

Design decision: a scenario's cause is a claim about a counterfactual -- the one change
that removes its spikes while the other causes' changes do not. This bench measures
that claim instead of assuming it: every real scenario of ``bench/zoo.py`` (the tiny
model, one process, no fault injected) is trained as it is and once under each cause's
standard prevention (:data:`PREVENTIONS`), and the table lists each run's acting flags
(count, first, whether the loss went non-finite). A row whose own cause's column is the
only one with no flags (or by far the fewest) is separable; one where several columns
clear it has two truths, and a tree or a rerun cannot be scored on it.

Run::

    python bench/separability.py [--only lr_warmup_real ...] [--seed N] [--json] [--folder DIR]

One run is 600 steps (2,000 for ``optimizer_state_real``) on one core: ~1 min (~4 min);
the whole table ~25 min here.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo

#: each cause's standard prevention, as training flags appended to the scenario's (the
#: last occurrence of a flag wins): the article's chapter 3 -- a longer warm-up (LR), QK-norm
#: (attention logits), beta2 0.95 with eps 1e-8 (Adam's state), z-loss 1e-4 (output logits)
PREVENTIONS = {
    "none": (),
    "lr": ("--lr_scheduler.warmup_steps", "500"),
    "logit_growth": ("--model.qk_norm",),
    "optimizer_state": ("--optimizer.betas", "0.9", "0.95", "--optimizer.eps", "1e-8"),
    "output_logits": ("--loss.z_loss_weight", "1e-4"),
}
SCENARIOS = ("lr_warmup_real", "lr_divergence_real", "optimizer_state_real", "embedding_real")


#: the optimizer-state scenario's spike is the loss rising AFTER the switch to the text
#: (its first flag, step 1760, is the new data's own loss, before any update on it: no
#: optimizer change can remove that): the largest loss over the next RISE_STEPS steps
#: minus the loss at the switch
SWITCH, RISE_STEPS = 1760, 20


def flags_of(dump: Path) -> dict:
    """A finished run's acting flags, whether its loss went non-finite and, where the run
    reaches :data:`SWITCH`, the loss's rise after it (read back)."""
    from titan_ledger.format.reader import RunLedger

    led = RunLedger(dump)
    rows = led.trained_rows()
    bad = next((r["step"] for r in rows if r.get("loss") is None or not math.isfinite(r["loss"])), None)
    flags = led.spike_steps()
    by = {r["step"]: r["loss"] for r in rows}
    after = [by[s] for s in range(SWITCH + 1, SWITCH + 1 + RISE_STEPS) if s in by]
    return {"flags": len(flags), "first": flags[0] if flags else None, "nonfinite_at": bad,
            "last_step": rows[-1]["step"] if rows else 0,
            "rise_after_switch": round(max(after) - by[SWITCH], 3) if after and SWITCH in by else None}


def named_prevention(dump: Path) -> dict | None:
    """What ``diagnose`` names as the prevention at a run's first acting flag
    (``incident.judge``: ``{"text", "flags"}``), None when nothing flagged."""
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools.incident import judge

    led = RunLedger(dump)
    flags = led.spike_steps()
    if not flags:
        return None
    v = judge(led, flags[0])
    return {"cause": v["cause"], "underlying": v.get("underlying"), **(v.get("prevention") or {})}


def run_one(name: str, prevention: str, folder: Path, extra: tuple[str, ...] | None = None) -> dict:
    sc = zoo.BY_NAME[name]
    prefix, _ = zoo.build_corpus(folder / f"corpus_{sc.corpus}_clean_{sc.plant_step}_{sc.seed}", None,
                                 sc.plant_step, sc.seed, sc.corpus)
    dump = folder / f"{name}__{prevention}"
    shutil.rmtree(dump, ignore_errors=True)
    t0 = time.monotonic()
    # no checkpoints: this bench reads flags only
    args = [a for a in zoo.base_args(sc, prefix, sc.steps)] + ["--checkpoint.interval", "1000000",
                                                                *(PREVENTIONS[prevention] if extra is None else extra)]
    rc = zoo.train(args, dump, folder / f"{name}__{prevention}.log", sc.nproc)
    out = {"scenario": name, "truth": sc.cause, "prevention": prevention, "rc": rc, **flags_of(dump),
           "seconds": round(time.monotonic() - t0, 1)}
    shutil.rmtree(dump / "checkpoint", ignore_errors=True)
    return out


def table(rows: list[dict]) -> list[str]:
    """The scenario x prevention table (pure): ``flags (first)``, ``nan@S`` when the loss went
    non-finite; a cell in bold where it is the scenario's own cause's prevention."""
    cols = [*PREVENTIONS, "named"]
    out = ["| scenario | truth | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    by = {(r["scenario"], r["prevention"]): r for r in rows}
    for name in dict.fromkeys(r["scenario"] for r in rows):
        truth = next(r["truth"] for r in rows if r["scenario"] == name)
        cells = []
        for c in cols:
            r = by.get((name, c))
            if r is None:
                cells.append("")
                continue
            s = f"{r['flags']}" + (f" (first {r['first']})" if r["first"] is not None else "")
            s += f", nan@{r['nonfinite_at']}" if r["nonfinite_at"] is not None else ""
            s += f", rise {r['rise_after_switch']:+.2f}" if r.get("rise_after_switch") is not None else ""
            s += f" [{' '.join(r['named_flags'])}]" if r.get("named_flags") else ""
            cells.append(f"**{s}**" if c == truth else s)
        out.append(f"| `{name}` | {truth} | " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=SCENARIOS)
    ap.add_argument("--prevention", action="append", choices=list(PREVENTIONS),
                    help="these columns (default: all); the 'named' column (diagnose's prevention at the 'none' "
                         "run's first flag) follows whenever the 'none' run is there")
    ap.add_argument("--named-only", action="store_true",
                    help="only the 'named' column, from the 'none' runs already in --folder")
    ap.add_argument("--seed", type=int, help="--debug.seed for every launch (zoo.py --seed)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--folder", type=Path, default=Path("/tmp/titan_ledger_separability"))
    a = ap.parse_args(argv)
    if a.seed is not None:
        zoo.SEED_ARGS = ("--debug.seed", str(a.seed))
    a.folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.only or SCENARIOS:
        for p in ["named"] if a.named_only else [*(a.prevention or PREVENTIONS), "named"]:
            if p == "named":  # the prevention diagnose names at the unprevented run's first flag
                named = named_prevention(a.folder / f"{name}__none") if (a.folder / f"{name}__none").exists() else None
                if not named or not named.get("flags"):
                    continue
                r = run_one(name, p, a.folder, tuple(named["flags"]))
                r.update(named_flags=named["flags"], named_cause=named["cause"], named_underlying=named["underlying"])
            else:
                r = run_one(name, p, a.folder)
            rows.append(r)
            print(json.dumps(r) if a.json else f"{name:<22} {p:<16} {r['flags']:>4} flags, first {r['first']}, "
                  f"nan@{r['nonfinite_at']}  {r['seconds']:.0f}s", flush=True)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
