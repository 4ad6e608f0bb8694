"""THE builder of an incident's answer: one function, typed inputs, one record out.

Design decision: an answer is built once, here, from what was measured -- the step's event
(the flag's rules and statistics, or the stall's), its proof (:class:`ProofRecord`, with the
window proof's re-runs), what a rerun from a checkpoint proved (:class:`RerunFinding`), the
run's settings and launch (:class:`~.records.Context`) -- and written: by the trainer when it
decides (``spikes.jsonl``'s ``answer``), by ``diagnose --rerun`` / ``replay rerun`` when a
rerun adds a cause (``rerun/step<T>.json``'s ``answer``), and for a ledger written before
answers by :mod:`.of_run`. No view amends it; the decision tree's reading is a candidate a
view may show beside it (:func:`tree_candidates`), never part of it.

* **One cause**: the mechanism a proof measured (Adam's state in step, a data or hardware
  verdict) or the window's fixes; the LR as the *driver* where its cut removed it beside a
  mechanism's own fix ("LR-driven attention-logit growth"); then, for a spike, the fix is
  whichever of the two trained better in the window (a mechanism's fix leaves the driver in
  the run; a stall's window, judged by the loss alone, keeps the mechanism's). Where
  several mechanisms' fixes each remove it, the proof does not separate them (``separates``
  False): the fixes are ranked by effect and no cause is claimed.
* **One judge**: each fix's effect is the window proof's (:mod:`.window`).
* **A fix is a change to this run** (:func:`~.causes.derive`), never a value the run already
  has, with the command that relaunches it (:mod:`.command`). Only the answer's fix gets a
  command: a fix the window measured, or the fix of a cause proven in step or by a rerun
  (``not measured``). A candidate -- the decision tree's reading, a fix another incident of
  the run measured -- is listed, untested, without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from titan_ledger.format.answers.causes import CANDIDATE_OF, derive
from titan_ledger.format.answers.command import command_of, new_dump_folder
from titan_ledger.format.answers.records import Answer, Context, Fix
from titan_ledger.format.answers.window import window_fixes
from titan_ledger.format.answers.words import did, num, times, title_of
from titan_ledger.format.proofs import ProofRecord


@dataclass(frozen=True, slots=True)
class RerunFinding:
    """What a rerun from a checkpoint proved of a step (``rerun/step<T>.json``'s verdict,
    read against the step's own proof): its cause, the rule in words, proof or evidence."""

    cause: str
    rule: str
    proven: bool


@dataclass(slots=True)
class _Draft:
    """The answer while it is built (the builder's steps fill it in order)."""

    step: int
    kind: str
    ctx: Context
    exists: Any = None
    cause: str = ""
    driver: str | None = None
    established: str = "none"
    how: str = ""
    not_proven: str | None = None
    separates: bool | None = None
    fixes: list[Fix] = field(default_factory=list)
    fix: Fix | None = None
    candidates: list[Fix] = field(default_factory=list)
    documents: tuple[str, ...] = ()
    quarantine: bool = False
    onset: int | None = None

    # ---------------------------------------------------------------- the proof in step
    def in_step(self, proof: ProofRecord) -> str:
        """The in-step verdict's cause and how; returns the verdict the window reads."""
        v = "not_data" if self.kind == "stall" else proof.verdict  # a stall: the window alone answers
        if v == "hardware":
            self.cause, self.established = "hardware", "in_step"
            ranks = ", ".join(map(str, proof.dp_ranks or []))
            self.how = f"the step executed again on the same data and state differed (DP rank(s) {ranks})"
        elif v == "bad_data" and proof.health:  # a conviction needs a healthy state: this one had none
            self.documents = tuple(f"{s}:{d}" for s, d in proof.documents or [])
            self.how = (f"the data stood out on a model that had left its healthy regime at step "
                        f"{proof.health.get('broken_since')}: a conviction there is not believed (it needs the "
                        f"data abnormal on a healthy state too); the episode's cause is what broke the model")
        elif v == "bad_data":
            self.cause, self.established = "bad_data", "in_step"
            self.documents = tuple(f"{s}:{d}" for s, d in proof.documents or [])
            self.how = "masking the convicted data brought the update back to normal; masking as much other data did not"
            self.quarantine = proof.applied not in ("masked", "control")
            if self.quarantine and self.documents and self.ctx.dump:  # held back: the quarantine, as a relaunch
                qfile = new_dump_folder(self.ctx.dump, self.step, "quarantine", self.exists) + ".jsonl"
                shown = ", ".join(self.documents[:4]) + (" ..." if len(self.documents) > 4 else "")
                self.fix = Fix("quarantine", "bad_data", ("--ledger.filter.quarantine", qfile),
                               f"--ledger.filter.quarantine {qfile} (the convicted document(s) {shown})", "removed",
                               "in step: the update normal with them masked, not with as much other data masked")
        elif v == "optimizer_state":
            self.cause, self.established = "optimizer_state", "in_step"
            opt = proof.optimizer or {}
            self.how = (f"Adam's second moment stood {times(opt.get('restore'))} below its long-run level: with it "
                        f"restored the update is {times(opt.get('amplification'))} smaller"
                        if opt.get("amplification") else proof.why)
        elif v == "outlier":
            self.established = "in_step"
            self.how = "the suspect data stood out and the update was normal with it: nothing to fix"
        elif self.kind == "stall":
            self.how = "the stall rule flagged the loss's trend"
        else:  # not_data: reproducible, not the suspect's data; the window decides which cause
            self.how = "in step: reproducible (not hardware) and not the suspect's data"
        return v

    # ---------------------------------------------------------------- the window proof
    def window(self, window: dict[str, Any], v: str) -> None:
        """What the window's re-runs from the host snapshot say (or why there were none)."""
        start = window.get("from_step")
        if start is not None:
            self.fixes, same = window_fixes(window, self.ctx.knobs)
            good = [f for f in self.fixes if f.effect in ("removed", "lowered")]
            control = next((r for r in window.get("runs") or [] if r.get("variant") == "control"), None)
            if same is not None and same.get("normal") and not window.get("stall"):
                self.not_proven = (f"the window re-run from step {start} did not reproduce the spike: nothing to "
                                   f"prove against")
            elif good and control is not None and control.get("effect") in ("removed", "lowered"):
                self.separates = False
                self.not_proven = (f"the window's control (every step's LR x {num(window.get('control'))}, no fix) "
                                   f"{control['effect']} it as well: the spike hangs on the trajectory's details, "
                                   f"and the fixes that removed it in the window from step {start} prove nothing")
            elif not good:
                self.not_proven = (f"no fix tried in the window from step {start} removed it"
                                   + (" (the mechanism's own fix included)" if self.cause == "optimizer_state" else ""))
            else:
                self._fixed(good, window)
                self.how += ("; " if self.how else "") + (
                    f"the window re-run from step {start} ({window.get('steps')} steps) reproduced it"
                    + (" and stalled as the run did" if window.get("stall") else ""))
        elif window.get("cause") is None and window.get("why") and v in ("not_data", "optimizer_state", "bad_data"):
            self.not_proven = f"no window proof: {window['why']}"
            if window.get("error"):
                self.not_proven += f" (failed: {window['error']})"
        elif v in ("not_data", "optimizer_state") and not window:
            self.not_proven = "no window proof ran"
        if start is not None and self.cause not in ("bad_data", "hardware"):
            self.onset = start  # the fix was measured from there: its relaunch starts at or before it

    def _fixed(self, good: list[Fix], window: dict[str, Any]) -> None:
        """Fixes removed it in the window: which cause they establish, and the fix."""
        mechanisms = {f.cause for f in good} - {"lr"}
        self.separates = len(mechanisms) <= 1
        cause = self.cause
        own = next((f for f in good if f.cause == cause), None) if cause else None
        if cause in ("bad_data", "hardware"):  # the data convicted; a fix as well: a fragile model
            self.how += (f"; with the data unmasked, {good[0].change or good[0].variant} removed it in the window as "
                         f"well: the data triggered it in a model its configuration made fragile")
        elif cause:  # a mechanism measured in step: its own fix confirms it; the LR may drive it
            if own is not None:
                self.established, self.fix = "in_step+window", own
                if self.separates and any(f.cause == "lr" for f in good) and cause != "lr":
                    self.driver = "lr"
            else:
                self.fix = good[0]
                self.driver = "lr" if self.fix.cause == "lr" else None
                self.how += (f"; its own fix did not remove it in the window, {self.fix.change or self.fix.variant} "
                             f"did" if self.fix.cause != cause else "")
                self.established = "in_step"
                self.separates = None if len(mechanisms) <= 1 else self.separates
        elif self.separates:
            self.established = "window"
            mech = next(iter(mechanisms), "lr")
            self.cause = mech
            self.fix = next((f for f in good if f.cause == mech), good[0])
            cut = next((f for f in good if f.cause == "lr"), None)
            if mech != "lr" and cut is not None:
                self.driver = "lr"
                # the LR drives a spike: of the driver's cut and the mechanism's own fix, the
                # one ranked first (the better effect, then the lower loss at the window's
                # end). The mechanism's fix alone leaves the driver in the run: at
                # logit_stall_lr02 seed 1, eps 1e-6 removed step 25 in the window and over
                # 1,000 steps the run flagged 26 steps against 14 and ended higher. Not for a
                # stall: its window is judged by the loss alone, which any LR cut lowers at
                # once (the annealing drop) whatever drives the stall -- the same run's stall
                # at step 350, given the cut (its window 0.11 lower against the logit cap's
                # 0.08), ended 0.8% lower over the horizon, the logit cap 9.8%
                # (docs/benchmarks.md, issue 67)
                if not window.get("stall") and good.index(cut) < good.index(self.fix):
                    self.how += (f"; the driver's cut is the fix: it removed it as well and trained better "
                                 f"in the window (loss {num(cut.cost, 2)} against {num(self.fix.cost, 2)} for "
                                 f"{self.fix.change or self.fix.variant})")
                    self.fix = cut
        else:  # several mechanisms' fixes each remove it: no cause claimed, the best fix first
            self.established, self.fix = "unseparated", good[0]

    # ---------------------------------------------------------------- fixes not measured here
    def own_fix(self) -> None:
        """A cause proven in step with no fix measured here: its own fix is the answer's (not
        measured), unless the window tried it and it did not remove the spike (a candidate)."""
        if self.fix is not None or self.cause not in CANDIDATE_OF:
            return
        ch = derive(CANDIDATE_OF[self.cause], self.ctx.knobs)
        if ch is None:
            return
        tried = next((f for f in self.fixes if f.flags == ch.flags), None)
        own = Fix(CANDIDATE_OF[self.cause], self.cause, ch.flags, ch.words, "not measured",
                  "the fix of the cause proven in step" + (" (tried in the window, which did not discriminate)"
                                                           if tried else ""), resumes=ch.resumes)
        if self.established.startswith("in_step") and (tried is None or tried.effect in ("removed", "lowered")):
            self.fix = own
        else:
            self.candidates.append(replace(own, detail=f"the mechanism's own fix (tried in the window: "
                                                       f"{tried.effect})" if tried else "the mechanism's own fix"))

    def other_candidates(self, tree: dict[str, Any] | None, earlier: tuple[int, Fix] | None) -> None:
        """The tree's reading and the fix an earlier incident of the run measured: candidates."""
        if self.fix is None and self.cause in ("", "optimizer_state"):
            self.candidates += tree_candidates(tree, self.ctx, self.candidates)
        if self.fix is None and earlier is not None and self.cause not in ("bad_data", "hardware"):
            at, was = earlier
            if was.flags and not any(c.flags == was.flags for c in self.candidates):
                self.candidates.append(replace(was, effect="not measured",
                                               detail=f"measured at step {at} of this run ({was.effect} there)"))

    def rerun(self, found: RerunFinding) -> None:
        """A rerun's cause where no proof at the alarm established one: proven, its own fix is
        the answer's (not measured, with its command); evidence, a candidate."""
        if self.cause:
            return
        had_fix = self.fix is not None
        self.cause, self.established, self.how = found.cause, "rerun" if found.proven else "rerun_evidence", found.rule
        if found.proven:
            self.not_proven = None
        if had_fix or self.cause in ("hardware", "bad_data"):
            return
        read = tree_candidates({"cause": found.cause, "certainty": "proven by a rerun" if found.proven
                                else "evidence"}, self.ctx)
        if not read:
            return
        known = next((c for c in self.candidates if c.flags == read[0].flags), None)
        if found.proven:  # its own fix is the answer's (a candidate listed already: promoted)
            if known is not None:
                self.candidates.remove(known)
            self.fix = replace(known or read[0], detail="the fix of the cause a rerun proved")
        elif known is None:
            self.candidates += read


def build(step: int, kind: str, event: dict[str, Any] | None, proof: ProofRecord | None, ctx: Context,
          *, unproven: str | None = None, tree: dict[str, Any] | None = None,
          earlier: tuple[int, Fix] | None = None, rerun: RerunFinding | None = None, exists=None) -> Answer:
    """THE answer to the incident at ``step`` (``kind`` ``spike`` or ``stall``): ``event`` is
    its ``spikes.jsonl`` event (the flag's rules and statistics, or the stall's), ``proof``
    the proof at the alarm (None: not proven; ``unproven`` says why), ``tree`` the decision
    tree's reading (``cause`` and ``certainty``: candidates only, never the answer's cause),
    ``earlier`` the fix an earlier incident of this run measured (``(step, fix)``: a
    candidate where none is measured here), ``rerun`` what a rerun from a checkpoint proved."""
    ev = event or {}
    d = _Draft(step=step, kind=kind, ctx=ctx, exists=exists, not_proven=unproven, onset=step - 1)
    window = (proof.window if proof is not None else None) or {}
    if proof is None:
        if not d.not_proven:
            d.not_proven = ("the stall rule's window proof needs host snapshots (--ledger.snapshots.every)"
                            if kind == "stall" else "no proof ran (--ledger.proof.scope off, or a run "
                            "without the response)")
        if kind == "stall":
            d.onset = int((ev.get("stall") or {}).get("since") or step)
            if (ev.get("stall") or {}).get("kind") == "stalled":  # the rule's own evidence (the logits), not the tree's
                tree = {"cause": "logit_growth", "certainty": "the stall rule's evidence: the max logit past its bar"}
    else:
        d.window(window, d.in_step(proof))
    d.own_fix()
    d.other_candidates(tree, earlier)
    if rerun is not None:
        d.rerun(rerun)
    # the command applies the answer's fix only: a candidate (the tree's reading, a fix another
    # incident measured) is untested here -- measured at 304c3a5, 50 of 75 such relaunches helped
    start, command, new_dump = command_of(step, d.fix, d.onset, ctx, exists)
    done, acting = did(proof, ev)
    return Answer(step=step, kind=kind, title=title_of(kind, ev, ctx), cause=d.cause, driver=d.driver,
                  established=d.established, how=d.how, not_proven=d.not_proven, separates=d.separates,
                  fixes=tuple(d.fixes), fix=d.fix, candidates=tuple(d.candidates), start=start, command=command,
                  new_dump=new_dump, did=done, acting=acting, documents=d.documents, quarantine=d.quarantine,
                  window_from=window.get("from_step"), onset=d.onset, loss=ev.get("loss"),
                  grad_norm=ev.get("grad_norm"))


def tree_candidates(tree: dict[str, Any] | None, ctx: Context, known: list[Fix] | tuple[Fix, ...] = ()) -> list[Fix]:
    """The decision tree's reading as a candidate fix (never the answer's cause): the change
    its cause calls for, when this run does not have it already."""
    if not tree or tree.get("cause") not in CANDIDATE_OF:
        return []
    ch = derive(CANDIDATE_OF[tree["cause"]], ctx.knobs)
    if ch is None or any(c.flags == ch.flags for c in known):
        return []
    return [Fix(CANDIDATE_OF[tree["cause"]], tree["cause"], ch.flags, ch.words, "not measured",
                f"the decision tree's reading ({tree['cause']}, {tree.get('certainty', 'guess')})", resumes=ch.resumes)]
