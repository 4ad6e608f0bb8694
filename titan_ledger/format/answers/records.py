"""The answer's record types and their JSON: :class:`Fix`, :class:`Answer`, the run's
:class:`Context`, and the vocabulary they are written in.

Design decision: a record is data and its JSON, nothing else (OLMo-core keeps a result's
type apart from its rendering): :mod:`.build` makes an :class:`Answer`, :mod:`.render` says
it, and a reader parses it back with :meth:`Answer.of`. The one derived field on disk is
``cause_text`` (a reader of the JSON alone wants the words).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from titan_ledger.format.answers.causes import Knobs, driver_words, words

#: how the answer was established, in words
ESTABLISHED = {
    "in_step": "proven in step", "window": "proven by its fix in the window",
    "in_step+window": "proven in step and by its own fix in the window", "rerun": "proven by a rerun",
    "unseparated": "every mechanism's fix tried in the window removed it: the proof does not separate them",
    "rerun_evidence": "evidence from a rerun, not proof",
    "tree": "not proven: the decision tree's reading", "none": "not established",
}
#: the share of the flagged signal's excess over its pre-onset median a fix may leave and
#: still "remove" the spike (the window judge: one stated relative rule beside the run's rules)
REMOVED_SHARE = 0.5
#: the window judge's effects, best first
EFFECTS = ("removed", "lowered", "moved", "not removed", "not measured")


@dataclass(frozen=True, slots=True)
class Fix:
    """One fix tried by the window proof (or a candidate, ``effect`` ``not measured``)."""

    variant: str  # the window's variant (lr, adam, eps, logit_cap, zloss) or a candidate's
    cause: str  # the mechanism its fix proves
    flags: tuple[str, ...]  # the training flags (empty: no change to this run can make it)
    change: str  # the change in words, ``--optimizer.eps 1e-6 (now 1e-8)``
    effect: str  # :data:`EFFECTS`
    detail: str = ""  # the measured numbers, rounded
    share: float | None = None  # the flagged signal's excess left (0: all gone; 1: unchanged)
    cost: float | None = None  # the loss over the window's last steps against the unchanged re-run
    resumes: bool = True

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def of(cls, d: dict[str, Any]) -> Fix:
        return cls(**{f.name: (tuple(d.get(f.name) or ()) if f.name == "flags" else d.get(f.name))
                      for f in fields(cls) if f.name in d})


@dataclass(frozen=True, slots=True)
class Answer:
    """The answer to one incident (an acting flag, a note its proof promoted, a stall)."""

    step: int
    kind: str  # spike | stall
    title: str  # "loss spike", "grad-norm jump (the loss fell)", "stall", ...
    cause: str  # one name ("" when not established or not separated)
    driver: str | None  # the LR where its cut removed it beside the mechanism's own fix
    established: str  # an :data:`ESTABLISHED` key
    how: str  # how, with its numbers
    not_proven: str | None  # why no proof (or no window proof) established it
    separates: bool | None  # the window's fixes separate the causes (None: no window judged it)
    fixes: tuple[Fix, ...]  # every fix tried, best effect first
    fix: Fix | None  # the recommended fix: measured, or (``not measured``) the fix of a cause proven in step
    candidates: tuple[Fix, ...]  # untested, no command: the tree's readings, a fix another incident measured
    start: str | None  # where the command starts: "checkpoint step-K" | "scratch"
    command: str | None  # the relaunch with the fix, as printed
    new_dump: str | None  # the command's dump folder (new; never the run's own)
    did: str  # what the run did
    acting: str | None  # what acting would have done (observe), or None
    documents: tuple[str, ...] = ()  # convicted documents (bad data)
    quarantine: bool = False  # a quarantine is offered (bad data convicted, not quarantined)
    window_from: int | None = None  # the window proof's snapshot step
    onset: int | None = None  # the step the fix's relaunch must start at or before
    loss: float | None = None
    grad_norm: float | None = None
    version: int = 1

    @property
    def cause_text(self) -> str:
        """The cause in words (the first line's): ``LR-driven attention-logit growth``."""
        if not self.cause:
            return ESTABLISHED["unseparated"] if self.established == "unseparated" else "cause not established"
        said = words(self.cause)
        if self.driver and self.driver != self.cause:
            return f"{driver_words(self.driver)} {said}"
        return said

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Fix):
                v = v.to_json()
            elif isinstance(v, tuple):
                v = [x.to_json() if isinstance(x, Fix) else x for x in v]
            out[f.name] = v
        out["cause_text"] = self.cause_text  # (derived; readers of the JSON alone want the words)
        return out

    @classmethod
    def of(cls, d: dict[str, Any]) -> Answer:
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name in ("fixes", "candidates"):
                v = tuple(Fix.of(x) for x in v or ())
            elif f.name == "fix":
                v = Fix.of(v) if v else None
            elif f.name == "documents":
                v = tuple(v or ())
            kw[f.name] = v
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class Context:
    """What the answer needs of the run beyond the step: its settings, its launch (the
    segment header's ``argv``, ``cwd``, ``python`` and world size), its dump folder and the
    complete checkpoints on disk, and the policy (``--ledger.response.policy``)."""

    knobs: Knobs = field(default_factory=Knobs)
    dump: str = ""
    argv: tuple[str, ...] | None = None
    cwd: str = ""
    python: str = "python"
    world_size: int = 1
    checkpoints: tuple[int, ...] = ()
    checkpoint_folder: str = "checkpoint"
    policy: str | None = None
    loss_jump: float = 0.05  # the rules' material loss move (a dip is under the median by more)
