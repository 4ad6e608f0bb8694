"""``Recovery``: what a flagged step does, and the one protocol by which the trainer asks.

Design decision: the copied ``train_step`` in ``trainer.py`` makes one call into this
class at each spot where a decision can change the step, and reads back a named
answer, never a string:

==========================  ===============================================  ==============
trainer spot                call                                             answer
==========================  ===============================================  ==============
before a step (wrapper)     :meth:`Recovery.before_step`                     consumed: bool
the step's execution        :meth:`Recovery.first_execution`                 :class:`Outcome`
(its tokens counted)                                                         and the
                                                                             execution
in place of                 :meth:`Recovery.update`                          --
``optimizers.step()``
the data ran out            :meth:`Recovery.at_data_end`                     goes on: bool
around ``train``            :meth:`Recovery.settling` (a context)            --
==========================  ===============================================  ==============

Five places, each a spot where torchtitan's loop can change what a step is; a
non-finite loss is raised as :class:`~titan_ledger.errors.NonFiniteLoss`, which
``settling`` answers, instead of a sixth call before the raise.

*When* a step is decided lives here (the protocol, the deferral); *what* the decision is --
proof, verdict, bounds, ladder -- is the :class:`~titan_ledger.components.response.judgment.Judgment`
mixin's, over the same parts; moving
the run's position (the checkpoint list, the LR factor a ``rollback_lr`` rung leaves for
every later load) is :class:`~titan_ledger.components.response.rewind.Rewind`'s. Each action
is one method with one caller: the rollback (:meth:`Rewind.rollback
<titan_ledger.components.response.rewind.Rewind.rollback>`, from :meth:`before_step`), the
skip window (``Rewind.skip_window``, from :meth:`before_step`),
the late update of a held step (:meth:`_apply_late`, from :meth:`_resolve`) and the
redo of the step after it (:meth:`_redo`, from :meth:`_after_execute`). A step executed
again -- by the proof or the redo -- goes through
:class:`~titan_ledger.components.response.reexecution.Reexecution`.

Not calling ``optimizers.step()`` on a rejected step leaves parameters, moments and
Adam's step count as they were (OLMo-core PR 309/317: the count must not advance).

**Deferred decisions** (``[ledger.response] defer``, on by default): asking the
question in the step needs the flag on the host before ``optimizers.step()``, a device
sync every step. Instead the device answers first: :meth:`SpikeGuard.hold` becomes the
fused AdamW's ``found_inf`` (GradScaler's mechanism), so a flagged step's update is
withheld with parameters, moments and step count untouched, and the host reads the flag
at the next step (:meth:`Recovery.first_execution`), after that step's forward/backward
was launched, from the copy the recorder already made. A flagged step is then still
exactly where it was -- its parameters and optimizer state unchanged, its batches kept
one step -- and is proven and acted on as in the step; an update the decision applies
is applied at the flagged step's learning rate, and the next step, computed on the old
parameters, is executed again: the run is the one an in-step decision makes. Steps
whose next event needs the decision made (a checkpoint, validation, the last step, a
step before a skip window) decide in the step, so a checkpoint never holds an
undecided update.

A step's flow, deferral included::

    train_step (wrapper)
      before_step()             pending rollback -> Rewind.rollback; skip window -> Rewind.skip_window
      _train_step: fetch; count tokens
        first_execution()       none left: consumed whole (Outcome.EMPTY); else execute,
                                then the previous step's held decision: _resolve (prove, act,
                                _apply_late) -> Outcome.STANDS | REDONE (_redo) | DROPPED
        Ledger.record           signals reduced, rules run (device)
        update()                decide now (flags(): a host read) or defer (hold on the
                                device); optimizers.step() inside LedgerPort.update
      at_data_end()             the fetch found no data: the held decision is made
    train: settling()           the end of training, a NonFiniteLoss: a held decision is made
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torchtitan.config import Configurable

from titan_ledger.components.detection.spikes import STAT_KEYS
from titan_ledger.components.prevention.optimizer import group_lr, set_group_lr
from titan_ledger.components.response.bounds import Breaker
from titan_ledger.components.response.config import ResponseSections
from titan_ledger.components.response.first_execution import FirstExecution, KeptExecution
from titan_ledger.components.response.host import Host, LedgerPort, RunFacts
from titan_ledger.components.response.judgment import Judgment
from titan_ledger.components.response.ladder import Ladder, NoteBudget, parse_ladder
from titan_ledger.components.response.prover import ProveMode, Prover
from titan_ledger.components.response.reexecution import Reexecution
from titan_ledger.components.response.rewind import Rewind
from titan_ledger.components.response.snapshots import SnapshotRing
from titan_ledger.components.response.window_proof import WindowProof
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.data.layout import window_at
from titan_ledger.errors import NonFiniteLoss
from titan_ledger.format.proofs import Applied, Finding, ProofRecord


class Outcome(enum.Enum):
    """What the previous step's deferred decision meant for the step being trained
    (:meth:`Recovery.first_execution`)."""

    EMPTY = "empty"  # every label of the step is masked: consumed whole, never executed
    STANDS = "stands"  # nothing was pending, or the decision changed nothing under this step
    REDONE = "redone"  # it changed the parameters or the gradients: this step was executed again
    DROPPED = "dropped"  # it was a rollback: this step is dropped; the rollback and its skip window ran


class Update(enum.Enum):
    """How a step's update goes in (:meth:`Recovery.update`)."""

    APPLY = "apply"  # decided in the step: applied
    WITHHOLD = "withhold"  # decided in the step: not applied (optimizers.step() not called)
    HOLD = "hold"  # deferred: optimizers.step() runs with the guard, which withholds a flagged update


@dataclass
class Deferred:
    """What a deferred decision needs a step later (``Recovery.held``, beside ``pending``)."""

    lrs: list[list]  # every optimizer's group learning rates at the step (floats, or tensors copied on the device)
    first: FirstExecution | KeptExecution | None  # the first execution, for a proof (None: prove off)
    forced: bool  # --ledger.rehearsal.prove_at names the step
    holds: bool = True  # an acting flag holds the update (False: prove off and the ladder's next rung is none)
    notes: bool = False  # a note holds it (scope = "all" and the note budget allowed a proof at the step)


_NOTE = STAT_KEYS.index("note")


class Recovery(Judgment, Configurable):
    """The response of one ``LedgerTrainer``, a torchtitan component: built after
    torchtitan's ``__init__`` by ``Recovery.Config.of(config.ledger).build(host=...,
    ledger=..., facts=...)`` -- its sections, the two ports it acts through (:class:`Host`,
    :class:`LedgerPort`) and the run's facts it reads (:class:`RunFacts`), all passed in;
    asked at the spots of the module docstring's table."""

    @dataclass(kw_only=True, slots=True)
    class Config(ResponseSections):
        """The response's eight sections (:class:`.config.ResponseSections`, declared once),
        each a ``[ledger.<name>]`` table of the run's TOML: they stay where a user sets them
        (``Ledger.Config`` extends them), and this Config gathers them."""

        @classmethod
        def of(cls, table: Any) -> Recovery.Config:
            """The response's sections of a ``[ledger]`` table (``Ledger.Config``)."""
            return cls(**{f.name: getattr(table, f.name) for f in fields(cls)})

    def __init__(self, config: Config, *, host: Host, ledger: LedgerPort, facts: RunFacts) -> None:
        """Every part is built here from ``config``; nothing reads a setting later."""
        self.config = config
        self.host, self.ledger, self.facts = host, ledger, facts
        self.response = config.response
        # the answers' own history, checkpointed with the run (state_dict, under the keys
        # checkpoints have always had): the rungs tried, the notes proven, the actions counted
        self.ladder = Ladder(parse_ladder(config.response.action), config.response.repeat_horizon)
        self.note_budget = NoteBudget(config.proof.notes_rate, config.proof.notes_burst)
        self.breaker = Breaker(config.breaker.actions, config.breaker.window)
        self._keep_history = False  # an in-process rollback keeps the ladder's and breaker's own history
        self.prover = Prover(host, ledger, facts, self.note_budget, proof=config.proof, adam=config.adam_check,
                             conviction=config.conviction)
        # [ledger.snapshots]: off unless every > 0
        self.snapshots = SnapshotRing(host, ledger, facts, config.snapshots, replays=config.proof.scope != ProveMode.OFF,
                                      max_stall_proofs=config.window.max_stall_proofs)
        self.window = WindowProof(host, ledger, facts, self.snapshots, config.window, config.proof.timeout)
        self.rewind = Rewind(host, ledger, facts, config.rollback, self.snapshots)  # rollbacks and skip windows
        self.pending: StepRecord | None = None  # the step whose decision is deferred
        self.held: Deferred | None = None  # what its decision needs (its LRs, its first execution)
        self._deferrable: bool | None = None
        self.deferred = self.redone = 0  # counts: decisions deferred, steps executed again
        self._stalls_seen = 0  # the stall rule's flags already proven (Ledger.stalls)
        self._stall: dict | None = None  # the stall event this step's forced proof answers
        self._forced_now = False  # the step being judged is a forced proof's, nothing flagged it

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, str]:
        """The ladder's, note budget's and circuit breaker's history, and the steps the
        prover found the model spiking on its own (JSON strings: the trainer checkpoints
        them beside the ledger's counters, as ``ledger_<key>``)."""
        return {"ladder": json.dumps(self.ladder.state_dict()),
                "note_budget": json.dumps(self.note_budget.state_dict()),
                "breaker": json.dumps(self.breaker.state_dict()),
                "model_made": json.dumps(self.prover.model_made)}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's history (a key it lacks, from before that part existed: as built).
        An in-process rollback's load keeps the ladder's and the breaker's own: the rungs
        tried and the actions taken are this process's, not the checkpoint's."""
        if state.get("ladder") and not self._keep_history:
            self.ladder.load_state_dict(json.loads(state["ladder"]))
        if state.get("breaker") and not self._keep_history:
            self.breaker.load_state_dict(json.loads(state["breaker"]))
        if state.get("note_budget"):
            self.note_budget.load_state_dict(json.loads(state["note_budget"]))
        if state.get("model_made") and not self._keep_history:  # (a rollback: what this process saw stands)
            self.prover.model_made = [int(s) for s in json.loads(state["model_made"])]

    @contextlib.contextmanager
    def _keeping_history(self):
        self._keep_history = True
        try:
            yield
        finally:
            self._keep_history = False

    # ------------------------------------------------------------------ the protocol
    def before_step(self) -> bool:
        """Before a step's fetch: run what is pending; True when this call consumed the
        step (a skip window)."""
        t = self.host
        self.snapshots.at_start()  # a snapshot due after the last step; at the first, the state it starts from
        for step, e in self.snapshots.failures:  # (a copy that failed: the ring restarts at the next due step)
            self._response_failure(step, "snapshot", e)
        self.snapshots.failures.clear()
        if self.breaker.paused:  # a paused breaker resumes once a window passed without an action
            self.breaker.tick(t.step)
            self._breaker_events(t.step)
        window = self.ledger.history().skip_window_at(t.step)  # skipped steps train nothing
        if self.pending is not None and (self.rewind.pending is not None or window is not None):
            self._resolve()  # (the step before a window decides in the step; this is a safety net)
        if self.rewind.pending is not None:  # in-process rollback (on_spike)
            self.rewind.rollback(self.rewind.pending, unlimited=len(self.ladder.rungs) == 1,
                                 keeping_history=self._keeping_history, restore_failed=self._response_failure)
            window = self.ledger.history().skip_window_at(t.step)
        if window is None:
            return False
        self.rewind.skip_window(window)
        return True

    def first_execution(self, rec: StepRecord, tokens: tuple, need_loss: bool, run: Callable[[], tuple]):
        """This step's first execution (``run``: the trainer's ``execute`` on its batches;
        ``tokens``: its valid label tokens, this rank's and the batch mesh's) and, behind
        its launched work, the previous step's deferred decision. Returns
        (:class:`Outcome`, the execution that stands: ``run``'s, the redo's, or None):
        ``EMPTY`` when no label of the step is left to train (:meth:`_no_tokens`; ``run``
        not called)."""
        if self._no_tokens(rec, *tokens):
            return Outcome.EMPTY, None
        return self._after_execute(rec, run(), need_loss)

    def _after_execute(self, rec: StepRecord, executed, need_loss: bool):
        outcome, decided = self._previous(rec)
        if outcome is Outcome.REDONE:
            executed = self._redo(rec, decided.proof, need_loss)
        return outcome, executed

    def update(self, rec: StepRecord) -> None:
        """In place of ``optimizers.step()``, after ``Ledger.record``: whether this step's
        update is applied -- decided in the step (a flag read on the host, a proof, the
        ladder), or deferred to the next step with the device withholding a flagged
        update -- then the update, and what follows it (``LedgerPort.update``: update norm, QK-clip)."""
        parts = self.facts.parts
        self.snapshots.log_step(rec)  # its batches and LRs, for a window proof's replay
        how = self._decide(rec)

        def step() -> None:
            try:
                self.snapshots.before_update()
                parts.optimizers.step()
            finally:
                if how is Update.HOLD:  # the held update's guard is lifted, whatever happened
                    for o in parts.optimizers.optimizers:
                        o.found_inf = None

        self.ledger.update(step if how is not Update.WITHHOLD else None)
        if how is Update.HOLD and isinstance(self.held.first, KeptExecution):
            self.held.first.keep(parts.model_parts)  # the step's gradients, kept for its proof (no checksum pass)
        if how is not Update.HOLD:
            self.snapshots.after_decision(rec)

    def at_data_end(self, rec: StepRecord) -> bool:
        """The data ran out fetching ``rec``'s batches (this step). The previous step's
        deferred decision is made now; True when it was a rollback, which then ran (as in
        the step, before this fetch) and training goes on; False: the run ends here."""
        return self.pending is not None and self._previous(rec)[0] is Outcome.DROPPED

    def _no_tokens(self, rec: StepRecord, local_tokens: int, global_tokens) -> bool:
        """Before ``rec``'s first execution, its valid label tokens counted (``local``: this
        rank's, a host int; ``global``: the batch mesh's sum, on the device): True when
        every label of the step is masked on every rank (a quarantine, the repetition
        filter), and the step was consumed whole instead of trained -- no forward or
        backward, no update, Adam's step count not advanced, the LR schedule as over a
        skipped window (``--ledger.skip.lr``), its rows saying why -- never trained into
        a NaN loss. Only a rank with no token of its own reads the global count (a device
        sync there alone): every rank of a step with none reads it and agrees."""
        if int(local_tokens) > 0 or int(global_tokens) > 0:
            return False
        from torchtitan.tools.logging import logger

        t = self.host
        if self.pending is not None and self._previous(rec)[0] is Outcome.DROPPED:
            return True  # the previous step's decision was a rollback: this step is dropped, the rollback ran
        t.attend(None)
        lr_mode = self.facts.skip_lr
        if lr_mode == "advance":
            self.facts.parts.lr_schedulers.step()
        from titan_ledger.data.loader import SkipInfo

        lr = next(iter(self.facts.parts.lr_schedulers.get_metrics().values()), float("nan"))
        after = self.facts.loader.position if self.facts.loader is not None else 0
        info = SkipInfo(after - self.facts.global_batch, after, list(rec.tags) if rec.tags else None)
        self.ledger.record_skip(first=rec.step, last=rec.step, info=info, lr=lr, step_start=rec.start, rec=rec,
                                metrics_logger=self.facts.parts.metrics_logger)
        self._done(rec)
        self.snapshots.clear()  # a step consumed untrained is not replayed: the next due step starts the ring
        if self.facts.topo.is_rank0:
            what = ", ".join(sorted(k for k, v in rec.masked.items() if v)) or "masks"
            logger.warning(f"titan_ledger: step {t.step}: every label token of the step is masked ({what}): "
                           f"the step is skipped whole (no update; LR schedule {lr_mode}), not trained into a NaN")
        return True

    @contextlib.contextmanager
    def settling(self):
        """Around torchtitan's ``train``: a decision still deferred is made when training
        ends (the data ran out, the last step) or stops on a non-finite loss
        (:class:`~titan_ledger.errors.NonFiniteLoss`: its row is written with its decision
        before the stop, as the step would have: the ledger stops at a non-finite row, with
        :class:`~titan_ledger.components.signals.recorder.NonFiniteRow`);
        after any other stop its step's rows are written as they stand."""
        try:
            yield
        except NonFiniteLoss:
            try:
                self._settle(ok=True)
                self.ledger.drain(block=True, metrics_logger=self.facts.parts.metrics_logger)
            except BaseException as stop:  # the ledger's stop at the non-finite row (NonFiniteRow): the one to see
                raise stop from None
            raise
        except BaseException:
            with contextlib.suppress(Exception):  # (the error that stopped training is the one to see)
                self._settle(ok=False)
            raise
        self._settle(ok=True)

    def _settle(self, ok: bool) -> None:
        """A deferred decision still open is made (``ok``: the end of training, or a
        non-finite loss whose row must be written with its decision) or, after an error,
        its step's rows are written as they stand (its update was withheld if it was
        flagged)."""
        rec = self.pending
        if rec is None:
            return
        if ok:
            self._resolve()
            return
        self.pending = None
        flags = self.ledger.flags(rec)
        d, self.held = self.held, None
        rec.update_skipped = bool(flags and (d.forced or (flags[0] and d.holds) or (flags[1] and d.notes)))
        rec.decided = True  # its rows are written (train's final drain)
        self._done(rec)

    # ------------------------------------------------------------------ the decision
    def _acts(self) -> bool:
        """Whether a flag can change what a step does (a proof or an acting ladder)."""
        return self.ledger.detector is not None and (self.prover.mode != ProveMode.OFF or self.ladder.acts)

    def _stall_due(self) -> bool:
        """A stall the rule flagged since the last step (``Ledger.stalls``): this step is
        proven as a forced one, and its window proof asks which fix lowers the loss (the
        snapshots' window; nothing without them)."""
        stalls = self.ledger.history().stalls
        if len(stalls) <= self._stalls_seen:
            return False
        self._stalls_seen = len(stalls)
        if not (self.snapshots.replays and self.window.ring.stall_proofs < self.window.config.max_stall_proofs):
            return False
        self._stall = stalls[-1]
        return True

    def _forced(self, step: int) -> bool:
        return self.prover.mode != ProveMode.OFF and window_at(self.facts.prove_at, step) is not None

    @property
    def deferrable(self) -> bool:
        """Whether decisions can be deferred in this run (``--ledger.response.defer``): an
        acting flag, QK-clip off (its update follows the decision), fused Adam/AdamW
        optimizers (``found_inf``) and no step hook on the optimizers container (a held
        update would still run it); said once at the first step when it cannot."""
        if self._deferrable is None:
            opts = list(getattr(self.facts.parts.optimizers, "optimizers", [self.facts.parts.optimizers]))
            fused = all(isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) and
                        all(g.get("fused") for g in o.param_groups) for o in opts)
            # a hook on the optimizers container (MoE load balancing's expert-bias update)
            # runs on every optimizers.step(), a held one included: not what a skipped step does
            hooked = bool(getattr(self.facts.parts.optimizers, "_optimizer_step_pre_hooks", None) or
                          getattr(self.facts.parts.optimizers, "_optimizer_step_post_hooks", None))
            self._deferrable = bool(self.response.defer and self._acts() and fused
                                    and not self.facts.clips_qk and not hooked)
            if self.response.defer and self._acts() and not self._deferrable and self.facts.topo.is_rank0:
                from torchtitan.tools.logging import logger

                why = "QK-clip is on" if self.facts.clips_qk else \
                    "the optimizer is not a fused Adam/AdamW (--optimizer.implementation fused)" if not fused else \
                    "an optimizer step hook runs on every update (MoE load balancing)"
                logger.warning(f"titan_ledger: --ledger.response.defer: {why}, so every step reads its spike "
                               f"flag on the host before its update (a device sync per step)")
        return self._deferrable

    def defers(self, step: int) -> bool:
        """Whether ``step`` defers its decision: not where what follows the step needs it
        made (a checkpoint or validation step, the last step, a step before a skip
        window). A logging step defers too: torchtitan logs its first execution, as the
        row does, and its row is written a step later."""
        if not self.deferrable:
            return False
        return not (self.host.decision_due(step) or self.ledger.history().skip_window_at(step + 1) is not None
                    or self.snapshots.due(step))

    def _decide(self, rec: StepRecord) -> Update:
        """This step's update: :attr:`Update.APPLY`/``WITHHOLD`` decided in the step, or
        :attr:`Update.HOLD` (deferred: the device withholds a flagged step's update
        through ``found_inf``)."""
        if not self._acts():
            self._done(rec)
            return Update.APPLY
        forced = self._forced(rec.step) or self._stall_due()
        if self.defers(rec.step):
            self._defer(rec, forced)
            return Update.HOLD
        try:
            applied = self._judge(rec, *self.ledger.flags(), forced)
        finally:
            self._done(rec)  # the step's batches are not kept past its decision
        return Update.APPLY if applied else Update.WITHHOLD

    def _defer(self, rec: StepRecord, forced: bool) -> None:
        ledger = self.ledger
        mode = self.prover.mode
        # prove off: a flag the ladder answers with a `none` rung applies its update, so it
        # is not held (held, it would have to be recomputed a step later, from gradients gone)
        holds = mode != ProveMode.OFF or self.ladder.would_act(rec.step)
        notes = False
        if forced:
            hold = torch.ones((), dtype=torch.float32, device=self.facts.device)
        else:
            notes = self.prover.notes_allowed(rec.step)
            hold = ledger.hold(acting=holds, notes=notes)
        opts = list(self.facts.parts.optimizers.optimizers)
        for o in opts:
            o.found_inf = hold
        first = None
        if mode != ProveMode.OFF:  # the gradients are freed every step anyway: kept, checksummed only if held
            execution = self.ledger.recorded().execution
            first = (KeptExecution(execution) if self._keeps_grads()
                     else FirstExecution.of(self.facts.parts.model_parts, self.facts.device, execution))
        self.held = Deferred(lrs=[[group_lr(g) for g in o.param_groups] for o in opts], first=first,
                              forced=forced, holds=holds, notes=notes)
        rec.decided = False  # its rows wait for the decision
        self.pending = rec
        self.deferred += 1

    def _keeps_grads(self) -> bool:
        """Whether a deferred step's first execution is kept as its gradient tensors
        (:class:`KeptExecution`): on the CPU, where every step's ``zero_grad`` sets them to
        None (a checksum pass costs CPU time there, a step's gradients little memory)."""
        return self.facts.grads_freed

    def _previous(self, rec: StepRecord) -> tuple[Outcome, StepRecord | None]:
        """The previous step's deferred decision, made while ``rec`` (this step) was
        fetched or executed; on a rollback ``rec`` is dropped (:meth:`_drop`). Returns
        the outcome and the decided step's record (its proof)."""
        decided = self.pending
        self.prover.next_rec = rec  # fetched: the data of the same novelty a conviction is controlled by
        try:
            outcome = self._resolve()
        finally:
            self.prover.next_rec = None
        if outcome is Outcome.DROPPED:
            self._drop(rec)
        return outcome, decided

    def _resolve(self) -> Outcome:
        """The deferred decision of the step before this one, made now: its flag read on
        the host from the recorder's copy (long arrived), and a flagged step proven and
        acted on as in the step. ``REDONE``: the parameters changed, or a proof overwrote
        the gradients (this step must be executed again); ``DROPPED``: a rollback is
        pending."""
        rec = self.pending
        if rec is None:
            return Outcome.STANDS
        self.pending = None
        t = self.host
        ledger = self.ledger
        d, self.held = self.held, None
        flags = ledger.flags(rec)
        if flags is None:
            raise RuntimeError(f"titan_ledger: step {rec.step}'s decision was deferred but its flag was not queued")
        acting, note = flags
        rec.decided = True
        held = d.forced or (acting and d.holds) or (note and d.notes)
        if not held:  # the device applied the update
            if note and not acting and self.prover.mode == ProveMode.ALL:
                rec.unproven = "budget"
            self._done(rec)
            if acting and not self._judge(rec, acting, note, False, decided_at=t.step):  # the ladder's `none` rung
                raise RuntimeError(f"titan_ledger: step {rec.step}'s flag was not held but its action withholds "
                                   f"the update")  # (Ladder.would_act answered for this very flag)
            return Outcome.STANDS
        now = t.step
        try:
            with t.as_step(rec.step):  # the hooks and messages see the flagged step
                first = d.first.first(self.facts.parts.model_parts, self.facts.device) if isinstance(d.first, KeptExecution) else d.first
                applied = self._judge(rec, acting, note, d.forced, first=first, decided_at=now)
                if applied:
                    applied = self._load_late(rec)
                if applied:
                    self._apply_late(rec, d.lrs)
        finally:
            self._done(rec)
        self.snapshots.after_decision(rec, late=True)  # a late update the replay cannot repeat clears the ring
        # its rows now, as in the step: the ledger stops at a non-finite row before this
        # step is recorded (a non-finite loss always flags)
        ledger.drain(block=False, metrics_logger=self.facts.parts.metrics_logger)
        if self.rewind.pending is not None:
            return Outcome.DROPPED
        return Outcome.REDONE if (applied or rec.proof is not None) else Outcome.STANDS

    def _done(self, rec: StepRecord) -> None:
        """``rec``'s decision is made: its batches (device tensors once executed) and the
        proof's hold on them are let go."""
        rec.batches = None
        self.prover.release()

    # ------------------------------------------------------------------ actions
    def _drop(self, rec: StepRecord) -> None:
        """``rec`` (this step) is dropped: the previous step's deferred decision was a
        rollback, which in the step would have run before this step's fetch. What the
        fetch and execution left is taken back -- the per-step accumulators, the
        batches and fetch times in torchtitan's throughput metrics -- and the rollback
        and its skip window run now."""
        t = self.host
        self.ledger.discard_step_state()
        mp = self.facts.parts.metrics_processor
        mp.ntokens_since_last_log -= sum(rec.fetched)
        if rec.fetched:
            del mp.data_loading_times[-len(rec.fetched):]
        t.attend(None)
        rec.batches = None
        self.before_step()

    def _apply_late(self, rec: StepRecord, lrs: list[list]) -> None:
        """The held update of ``rec``, applied a step late at its own learning rates (the
        schedule has moved on since)."""
        opts = list(self.facts.parts.optimizers.optimizers)
        now = [[group_lr(g) for g in o.param_groups] for o in opts]
        for o, lr in zip(opts, lrs):
            for g, x in zip(o.param_groups, lr):
                set_group_lr(g, x)

        def step() -> None:
            try:
                self.facts.parts.optimizers.step()
            finally:
                for o, lr in zip(opts, now):
                    for g, x in zip(o.param_groups, lr):
                        set_group_lr(g, x)

        self.ledger.update(step, rec)

    def _redo(self, rec: StepRecord, proof: ProofRecord | None, need_loss: bool):
        """This step again, after the previous step's deferred decision changed the
        parameters or the gradients: its first execution is replaced
        (:class:`Reexecution` with ``replaces``: its accumulators drained, the rehearsal's
        one-time faults re-armed), documents the decision convicted are masked in its
        batches as the fetch would have, and ``execute`` runs once more."""
        t = self.host
        if proof is not None and proof.verdict == Finding.BAD_DATA and proof.applied in (Applied.MASKED, Applied.CONTROL):
            # (``proof``: the decided step's, which convicted and quarantined its documents)
            self.ledger.remask(rec, [tuple(x) for x in proof.documents or []])
        self.redone += 1
        with Reexecution(t, self.ledger, self.facts, rec, replaces=True) as again:
            return again.run(rec.batches, need_loss)
