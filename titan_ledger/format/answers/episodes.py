"""A run's answer: its incidents grouped into episodes, each with one root cause, dated by the
model's health, and one fix.

Design decision: a run is not a set of independent incidents. A model a high LR broke in its
first steps flags again and again for hundreds of steps, and each flag's own proof sees only
a broken model (a late grad-norm jump on an ordinary document reads as "bad data"); a change
of data flags every step for a while; an Adam plateau spikes in bursts. Practitioners reason
in episodes ("spikes that never fully recover: roll back, lower the LR"), and so does this:

* **the model's health** (:mod:`.health`) opens an episode where the model left its healthy
  regime -- at the step it did, whether or not a spike rule fired -- and every later incident
  until it recovers is a *symptom* of it, unless its own proof established another cause that
  does not need a healthy model to be believed (a bit flip stays hardware). A conviction of
  data on a broken model is not believed: the data was abnormal only on a state the run's
  configuration had already broken;
* outside a broken stretch, incidents ``GAP`` steps apart or less with no conflicting causes
  are one episode (a burst); a hardware fault and proven bad data are episodes of their own;
* a *shift* -- a loss that rose on every rank together, no rank or document singled out, the
  model healthy, no proof naming a cause -- is one episode however many steps it flags:
  "the data changed at step N: the loss rose with it; nothing to fix".

Each episode's cause and fix come, best first, from its fix proven over the episode's horizon
(``diagnose RUN --rerun``: :class:`HorizonProof`), else from the best-established answer among
its incidents, else the model's health names a candidate (not a proof: no command). The fix's
command relaunches the run from the last checkpoint at or before the onset (or from scratch).
Pure: the inputs are records; :mod:`.of_run` reads them from a ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from titan_ledger.format.answers.causes import derive, driver_words, words
from titan_ledger.format.answers.command import command_of
from titan_ledger.format.answers.health import Span
from titan_ledger.format.answers.records import ESTABLISHED, Answer, Context, Fix
from titan_ledger.format.answers.words import EVIDENCE_RULES, LOSS_CLIMBING, LOSS_SPIKE

#: incidents this many steps apart or less, outside a broken stretch, are one burst
GAP = 50
#: how an answer's cause was established, strongest first (an episode takes its best incident's)
_STRENGTH = ("in_step+window", "rerun", "window", "in_step", "rerun_evidence", "unseparated", "tree", "none")


@dataclass(frozen=True, slots=True)
class HorizonProof:
    """What ``diagnose RUN --rerun`` measured for an episode: every candidate fix relaunched as
    printed from the checkpoint before the onset (or from scratch) to the horizon's end, judged
    against the run itself (the unchanged control) by the run's own rules and its loss."""

    onset: int
    horizon: tuple[int, int]  # (first step trained, last step trained)
    start: int | None  # the checkpoint the relaunches loaded (None: from scratch)
    variants: tuple[dict[str, Any], ...]  # {variant, flags, change, flags_in_horizon, incidents_removed, ...}
    control: dict[str, Any]  # the run's own numbers over the same horizon
    chosen: int | None  # the index in ``variants`` of the fix (None: none fixed it)
    steps: int  # training steps spent (variants x horizon)

    def to_json(self) -> dict[str, Any]:
        return {"onset": self.onset, "horizon": list(self.horizon), "start": self.start,
                "variants": list(self.variants), "control": self.control, "chosen": self.chosen, "steps": self.steps}

    @classmethod
    def of(cls, d: dict[str, Any]) -> HorizonProof:
        return cls(int(d["onset"]), tuple(d["horizon"]), d.get("start"), tuple(d.get("variants") or ()),
                   d.get("control") or {}, d.get("chosen"), int(d.get("steps") or 0))


@dataclass(frozen=True, slots=True)
class Episode:
    """One episode of a run: its span, its one root cause, how that was established, the
    incidents it explains, and its one fix with the command that applies it."""

    onset: int
    last: int
    kind: str  # broken | burst | shift | hardware | data
    title: str
    cause: str  # "" when not established
    driver: str | None
    established: str  # an ESTABLISHED key, or "horizon" (its fix proven over the episode's horizon) or "health"
    how: str
    incidents: tuple[int, ...]
    health: Span | None = None
    fix: Fix | None = None
    candidates: tuple[Fix, ...] = ()
    start: str | None = None
    command: str | None = None
    new_dump: str | None = None
    proof: HorizonProof | None = None
    notes: tuple[str, ...] = ()
    relaunch: int = 0  # a fix's relaunch starts at the last checkpoint at or before this step

    @property
    def cause_text(self) -> str:
        if self.kind == "shift":
            return "a change of data (the loss rose with it; nothing to fix)"
        if not self.cause:
            return "cause not established"
        said = words(self.cause)
        return f"{driver_words(self.driver)} {said}" if self.driver and self.driver != self.cause else said

    def to_json(self) -> dict[str, Any]:
        return {"onset": self.onset, "last": self.last, "kind": self.kind, "title": self.title, "cause": self.cause,
                "cause_text": self.cause_text, "driver": self.driver, "established": self.established,
                "how": self.how, "incidents": list(self.incidents),
                "health": self.health.to_json() if self.health else None,
                "fix": self.fix.to_json() if self.fix else None, "candidates": [c.to_json() for c in self.candidates],
                "start": self.start, "command": self.command, "new_dump": self.new_dump,
                "proof": self.proof.to_json() if self.proof else None, "notes": list(self.notes),
                "relaunch": self.relaunch}

    @classmethod
    def of(cls, d: dict[str, Any]) -> Episode:
        return cls(onset=int(d["onset"]), last=int(d["last"]), kind=d["kind"], title=d.get("title", ""),
                   cause=d.get("cause") or "", driver=d.get("driver"), established=d.get("established", "none"),
                   how=d.get("how", ""), incidents=tuple(d.get("incidents") or ()),
                   health=Span.of(d["health"]) if d.get("health") else None,
                   fix=Fix.of(d["fix"]) if d.get("fix") else None,
                   candidates=tuple(Fix.of(c) for c in d.get("candidates") or ()), start=d.get("start"),
                   command=d.get("command"), new_dump=d.get("new_dump"),
                   proof=HorizonProof.of(d["proof"]) if d.get("proof") else None, notes=tuple(d.get("notes") or ()),
                   relaunch=int(d.get("relaunch") or 0))


ESTABLISHED_EPISODE = {**ESTABLISHED, "horizon": "proven by its fix over the episode's horizon",
                       "health": "not proven: the model's health dates it, its signs name a candidate"}


# --------------------------------------------------------------------------- grouping
@dataclass(slots=True)
class _Group:
    kind: str
    onset: int
    last: int
    answers: list[Answer] = field(default_factory=list)
    health: Span | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def relaunch(self) -> int:
        """The step a fix's relaunch must start at or before: the onset, or earlier where an
        incident's own fix was measured from earlier (a window proof's snapshot)."""
        return min([self.onset - 1, *(a.onset for a in self.answers if a.onset is not None)])


def _own_cause(a: Answer, broken: bool) -> bool:
    """Whether an incident is an episode of its own whatever surrounds it: a fault the step's
    own executions proved (hardware), or data convicted on a healthy model."""
    if a.cause == "hardware" and a.established in ("in_step", "rerun"):
        return True
    return a.cause == "bad_data" and not broken and a.established in ("in_step", "rerun")


#: a shift's loss: the median over the ``LEVEL`` steps from its onset this much above the median
#: over the ``LEVEL`` steps before it -- a change of level, not a spike the loss returns from
LEVEL, LEVEL_RISE = 50, 0.05


def shift_like(a: Answer, event: dict[str, Any] | None) -> bool:
    """An incident a change of data can explain: a flag no rule pinned on a rank or a document,
    whose answer established nothing (a proof that named a mechanism, data or hardware says
    otherwise)."""
    ev = event or {}
    rules = set(ev.get("rules") or ()) | set(ev.get("notes") or ())
    rose = a.kind == "spike" or a.title == LOSS_CLIMBING  # (a flag, or the stall rule's loss climbing back)
    return rose and not (rules & EVIDENCE_RULES) and not a.cause and a.established in (
        "none", "in_step", "unseparated", "tree")


#: a shift's incidents: at least this share shift-like (the first document of the new kind may
#: stand out against the old kind -- a document rule fires -- and the stall rule may see the loss
#: above its best: both are what new data does)
SHIFT_SHARE = 0.8


def is_shift(g: _Group, events: dict[int, dict[str, Any]], level: Callable[[int], float | None] | None,
             proof: HorizonProof | None = None) -> bool:
    """A burst that is a change of data: no incident with a cause established, most of them
    shift-like, the first a loss that rose, and either the loss's level changed at the onset
    (``level``: the median after over the median before) or its horizon proof found nothing in
    the configuration that removes it (``proof``: every fix tried, none worked -- the loss of
    new data the model learns fast falls back below its old level: docstrings, then Russian,
    at DP 2 -- 11.5 at the shift, 3-5 fifty steps on)."""
    if not g.answers or g.answers[0].title not in (LOSS_SPIKE, LOSS_CLIMBING):
        return False
    if any(a.cause for a in g.answers):
        return False
    if sum(shift_like(a, events.get(a.step)) for a in g.answers) < SHIFT_SHARE * len(g.answers):
        return False
    if proof is not None and proof.variants and proof.chosen is None:
        return True
    ratio = level(g.onset) if level is not None else None
    return ratio is not None and ratio >= 1 + LEVEL_RISE


def group(answers: list[Answer], spans: list[Span], events: dict[int, dict[str, Any]], end: int,
          level: Callable[[int], float | None] | None = None,
          proofs: dict[int, HorizonProof] | None = None) -> list[_Group]:
    """The incidents (``answers``, any order) and the broken stretches as episode groups, in
    step order (pure); ``level(step)``: the loss's median after the step over its median before."""
    out: list[_Group] = []
    broken = [_Group("broken", s.onset, s.last if s.last is not None else end, health=s) for s in spans]
    open_: _Group | None = None
    for a in sorted(answers, key=lambda x: x.step):
        home = next((g for g in broken if g.onset <= a.step <= g.last), None)
        if _own_cause(a, home is not None):
            out.append(_Group("hardware" if a.cause == "hardware" else "data", a.step, a.step, [a]))
            continue
        if home is not None:
            if a.cause == "bad_data":
                home.notes.append(f"step {a.step}: data convicted on a broken model (not believed: the model had "
                                  f"left its healthy regime at step {home.onset})")
            home.answers.append(a)
            continue
        if open_ is not None and a.step - open_.last <= GAP and compatible({x.cause for x in open_.answers} - {""}, a):
            open_.answers.append(a)
            open_.last = a.step
            continue
        open_ = _Group("burst", a.step, a.step, [a])
        out.append(open_)
    for g in out:
        if g.kind == "burst" and is_shift(g, events, level, (proofs or {}).get(g.onset)):
            g.kind = "shift"
    for g in broken:
        g.last = max([g.last if g.health.last is not None else end] + [a.step for a in g.answers])
        out.append(g)
    return sorted(out, key=lambda g: (g.onset, g.last))


def compatible(causes: set[str], a: Answer) -> bool:
    """Whether ``a`` may join a burst whose incidents established ``causes``: one of them, or none."""
    return not a.cause or not causes or a.cause in causes


# --------------------------------------------------------------------------- one episode's answer
def _best(answers: list[Answer]) -> Answer | None:  # (a burst's: its best-established incident)
    """The incident whose answer is best established (a measured fix first), the earliest of equals."""
    known = [a for a in answers if a.cause and a.cause not in ("hardware", "bad_data")]
    if not known:
        return None
    return min(known, key=lambda a: (_STRENGTH.index(a.established) if a.established in _STRENGTH else 99,
                                     a.fix is None, a.step))


def health_candidate(span: Span) -> str:
    """The cause a broken stretch's signs point at (a candidate, never proof): the LR where the
    update was too large or the logits blew up early, else divergence."""
    names = span.names
    if "update" in names or "logits" in names:
        return "lr"
    return "divergence"


def _title(g: _Group) -> str:
    steps = [a.step for a in g.answers]
    if g.kind == "broken":
        return f"the model left its healthy regime at step {g.onset}" + (
            f" ({len(steps)} incident(s) after it)" if steps else " (no spike rule fired)")
    if g.kind == "shift":
        return f"the data changed at step {g.onset}"
    if len(steps) == 1:
        return g.answers[0].title
    return f"{len(steps)} incidents at steps {steps[0]}-{steps[-1]}"


def _measured(answers: list[Answer]) -> list[Fix]:
    """The fixes the episode's incidents measured (a window's, a proof's), best-established first."""
    ranked = sorted((a for a in answers if a.fix is not None and a.fix.flags),
                    key=lambda a: (_STRENGTH.index(a.established) if a.established in _STRENGTH else 99, a.step))
    out: list[Fix] = []
    for a in ranked:
        if not any(f.flags == a.fix.flags for f in out):
            out.append(a.fix)
    return out


def _broken(ep: Episode, g: _Group, ctx: Context) -> Episode:
    """A broken stretch: its root cause is what broke the model, not what its symptoms' windows
    measured on the broken model. The LR where the signs name it: its cut is the fix where an
    incident measured it; else the health's candidate and every fix the incidents measured are
    candidates for the horizon proof."""
    cand = health_candidate(g.health)
    measured = _measured(g.answers)
    cut = next((f for f in measured if f.cause == "lr" and f.effect in ("removed", "lowered")), None)
    how = g.health.words()
    if cand == "lr" and cut is not None:
        at = next(a for a in g.answers if a.fix is not None and a.fix.flags == cut.flags)
        return replace(ep, cause="lr", established=at.established, how=f"{how}; step {at.step}: {at.how}", fix=cut)
    ch = derive(cand, ctx.knobs) if cand == "lr" else None
    own = [Fix(cand, cand, ch.flags, ch.words, "not measured", "the model's health names it (a candidate)",
               resumes=ch.resumes)] if ch else []
    others = [f for f in measured if not any(o.flags == f.flags for o in own)]
    return replace(ep, cause=cand if cand == "lr" else "", established="health", how=how,
                   candidates=tuple(own + others))


def build_episode(g: _Group, ctx: Context, proof: HorizonProof | None = None, exists=None) -> Episode:
    """One group's answer: its cause, how, fix and command (the module docstring's order)."""
    incidents = tuple(a.step for a in g.answers)
    ep = Episode(onset=g.onset, last=g.last, kind=g.kind, title=_title(g), cause="", driver=None,
                 established="none", how="", incidents=incidents, health=g.health, proof=proof,
                 notes=tuple(g.notes), relaunch=max(0, g.relaunch))
    if g.kind in ("hardware", "data"):
        a = g.answers[0]
        return replace(ep, cause=a.cause, established=a.established, how=a.how, fix=a.fix, start=a.start,
                       command=a.command, new_dump=a.new_dump)
    if g.kind == "shift":
        tried = (f"; no fix tried over its horizon removed it ({'; '.join(v.get('change', '') for v in proof.variants)}"
                 f"): not the configuration" if proof is not None and proof.variants else "")
        return replace(ep, how=(f"the loss rose on every rank together from step {g.onset} ({len(incidents)} "
                                f"flag(s) to step {g.last}), no rank or document singled out, the model healthy"
                                f"{tried}: the data changed"))
    if g.kind == "broken":
        ep = _broken(ep, g, ctx)
    elif (best := _best(g.answers)) is not None:
        ep = replace(ep, cause=best.cause, driver=best.driver, established=best.established,
                     how=f"step {best.step}: {best.how}", fix=best.fix,
                     candidates=tuple(f for f in _measured(g.answers) if best.fix is None or f.flags != best.fix.flags))
    else:
        ep = replace(ep, candidates=tuple(_measured(g.answers)))
    if proof is not None and proof.chosen is not None:
        v = proof.variants[proof.chosen]
        fix = Fix(v["variant"], v.get("cause") or ep.cause or "", tuple(v["flags"]), v["change"], v["effect"],
                  v.get("detail", ""), resumes=v.get("resumes", True))
        # the cause its incidents established stands where its own fix also worked over the horizon
        # (the better fix, the LR's cut, then names the driver: "LR-driven Adam's state"); else the
        # horizon's fix names it
        own = ep.cause and any(x.get("cause") == ep.cause and x.get("effect") in ("removed", "lowered")
                               for x in proof.variants)
        cause, driver = (ep.cause, "lr" if fix.cause == "lr" and ep.cause != "lr" else ep.driver) if own else \
            (fix.cause or ep.cause, None)
        ep = replace(ep, cause=cause, driver=driver, established="horizon",
                     fix=fix, candidates=(), how="; ".join(x for x in (ep.how, v.get("detail", "")) if x))
    if ep.fix is not None and ep.established in ("health", "none", "tree", "unseparated"):
        ep = replace(ep, candidates=(ep.fix, *ep.candidates), fix=None)  # unproven: no command
    start, command, new_dump = command_of(g.onset, ep.fix, ep.relaunch, ctx, exists) if ep.fix else (None, None, None)
    return replace(ep, start=start, command=command, new_dump=new_dump)


def episodes(answers: list[Answer], spans: list[Span], events: dict[int, dict[str, Any]], end: int, ctx: Context,
             proofs: dict[int, HorizonProof] | None = None, exists=None,
             level: Callable[[int], float | None] | None = None) -> list[Episode]:
    """THE episodes of a run (pure): ``answers`` every incident's answer, ``spans`` the model's
    broken stretches (:func:`.health.read`), ``events`` the flags' events by step, ``end``
    the run's last step, ``proofs`` the horizon proofs recorded, by onset, ``level`` the
    loss's change of level at a step (:func:`is_shift`)."""
    proofs = proofs or {}
    return [build_episode(g, ctx, proofs.get(g.onset), exists)
            for g in group(answers, spans, events, end, level, proofs)]


@dataclass(slots=True)
class Live:
    """The episode open now, as a live run sees it (the trainer's console): the same rules as
    :func:`group`, on one incident at a time -- a symptom of a broken model, a later flag of
    the same burst or shift -- so that the console raises one alarm per episode."""

    kind: str | None = None
    onset: int = 0
    last: int = 0
    causes: set[str] = field(default_factory=set)

    def open_at(self, step: int, broken_since: int | None) -> int | None:
        """The onset of the episode ``step`` falls in (a broken model's, or a burst within
        ``GAP``), None: it would open one."""
        if broken_since is not None and step >= broken_since:
            return broken_since
        return self.onset if self.kind == "burst" and step - self.last <= GAP else None

    def see(self, a: Answer, broken_since: int | None) -> tuple[bool, int]:
        """(whether ``a`` opens an episode, the onset of the episode it is in)."""
        broken = broken_since is not None and a.step >= broken_since
        if _own_cause(a, broken):
            return True, a.step
        if broken:  # the health's own warning opened it (components/ledger: _on_broken)
            self.kind, self.onset, self.last = "broken", broken_since, a.step
            return False, broken_since
        if self.kind == "burst" and a.step - self.last <= GAP and compatible(self.causes, a):
            self.last = a.step  # (a shift is a burst too: whether the level changed is known only later)
            self.causes |= {a.cause} - {""}
            return False, self.onset
        self.kind, self.onset, self.last, self.causes = "burst", a.step, a.step, {a.cause} - {""}
        return True, a.step


def episode_of(eps: list[Episode], step: int) -> Episode | None:
    """The episode an incident at ``step`` belongs to."""
    return next((e for e in eps if step in e.incidents), None) or next(
        (e for e in eps if e.onset <= step <= e.last), None)
