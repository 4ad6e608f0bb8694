"""``diagnose RUN --rerun``: each episode's fix proven over the episode's horizon.

Design decision: a fix is proven the way a user applies it. For every episode whose fix was
not proven over its horizon, each candidate -- the fixes its incidents measured in a window,
the cause's own fixes (:data:`titan_ledger.format.answers.causes.CAUSES`' ``horizon``), the
LR's cut (the driver of most of them) -- is relaunched *as the printed command would
relaunch it* (the run's recorded flags, the fix's flags, from the last checkpoint at or before
the onset, or from scratch) up to the horizon's end (``--ledger.rehearsal.rerun stop=N``:
the LR schedule stays the run's), and judged against the run itself -- the unchanged control,
bit for bit on a deterministic machine -- by the run's own acting rules and its loss:

* an incident is *removed* when the relaunch has no acting flag within ``WINDOW`` steps of it;
* a relaunch *removes* the episode when it removes every incident and ends at most ``GAIN``
  higher in loss, *lowers* it when it removes at least half of them or flags fewer steps over
  the horizon (ending at most ``GAIN`` higher), or ends ``GAIN`` lower in loss; a broken
  model's fix must leave the model healthy, whatever else it does;
* the fix is the best effect, then the lowest loss at the horizon's end.

The horizon covers the episode: from the relaunch's start to its last incident plus
``MARGIN`` steps; a broken model (which never recovered) to the run's end. The budget
(relaunches x steps) is printed before anything starts; ``parallel`` relaunches run at once.
What was measured is recorded (``episodes.jsonl``) and every view reads it
(:mod:`titan_ledger.format.answers.of_run`). An episode is proven once: a recorded proof is
not run again.
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_ledger.format import records
from titan_ledger.format.answers import health
from titan_ledger.format.answers.causes import CAUSES, derive
from titan_ledger.format.answers.command import fix_command, start_of
from titan_ledger.format.answers.episodes import Episode, HorizonProof
from titan_ledger.format.answers.of_run import RunAnswers
from titan_ledger.format.answers.records import Context
from titan_ledger.format.reader import RunLedger

WINDOW = 10  # an acting flag within this many steps of an incident is the incident again
MARGIN = 50  # the horizon runs this many steps past the episode's last incident
GAIN = 0.01  # a loss this much lower at the horizon's end: lowered
LOSS_TAIL = 20  # "the loss at the horizon's end": the mean over its last this many trained steps
#: what a relaunch of a proof turns off where the run's policy is observe: the proofs and
#: the host ring change nothing a run trains (bit-equal; docs/spike-response.md), and cost
QUIET = ("--ledger.proof.scope", "off", "--ledger.snapshots.every", "0")


@dataclass(frozen=True, slots=True)
class Trial:
    """One candidate fix to relaunch."""

    variant: str
    cause: str
    flags: tuple[str, ...]
    change: str
    resumes: bool = True


#: relaunches an episode's proof tries at most (each trains the whole horizon)
MAX_TRIALS = 4


def trials(ep: Episode, ctx: Context) -> list[Trial]:
    """The candidates for an episode, at most :data:`MAX_TRIALS`: its fix, its cause's horizon
    fixes and the LR's cut (the driver of most), then what its incidents measured; each a
    change to this run, each once."""
    out: list[Trial] = []

    def add(variant: str, cause: str, flags: tuple[str, ...], change: str, resumes: bool = True) -> None:
        if flags and len(out) < MAX_TRIALS and not any(t.flags == flags for t in out):
            out.append(Trial(variant, cause, flags, change, resumes))

    if ep.fix is not None:
        add(ep.fix.variant, ep.fix.cause, ep.fix.flags, ep.fix.change, ep.fix.resumes)
    for cause in dict.fromkeys(c for c in (ep.cause, "lr") if c in CAUSES):
        for name, params in CAUSES[cause].horizon:
            ch = derive(name, ctx.knobs, dict(params))
            if ch is not None:
                add(name, cause, ch.flags, ch.words, ch.resumes)
    for f in ep.candidates:
        add(f.variant, f.cause, f.flags, f.change, f.resumes)
    return out


def horizon_of(ep: Episode, end: int) -> int:
    """The horizon's last step: the episode's last incident plus a margin; a broken model's, the run's end."""
    if ep.kind == "broken":
        return end
    return min(end, max(ep.incidents or (ep.last,)) + MARGIN)


def _flags(led: RunLedger, first: int, last: int) -> list[int]:
    return sorted({int(e["step"]) for e in led.spike_events() if first <= int(e["step"]) <= last})


def _tail_loss(led: RunLedger, first: int, last: int) -> float | None:
    rows = [r for r in led.signals_between(first, last) if not r.get("skipped")
            and isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    xs = [r["loss"] for r in rows[-LOSS_TAIL:]]
    return statistics.fmean(xs) if xs else None


def _healthy(led: RunLedger, last: int) -> bool:
    return not health.read(r for r in led.signals_between(1, last) if not r.get("skipped"))


def judge(ep: Episode, orig: RunLedger, trial: RunLedger, first: int, last: int) -> dict[str, Any]:
    """A relaunch against the run over ``first``..``last`` (the module docstring's rules)."""
    fo, ft = _flags(orig, first, last), _flags(trial, first, last)
    incidents = [s for s in ep.incidents if first <= s <= last]
    removed = [s for s in incidents if not any(abs(f - s) <= WINDOW for f in ft)]
    lo, lt = _tail_loss(orig, first, last), _tail_loss(trial, first, last)
    lower = lo is not None and lt is not None and lt < (1 - GAIN) * lo
    not_higher = lo is not None and lt is not None and lt <= (1 + GAIN) * lo
    healthy = _healthy(trial, last) if ep.kind == "broken" else None
    if healthy is False:  # a fix for a broken model leaves it healthy, whatever else it does
        effect = "not removed"
    elif incidents and len(removed) == len(incidents) and not_higher:
        effect = "removed"
    elif incidents and (2 * len(removed) >= len(incidents) or len(ft) < len(fo)) and not_higher:
        effect = "lowered"
    elif lower:
        effect = "lowered"
    else:
        effect = "not removed"
    detail = (f"over steps {first}-{last}: {len(ft)} acting flag(s) against the run's {len(fo)}"
              + (f", {len(removed)} of its {len(incidents)} incident(s) gone" if incidents else "")
              + (f"; the loss at the end {lt:.4g} against {lo:.4g}" if lo is not None and lt is not None else "")
              + ("; the model stayed healthy" if healthy else "; the model broke too" if healthy is False else ""))
    return {"effect": effect, "flags_in_horizon": len(ft), "incidents_removed": removed, "final_loss": lt,
            "healthy": healthy, "detail": detail}


_ORDER = {"removed": 0, "lowered": 1, "not removed": 2, "failed": 3}


def choose(variants: list[dict[str, Any]]) -> int | None:
    """The fix, by its index: the best effect, then the lowest loss at the horizon's end (None:
    none worked). Two candidates of one variant (the LR x0.3 and x0.1) are told apart by index."""
    good = [i for i, v in enumerate(variants) if v.get("effect") in ("removed", "lowered")]
    if not good:
        return None
    return min(good, key=lambda i: (_ORDER[variants[i]["effect"]], variants[i].get("final_loss")
                                    if variants[i].get("final_loss") is not None else math.inf))


def _relaunch(cmd: str, log: Path) -> int:
    with open(log, "w") as f:
        return subprocess.run(cmd, shell=True, stdout=f, stderr=subprocess.STDOUT, cwd="/").returncode


def prove(led: RunLedger, ep: Episode, ctx: Context, end: int, *, parallel: int = 1, log=print,
          max_steps: int | None = None) -> HorizonProof | None:
    """Relaunch every candidate of ``ep`` to its horizon, judge them, record what was measured."""
    cands = trials(ep, ctx)
    if not cands:
        log(f"episode at step {ep.onset}: no candidate fix makes a change to this run: nothing to prove")
        return None
    last = horizon_of(ep, end)
    plans = []
    for i, t in enumerate(cands):
        ck, where = start_of(ctx, ep.relaunch, t.resumes)  # where the printed command starts
        folder = Path(f"{str(ctx.dump).rstrip('/')}-episode{ep.onset}") / f"{i}-{t.variant}"
        quiet = QUIET if ctx.policy in (None, "observe") else ()
        cmd = fix_command(ctx, (*t.flags, *quiet, "--ledger.rehearsal.rerun", f"stop={last}"), ck, str(folder))
        plans.append((t, ck, where, folder, cmd))
    steps = sum(last - (ck or 0) for _, ck, _, _, _ in plans)
    log(f"episode at steps {ep.onset}-{ep.last} ({ep.cause_text}): proving {len(plans)} fix(es) over its horizon "
        f"(to step {last}): budget {len(plans)} relaunch(es) x up to {last} steps = {steps} training steps "
        f"({ctx.world_size} process(es) each, {parallel} at a time; {plans[0][2]})")
    if max_steps is not None and steps > max_steps:
        log(f"  refused: more than --rerun-max-steps {max_steps} training steps")
        return None
    if any(c is None for *_, c in plans):
        log("  refused: the run records no launch to relaunch (train with python -m titan_ledger.train)")
        return None

    def run(plan) -> dict[str, Any]:
        t, ck, where, folder, cmd = plan
        shutil.rmtree(folder, ignore_errors=True)  # (an interrupted proof's: a relaunch starts clean)
        folder.parent.mkdir(parents=True, exist_ok=True)
        rc = _relaunch(cmd, folder.parent / f"{folder.name}.log")
        row = {"variant": t.variant, "cause": t.cause, "flags": list(t.flags), "change": t.change,
               "resumes": t.resumes, "start": where, "folder": str(folder), "rc": rc, "command": cmd}
        if rc != 0:
            return {**row, "effect": "failed", "detail": f"the relaunch failed (exit {rc}; {folder}.log)"}
        first = (ck or 0) + 1
        return {**row, **judge(ep, led, RunLedger(folder, led.folder.name), first, last)}

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        variants = list(pool.map(run, plans))
    for v in variants:
        log(f"  {v['change']}: {v['effect']} ({v.get('detail', '')})")
    first = min((ck or 0) for _, ck, *_ in plans) + 1
    proof = HorizonProof(onset=ep.onset, horizon=(first, last), start=plans[0][1], variants=tuple(variants),
                         control={"flags_in_horizon": len(_flags(led, first, last)),
                                  "final_loss": _tail_loss(led, first, last)},
                         chosen=choose(variants), steps=steps)
    record(led, proof)
    log(f"  the fix: {variants[proof.chosen]['change']}" if proof.chosen is not None else
        "  no candidate fixed it over the horizon: the cause stays not established")
    return proof


def record(led: RunLedger, proof: HorizonProof) -> Path:
    """Append the proof to ``<ledger>/episodes.jsonl`` (a header first, as every ledger file has)."""
    path = led.folder / records.EPISODES_FILE
    w = records.RecordWriter(path, {"schema": records.EPISODES.id, "run_id": "diagnose", "seq": 0})
    w.write({"step": proof.onset, **proof.to_json()})
    w.close()
    return path


def prove_run(led: RunLedger, *, parallel: int = 1, log=print, max_steps: int | None = None) -> list[Episode]:
    """Every episode not yet proven over its horizon, proven; returns the episodes as they stand."""
    ra = RunAnswers(led)
    eps = ra.episodes()
    _, end = ra.health()
    done = ra.proofs()
    for ep in eps:
        if ep.kind in ("hardware", "data", "shift") or ep.onset in done:
            continue
        prove(led, ep, ra.context, end, parallel=parallel, log=log, max_steps=max_steps)
    return RunAnswers(RunLedger(led.dump_folder, led.folder.name)).episodes()


