"""The recovery ladder: which response a flagged step gets, escalating when spikes come
back within a horizon (none -> skip_update -> rollback -> rollback_lr -> stop), and the
one-screen report a ``stop`` rung prints; and the note budget: which notes
``[ledger.proof] scope = "all"`` proves.

Design decision: pure bookkeeping beside the actions it chooses (``recovery`` carries
them out); the ladder's state survives an in-process rollback and is checkpointed with
the ledger's counters, as is the note budget (a resumed run proves the notes the
uninterrupted one did).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from titan_ledger.errors import python_command
from titan_ledger.format import records

if TYPE_CHECKING:  # (annotations only: the flags' parser imports this module, before torch)
    from titan_ledger.components.response.host import RunFacts


class Action(StrEnum):
    """A rung's action (``--ledger.response.action``); the TOML's string equals its member."""

    NONE = "none"
    SKIP_UPDATE = "skip_update"
    ROLLBACK = "rollback"
    ROLLBACK_LR = "rollback_lr"
    STOP = "stop"


ACTIONS = tuple(Action)


@dataclass(frozen=True)
class Rung:
    """One response: ``action`` (``rollback_lr`` carries the LR factor), tried
    ``attempts`` times (0: without limit) before the ladder escalates."""

    action: str
    attempts: int = 1
    lr: float | None = None

    @property
    def rolls_back(self) -> bool:
        return self.action in (Action.ROLLBACK, Action.ROLLBACK_LR)

    @property
    def name(self) -> str:
        s = self.action + (f":{self.lr:g}" if self.lr is not None else "")
        return s + (f"*{self.attempts}" if self.attempts > 1 else "")  # 0: a lone action, no limit


def parse_ladder(spec: str) -> list[Rung]:
    """``--ledger.response.action`` -> rungs. One action repeats without limit (rollbacks
    are capped by ``--ledger.rollback.limit``); a comma-separated list escalates:
    ``skip_update*2,rollback,rollback_lr:0.5,stop`` (``*N``: attempts of that rung,
    default 1; ``rollback_lr:X``: roll back and scale the LR by X from then on)."""
    from titan_ledger.errors import ConfigError

    entries = [e.strip() for e in str(spec).split(",") if e.strip()]
    if not entries:
        raise ConfigError("--ledger.response.action: give an action (none, skip_update, rollback, "
                          "rollback_lr:X, stop) or a comma-separated ladder of them")
    rungs = []
    for e in entries:
        body, _, times = e.partition("*")
        action, _, arg = body.partition(":")
        try:
            attempts = int(times) if times else (0 if len(entries) == 1 else 1)
            lr = float(arg) if arg else None
        except ValueError:
            attempts, lr = -1, None
        bad = (action not in ACTIONS or attempts < 0 or (action == Action.ROLLBACK_LR) != (lr is not None)
               or (lr is not None and not 0 < lr < 1) or (action in (Action.NONE, Action.STOP) and times))
        if bad:
            raise ConfigError(f"--ledger.response.action {spec!r}: {e!r} is not an action; use none, skip_update, "
                              f"rollback, rollback_lr:X (0 < X < 1) or stop, each optionally *N attempts, "
                              f"e.g. skip_update*2,rollback,rollback_lr:0.5,stop")
        rungs.append(Rung(action, attempts, lr))
    if any(r.action == Action.STOP for r in rungs[:-1]):
        raise ConfigError(f"--ledger.response.action {spec!r}: stop can only be the last rung")
    return rungs


class Ladder:
    """Which response a flagged step gets: a spike within ``horizon`` steps of the
    previous one is a repeat and uses the next attempt, then the next rung; a spike
    after a quiet ``horizon`` starts again at the first rung. Past the last rung the
    run stops. Pure bookkeeping (the trainer acts); its state survives an in-process
    rollback and is checkpointed."""

    def __init__(self, rungs: list[Rung], horizon: int):
        self.rungs = rungs
        self.horizon = horizon
        self.rung = 0
        self.used = 0
        self.last_step: int | None = None
        self.history: list[dict] = []

    @property
    def acts(self) -> bool:
        return any(r.action != Action.NONE for r in self.rungs)

    @property
    def rolls_back(self) -> bool:
        return any(r.rolls_back for r in self.rungs)

    def on_spike(self, step: int) -> tuple[Rung | None, dict]:
        """The response to a flagged ``step`` (None: the ladder is exhausted)."""
        repeat = self.last_step is not None and step - self.last_step <= self.horizon
        if not repeat:
            self.rung, self.used = 0, 0
        self.last_step = step
        while self.rung < len(self.rungs):
            r = self.rungs[self.rung]
            if r.attempts == 0 or self.used < r.attempts:
                self.used += 1
                rec = {"step": step, "rung": self.rung, "action": r.name, "attempt": self.used,
                       "repeat_within_horizon": repeat}
                self.history.append(rec)
                return r, rec
            self.rung, self.used = self.rung + 1, 0
        rec = {"step": step, "rung": len(self.rungs), "action": "exhausted", "repeat_within_horizon": repeat}
        self.history.append(rec)
        return None, rec

    def would_act(self, step: int) -> bool:
        """Whether a flag at ``step`` would get an action that withholds the update
        (anything but a ``none`` rung), asked without recording it: a deferred step's
        update is held on the device only when its flag would act."""
        saved = (self.rung, self.used, self.last_step, len(self.history))
        rung, _ = self.on_spike(step)
        self.rung, self.used, self.last_step = saved[:3]
        del self.history[saved[3]:]
        return rung is None or rung.action != Action.NONE

    def state_dict(self) -> dict:
        return {"rung": self.rung, "used": self.used, "last_step": self.last_step, "history": self.history}

    def load_state_dict(self, s: dict) -> None:
        if s:
            self.rung, self.used = int(s.get("rung", 0)), int(s.get("used", 0))
            self.last_step, self.history = s.get("last_step"), list(s.get("history", []))


class NoteBudget:
    """A token bucket of note proofs (``--ledger.proof.notes_rate`` /
    ``[ledger.proof] notes_burst``): full at the start, refilled by ``rate`` a step, one token a
    proven note. Counted in integer millionths, so the decision at a step does not
    depend on which earlier steps asked (the deferred and the in-step decisions ask at
    different steps and must agree bit for bit): ``min`` of a refill is the same in one
    call or in several."""

    UNIT = 1_000_000

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.cap = round(rate * self.UNIT), int(burst) * self.UNIT
        self.tokens, self.at = self.cap, 0

    def _refill(self, step: int) -> None:
        if step > self.at:
            self.tokens = min(self.cap, self.tokens + self.rate * (step - self.at))
            self.at = step

    def allows(self, step: int) -> bool:
        """Whether a note at ``step`` is proven (nothing spent until :meth:`spend`)."""
        self._refill(step)
        return self.tokens >= self.UNIT

    def spend(self, step: int) -> None:
        self._refill(step)
        self.tokens -= self.UNIT

    def state_dict(self) -> dict:
        return {"tokens": self.tokens, "at": self.at}

    def load_state_dict(self, s: dict) -> None:
        if s:
            self.tokens, self.at = min(int(s["tokens"]), self.cap), int(s["at"])


def ladder_report(folder: Path, ladder: Ladder, facts: RunFacts, spec: str, action: dict) -> str:
    """One screen: what happened, what was tried, where the evidence is, what to run
    (``folder``: the ledger's; ``spec``: ``--ledger.response.action``)."""
    dump = facts.dump_folder
    step = action["step"]
    py = python_command()  # the interpreter that trained: the commands run as printed
    tried = "; ".join(f"step {h['step']}: {h['action']}" + (f" ({h['attempt']})" if "attempt" in h else "")
                      for h in ladder.history) or "nothing"
    return "\n".join([
        f"the recovery ladder stopped training at step {step} "
        f"(--ledger.response.action {spec}, horizon {ladder.horizon} steps)",
        f"  what happened: spikes kept coming back within the horizon; last at step {step}",
        f"  what was tried: {tried}",
        f"  evidence: {folder / records.SPIKES_FILE} (every flag and decision), {folder / records.SIGNALS_FILE}, "
        f"{folder}/{records.DATA_GLOB} (documents and their losses), checkpoints in {dump}/{facts.checkpoint_folder}",
        f"  next: {py} -m titan_ledger.diagnose {dump} --step {step}",
        f"        {py} -m titan_ledger.report {dump} --step {step} -o incident.html",
        f"        {py} -m titan_ledger.replay rerun --dump-folder {dump} --step {step}  (reuses this run's launch)",
    ])
