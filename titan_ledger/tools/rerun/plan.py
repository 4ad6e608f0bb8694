"""Planning a rerun (pure, but for :func:`checkpoints_of`): the checkpoint to load and
the window to train (:func:`make_plan`), the original's training flags minus what the
rerun sets itself (:func:`strip_train_args`), and a :data:`~.variants.PLAN_FOR` /
:data:`~.variants.ESCALATION` entry made concrete for one spike (:func:`resolve_variant`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_ledger.format import records
from titan_ledger.tools.rerun.report import _ranges
from titan_ledger.tools.rerun.variants import RerunError, Variant, ledger_values, parse_variant


@dataclass
class Plan:
    dump: Path
    step: int
    load_step: int
    stop: int
    variants: list[Variant]
    checkpoint_folder: str = "checkpoint"
    ledger_folder: str = "ledger"
    #: the original's trained steps in the window (a skip's control is chosen among them)
    trained: tuple[int, ...] = ()

    @property
    def steps_per_variant(self) -> int:
        return self.stop - self.load_step

    def folder(self, v: Variant) -> Path:
        return self.dump / records.RERUN_FOLDER / v.slug(self.step)

    def budget_line(self, n_launch: int | None = None) -> str:
        n = len(self.variants) if n_launch is None else n_launch
        return (f"rerun budget: {n} variant(s) x {self.steps_per_variant} steps = "
                f"{n * self.steps_per_variant} training steps (checkpoint step-{self.load_step} -> "
                f"step {self.stop}; spike at step {self.step})")


def make_plan(dump, step: int, variants: list[Variant], *, load_step: int | None = None, after: int = 1,
              checkpoints: list[int], trained: list[int], last_step: int,
              checkpoint_folder: str = "checkpoint", ledger_folder: str = "ledger") -> Plan:
    """Pure: pick the checkpoint and the window. ``checkpoints``: complete checkpoint
    steps of the original; ``trained``: its trained steps; ``last_step``: its last
    recorded step."""
    if after < 0:
        raise RerunError(f"--after {after}: give 0 or more steps after the spike")
    if step not in set(trained):
        raise RerunError(f"--step {step}: not a trained step of the run (it trained steps "
                         f"{_ranges(trained)})")
    if load_step is None:
        usable = [c for c in checkpoints if c <= step - 1]
        if not usable:
            raise RerunError(f"--step {step}: no complete checkpoint at or before step {step - 1} "
                             f"(checkpoints: {checkpoints or 'none'}); the original run needs "
                             f"--checkpoint.enable with an --checkpoint.interval below the spike")
        load_step = usable[-1]
    elif load_step not in checkpoints:
        raise RerunError(f"--from {load_step}: not a complete checkpoint of the run (checkpoints: "
                         f"{checkpoints or 'none'})")
    elif load_step >= step:
        raise RerunError(f"--from {load_step}: the checkpoint must be before the spike step {step}")
    stop = min(step + after, last_step)
    if not variants:
        variants = [Variant("same")]
    seen = []
    for v in variants:
        if v not in seen:
            seen.append(v)
    return Plan(Path(dump), step, load_step, stop, seen, checkpoint_folder, ledger_folder,
                tuple(s for s in sorted(set(trained)) if load_step < s <= stop))


def strip_train_args(train_args: list[str], drop_inject: bool = False) -> list[str]:
    """The original's flags minus what the rerun sets itself: the dump folder, the
    checkpoint step to load, and ``bitflip`` injections (a fault is not data)."""
    out, i = [], 0
    drop = {"--job.dump_folder", "--dump_folder", "--checkpoint.load_step", "--ledger.rehearsal.rerun"}
    while i < len(train_args):
        a = train_args[i]
        key, eq, val = a.partition("=")
        if key in drop:
            i += 1 if eq else 2
            continue
        if key == "--ledger.rehearsal.inject":
            spec = val if eq else (train_args[i + 1] if i + 1 < len(train_args) else "")
            i += 1 if eq else 2
            kept = [p for p in spec.split(",") if p.strip() and not p.strip().endswith(":bitflip")]
            if kept and not drop_inject:
                out += ["--ledger.rehearsal.inject", ",".join(kept)]
            continue
        out.append(a)
        i += 1
    return out


def resolve_variant(spec: str, led, step: int, load_step: int, config=None,
                    documents: list[dict] | None = None, reach: int = 10) -> Variant:
    """A :data:`PLAN_FOR` / :data:`ESCALATION` entry made concrete for one spike: open
    ``lr`` / ``beta2`` / ``logit_cap`` values from the ledger and config
    (:func:`ledger_values`); ``skip`` widened to the steps from ``load_step + 1`` to
    ``step + reach`` whose rows hold one of ``documents`` (a planted document is cut
    into rows that span several steps; not when ``--ledger.rehearsal.inject`` replaced the step's
    tokens, whose tags then name documents that did not train). The caller extends the
    rerun window past the last skipped step, so that trained steps follow it."""
    v = ledger_values(parse_variant(spec, allow_open=True), led.signal_rows(), step, config)
    if v.kind != "skip" or not documents:
        return v
    if any((led.data.row(r, step) or {}).get("injected") for r in led.data.ranks_at(step)):
        return v  # --ledger.rehearsal.inject replaced the step's tokens: its tags are not what trained
    named = {(d["source"], d["doc"]) for d in documents}
    steps = {step}
    for s in range(load_step + 1, min(step + reach, led.data.last_step) + 1):
        for r in led.data.ranks_at(s):
            sd = led.data.at(s, r)
            if sd and not sd.skipped and any((t.source, seg.doc) in named for t in sd.tags
                                             for seg in t.segments):
                steps.add(s)
    return Variant("skip", steps=tuple(sorted(steps))) if steps != {step} else v


def checkpoints_of(dump: Path, folder: str) -> list[int]:
    from titan_ledger.format.reader import checkpoints

    return checkpoints(dump, folder)


def skip_control(skip: Variant, step: int, load_step: int, trained: list[int]) -> Variant:
    """The same-size control of a ``skip`` that removed the spike (pure): as many OTHER
    trained steps of the window before the spike skipped instead (the latest first, so
    the LR they hold back is the nearest match), the skip's own steps after the spike
    kept (both runs lose them). A skip removes its steps' updates -- with the LR frozen
    over them (``--ledger.skip.lr freeze``), the LR of every later step as well -- not
    only their data: if skipping as many other steps removes the spike too, the data is
    not convicted (issue 51: 14 warm-up steps skipped "proved" an LR spike bad data).
    ``Variant("control")`` without steps (not applicable) when the window holds too few
    other steps: load from an earlier checkpoint (``--from``) to make room."""
    own = set(skip.skip_list(step))
    before = sorted(s for s in own if load_step < s <= step)
    free = [s for s in sorted(trained, reverse=True) if load_step < s < step and s not in own]
    if len(free) < len(before):
        return Variant("control")
    return Variant("control", steps=tuple(sorted([*free[:len(before)], *(s for s in own if s > step)])))


def window_documents(led, first: int, last: int) -> tuple[dict, dict]:
    """Every document trained in steps ``first``..``last`` (the data ledger): its tokens
    there and the steps it appears at, keyed ``(source, doc)``."""
    tokens: dict[tuple[str, int], int] = {}
    steps: dict[tuple[str, int], set] = {}
    for s in range(first, last + 1):
        for r in led.data.ranks_at(s):
            sd = led.data.at(s, r)
            if not sd or sd.skipped:
                continue
            for t in sd.tags:
                for seg in t.segments:
                    k = (t.source, seg.doc)
                    tokens[k] = tokens.get(k, 0) + len(seg)
                    steps.setdefault(k, set()).add(s)
    return tokens, steps


#: a quarantine's control masks at least as many tokens as it, and at most this many times
QUARANTINE_CONTROL_SLACK = 2.0


def quarantine_control(q: Variant, tokens: dict, steps: dict) -> Variant:
    """The same-size control of a ``quarantine`` that removed the spike (pure): other
    documents of the steps the named ones train at, as many tokens (at least, and at most
    :data:`QUARANTINE_CONTROL_SLACK` x), largest first -- the in-step proof's "mask as much
    other data". Masking any text of a step can move its update; the named documents are
    convicted only if masking as much other text of the same steps leaves the spike.
    ``Variant("qcontrol")`` without documents (not applicable) when the steps hold too
    little other text."""
    named = set(q.docs)
    need = sum(tokens.get(d, 0) for d in named)
    at = set().union(*(steps.get(d, set()) for d in named)) if named else set()
    pool = sorted((d for d in tokens if d not in named and steps.get(d, set()) & at),
                  key=lambda d: (-tokens[d], d))
    chosen, total = [], 0
    for d in pool:
        if total >= need:
            break
        if total + tokens[d] <= QUARANTINE_CONTROL_SLACK * need:
            chosen.append(d)
            total += tokens[d]
    if not need or total < need:
        return Variant("qcontrol")
    return Variant("qcontrol", docs=tuple(sorted(chosen)))
