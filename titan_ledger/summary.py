"""The end-of-run summary: what a finished run left on disk and how to look at it.

Rank 0 prints it when ``titan_ledger.train`` ends a run that trained (a summary that
fails is a warning, never a failed run): the ledger's folder, then one section a line
or a few -- the run's episodes first (its answer), then signals, spikes, what the response
did, the data ledger, checkpoints -- and the commands that look at the run ("look at it").

Design decision: the summary is a list of sections (:data:`SECTIONS`), each a function
of the run's files read once (:class:`RunFiles`), each returning its own lines in
order. A new section is one function and one entry in the list (at its head to lead
the summary); no section reads a file another already read, and none writes.

What is read is bounded for a run of any size: the signals file whole (one file,
~600 B a step) and spikes.jsonl (the event log); the data ledger by its offset index
only (a 512-rank run's data ledger is ~20 GB: rank 0 must not parse it to say
goodbye); checkpoints by listing the folder.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from titan_ledger.errors import LedgerError, python_command
from titan_ledger.format.records import (
    DATA_GLOB,
    LEDGER_FOLDER,
    SIGNALS_FILE,
    SPIKES_FILE,
    LedgerFile,
    data_file,
    read_ledger,
)


@dataclass
class RunFiles:
    """What the sections read of a run, read once (:meth:`read`)."""

    dump: Path  # the dump folder
    folder: Path  # the ledger folder
    ledger_folder: str | os.PathLike  # as given: a command names it when it is not the default
    checkpoint_folder: str
    signals: LedgerFile | None = None  # signals.jsonl; None: no such file
    events: list[dict] = field(default_factory=list)  # spikes.jsonl's rows (the event log)
    steps: list[int] = field(default_factory=list)  # the signals' steps
    spike_steps: list[int] = field(default_factory=list)  # flagged steps

    @classmethod
    def read(cls, dump_folder: str | os.PathLike, ledger_folder: str | os.PathLike,
             checkpoint_folder: str) -> RunFiles:
        dump = Path(dump_folder)
        run = cls(dump, dump / ledger_folder, ledger_folder, checkpoint_folder)
        signals = run.folder / SIGNALS_FILE
        if signals.is_file():
            run.signals = read_ledger(signals)
            rows = run.signals.history
            run.steps = [r["step"] for r in rows]
            run.spike_steps = [r["step"] for r in rows if r.get("spike")]
        spikes = run.folder / SPIKES_FILE
        if spikes.is_file():
            run.events = read_ledger(spikes).history
            # the event log keeps spikes that a rollback rewound: it, not the signals, says which
            run.spike_steps = sorted({r["step"] for r in run.events if "rules" in r})
        return run


def run_summary(dump_folder: str | os.PathLike, ledger_folder: str | os.PathLike = LEDGER_FOLDER, *,
                checkpoint_folder: str = "checkpoint") -> str:
    """What the run left on disk and how to look at it (printed by rank 0 at the end):
    the ledger's folder, then every section of :data:`SECTIONS` in order.
    ``ledger_folder`` is relative to ``dump_folder`` (or absolute)."""
    run = RunFiles.read(dump_folder, ledger_folder, checkpoint_folder)
    lines = [f"titan_ledger: the ledger is in {run.folder}"]
    for section in SECTIONS:
        lines += section(run)
    return "\n".join(lines)


# --------------------------------------------------------------------------- the sections
def episodes_lines(run: RunFiles) -> list[str]:
    """The run's answer first: its episodes (``format.answers.episodes``), each its cause, how
    it was established, its fix and the command; what an unproven one needs next."""
    from titan_ledger.format.answers import render
    from titan_ledger.format.answers.of_run import RunAnswers
    from titan_ledger.format.reader import RunLedger

    if run.signals is None:
        return []
    try:
        eps = RunAnswers(RunLedger(run.dump, run.ledger_folder, run.checkpoint_folder)).episodes()
    except Exception as e:  # (the summary says so; a summary never fails the run's end)
        return [f"  episodes     could not be read: {type(e).__name__}: {e}"]
    lines = render.episodes_block(eps, detail=False)
    out = [f"  {lines[0]}"] + [f"    {x}" for x in lines[1:]]
    if any(e.candidates and e.fix is None and e.proof is None for e in eps):
        out.append(f"    prove the candidates over each episode's horizon: {python_command()} -m titan_ledger.diagnose "
                   f"{run.dump} --rerun")
    return out


def signals_lines(run: RunFiles) -> list[str]:
    """The signals ledger: its rows, their steps, rows of earlier runs it superseded."""
    if run.signals is None:
        return ["  signals      none (ledger.signals is off)"]
    sig, rows = run.signals, run.signals.history
    span = f", steps {min(run.steps)}-{max(r.get('last_step', r['step']) for r in rows)}" if rows else ""
    extra = f"; {len(sig.superseded)} superseded rows of earlier runs" if sig.superseded else ""
    return [f"  signals      {len(rows)} rows{span} ({SIGNALS_FILE}){extra}"]


def spikes_lines(run: RunFiles) -> list[str]:
    """The flagged steps (the first ten)."""
    if not run.spike_steps:
        return ["  spikes       none flagged"]
    shown = ", ".join(map(str, run.spike_steps[:10])) + (" ..." if len(run.spike_steps) > 10 else "")
    return [f"  spikes       {len(run.spike_steps)} flagged: steps {shown}"]


def response_lines(run: RunFiles) -> list[str]:
    """What the response did: notes, proofs by verdict and what they changed or would
    have changed, stalls, and the response's own events (breaker, steps consumed
    untrained, failures). Reads spikes.jsonl's events only."""
    events = run.events
    notes = sum(1 for e in events if "notes" in e and "rules" not in e)
    proofs = [e["proof"] for e in events if e.get("proof")]
    out = []
    if notes:
        out.append(f"  notes        {notes} recorded, never acted on")
    if proofs:
        by = Counter(p["verdict"] for p in proofs)
        verdicts = ", ".join(f"{n} {v}" for v, n in by.most_common())
        acted = sum(1 for p in proofs if p.get("applied") not in (None, "original"))
        held = Counter(p["held_back"] for p in proofs if p.get("held_back"))
        done = [f"{acted} acted on"] if acted else []
        done += [f"{n} held back ({'would have acted: --ledger.response.policy observe' if k == 'observe' else k})"
                 for k, n in held.items()]
        out.append(f"  proofs       {len(proofs)}: {verdicts}" + (f"; {'; '.join(done)}" if done else "; nothing changed"))
    stalls = [e for e in events if e.get("stall")]
    if stalls:
        out.append(f"  stalls       {len(stalls)}: " + ", ".join(f"step {e['step']} ({e['stall']['kind']})"
                                                            for e in stalls[:5]))
    failed = sum(1 for e in events if "proof_failed" in e or "response_failure" in e)
    untrained = sum(1 for e in events if e.get("no_tokens"))
    paused = sum(1 for e in events if e.get("breaker") == "paused")
    extra = [f"{failed} failure(s) inside the response, training went on" if failed else "",
             f"{untrained} step(s) consumed untrained (every label masked)" if untrained else "",
             f"acting paused {paused} time(s) by the circuit breaker" if paused else ""]
    if any(extra):
        out.append("  response     " + "; ".join(x for x in extra if x))
    return out


def data_ledger_lines(run: RunFiles) -> list[str]:
    """The data ledger's extent per DP rank, through its offset index: O(log n) a file."""
    from titan_ledger.format.reader import DataLedger

    try:
        dled = DataLedger(run.folder)
        ends = {r: dled.last_step_of(r) for r in dled.ranks()}
    except LedgerError:
        ends = {}
    if not ends:
        return ["  data ledger  none (dataloader.tagging is off, or not LedgerDataLoader)"]
    files = data_file(0) if len(ends) == 1 else DATA_GLOB.replace("*", "<r>")
    if len(set(ends.values())) == 1:
        last = next(iter(ends.values()))
        each = "" if len(ends) == 1 else f" on each of {len(ends)} DP ranks"
        return [f"  data ledger  steps 1-{last}{each} ({files})"]
    per = ", ".join(f"dp{r}: {n}" for r, n in ends.items())
    return [f"  data ledger  last step per DP rank: {per}"]


def checkpoint_lines(run: RunFiles) -> list[str]:
    """Complete DCP checkpoints only (``step-N/.metadata`` is written last): the last five."""
    where = run.dump / run.checkpoint_folder
    ckpts = sorted(int(p.name[5:]) for p in where.glob("step-*")
                   if p.name[5:].isdigit() and (p / ".metadata").exists())
    if not ckpts:
        return ["  checkpoints  none"]
    shown = ", ".join(f"step-{s}" for s in ckpts[-5:])
    more = f"{len(ckpts)} checkpoints, last " if len(ckpts) > 5 else ""
    return [f"  checkpoints  {more}{shown} in {where}"]


def look_lines(run: RunFiles) -> list[str]:
    """The commands that look at the run, with the interpreter that trained (they run as
    printed): plot, diagnose, lookup (the first spike, else the last step), report (a
    spike's incident), export."""
    dump = run.dump
    opt = f" --ledger-folder {run.ledger_folder}" if str(run.ledger_folder) != LEDGER_FOLDER else ""
    look = run.spike_steps[0] if run.spike_steps else (max(run.steps) if run.steps else 1)
    py = python_command()
    lines = [
        "  look at it:",
        f"    {py} -m titan_ledger.plot {dump} -o {dump / 'signals.png'}{opt}",
        f"    {py} -m titan_ledger.diagnose {dump}{opt}",
        f"    {py} -m titan_ledger.lookup {dump} --step {look}{opt}",
    ]
    lines.append(f"    {py} -m titan_ledger.report {dump} -o {dump / 'run.html'}{opt}")
    if run.spike_steps:
        first = run.spike_steps[0]
        lines.append(f"    {py} -m titan_ledger.report {dump} --step {first} -o "
                     f"{dump / f'incident-step{first}.html'}{opt}")
    lines.append(f"    {py} -m titan_ledger.export {dump} -o {dump / 'export'}{opt}")
    return lines


#: the summary's sections, in the order they print
SECTIONS: list[Callable[[RunFiles], list[str]]] = [
    episodes_lines, signals_lines, spikes_lines, response_lines, data_ledger_lines, checkpoint_lines, look_lines,
]
