"""``Recovery``: what a flagged step does, and the one protocol by which the trainer asks.

Design decision: the copied ``train_step`` in ``trainer.py`` makes one call into this
class at each spot where a decision can change the step, and reads back a named
answer, never a string:

==========================  ===============================================  ==============
trainer spot                call                                             answer
==========================  ===============================================  ==============
before a step (wrapper)     :meth:`Recovery.before_step`                     consumed: bool
after the step's execution  :meth:`Recovery.after_execute`                   :class:`Outcome`
in place of                 :meth:`Recovery.update`                          --
``optimizers.step()``
the data ran out            :meth:`Recovery.at_data_end`                     goes on: bool
a non-finite loss, the end  :meth:`Recovery.settle`                          --
==========================  ===============================================  ==============

Everything those answers need -- the ladder, the checkpoint list, the LR factor a
``rollback_lr`` rung leaves for every later load, the proof -- lives here. Each action
is one method with one caller: the rollback (:meth:`_rollback`, from
:meth:`before_step`), the skip window (:meth:`_skip_window`, from :meth:`before_step`),
the late update of a held step (:meth:`_apply_late`, from :meth:`_resolve`) and the
redo of the step after it (:meth:`_redo`, from :meth:`after_execute`). A step executed
again -- by the proof or the redo -- goes through
:class:`~titan_ledger.components.response.reexecution.Reexecution`.

Not calling ``optimizers.step()`` on a rejected step leaves parameters, moments and
Adam's step count as they were (OLMo-core PR 309/317: the count must not advance).

**Deferred decisions** (``[ledger.on_spike] defer``, on by default): asking the
question in the step needs the flag on the host before ``optimizers.step()``, a device
sync every step. Instead the device answers first: :meth:`SpikeGuard.hold` becomes the
fused AdamW's ``found_inf`` (GradScaler's mechanism), so a flagged step's update is
withheld with parameters, moments and step count untouched, and the host reads the flag
at the next step (:meth:`Recovery.after_execute`), after that step's forward/backward
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
      before_step()             pending rollback -> _rollback; skip window -> _skip_window
      _train_step: fetch; execute (first execution)
        after_execute()         the previous step's held decision: _resolve (prove, act,
                                _apply_late) -> Outcome.STANDS | REDONE (_redo) | DROPPED
        Ledger.record           signals reduced, rules run (device)
        update()                decide now (flags_now: a host read) or defer (hold on the
                                device); optimizers.step(); Ledger.after_update
      at_data_end()             the fetch found no data: the held decision is made
    train: settle()             the end of training: a held decision is made
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from titan_ledger.components.detection.spikes import STAT_KEYS
from titan_ledger.components.prevention.optimizer import group_lr, scale_lr, set_group_lr
from titan_ledger.components.response.ladder import ladder_report
from titan_ledger.components.response.prover import FirstExecution, KeptExecution, Prover
from titan_ledger.components.response.reexecution import Reexecution
from titan_ledger.components.response.snapshots import SnapshotRing, WindowProof
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.data.layout import parse_skip_steps, window_at
from titan_ledger.errors import LedgerStop
from titan_ledger.format import records
from titan_ledger.format.proofs import describe_proof


class Outcome(enum.Enum):
    """What the previous step's deferred decision meant for the step being trained
    (:meth:`Recovery.after_execute`)."""

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
    """What a deferred decision needs a step later (``StepRecord.deferred``)."""

    lrs: list[list]  # every optimizer's group learning rates at the step (floats, or tensors copied on the device)
    first: FirstExecution | KeptExecution | None  # the first execution, for a proof (None: prove off)
    forced: bool  # --ledger.rehearsal.prove_at names the step
    holds: bool = True  # an acting flag holds the update (False: prove off and the ladder's next rung is none)
    notes: bool = False  # a note holds it (prove = "all" and the note budget allowed a proof at the step)


_NOTE = STAT_KEYS.index("note")


class Recovery:
    """The recovery side of one ``LedgerTrainer``: built with it, asked at the spots of the
    module docstring's table."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.prover = Prover(trainer)
        self.snapshots = SnapshotRing(trainer)  # [ledger.snapshots]: off unless every > 0
        self.window = WindowProof(trainer, self.snapshots)
        self._prove_at: list | None = None  # (the trainer's config exists after torchtitan's __init__)
        self.pending_rollback: int | None = None  # the spiked step a rollback starts from
        self.lr_scale = 1.0  # the recovery ladder's rollback_lr factors, multiplied
        self.pending: StepRecord | None = None  # the step whose decision is deferred
        self._deferrable: bool | None = None
        self.deferred = self.redone = 0  # counts: decisions deferred, steps executed again

    # ------------------------------------------------------------------ the protocol
    def before_step(self) -> bool:
        """Before a step's fetch: run what is pending; True when this call consumed the
        step (a skip window)."""
        t = self.trainer
        self.snapshots.at_start()  # a snapshot due after the last step; at the first, the state it starts from
        window = t.ledger.skip_window_at(t.step)  # skipped steps train nothing
        if self.pending is not None and (self.pending_rollback is not None or window is not None):
            self._resolve()  # (the step before a window decides in the step; this is a safety net)
        if self.pending_rollback is not None:  # in-process rollback (on_spike)
            self._rollback(self.pending_rollback)
            window = t.ledger.skip_window_at(t.step)
        if window is None:
            return False
        self._skip_window(window)
        return True

    def after_execute(self, rec: StepRecord, executed, need_loss: bool):
        """After this step's first execution (``executed``: what ``execute`` returned),
        behind its launched work: the previous step's deferred decision is made. Returns
        (:class:`Outcome`, the execution that stands: ``executed``, or the redo's)."""
        outcome, decided = self._previous(rec)
        if outcome is Outcome.REDONE:
            executed = self._redo(rec, decided.proof, need_loss)
        return outcome, executed

    def update(self, rec: StepRecord) -> None:
        """In place of ``optimizers.step()``, after ``Ledger.record``: whether this step's
        update is applied -- decided in the step (a flag read on the host, a proof, the
        ladder), or deferred to the next step with the device withholding a flagged
        update -- then the update, and what follows it (``Ledger.after_update``)."""
        t = self.trainer
        self.snapshots.log_step(rec)  # its batches and LRs, for a window proof's replay
        how = self._decide(rec)
        try:
            if how is not Update.WITHHOLD:
                self.snapshots.before_update()
                t.optimizers.step()
        finally:
            if how is Update.HOLD:  # the held update's guard is lifted, whatever happened
                for o in t.optimizers.optimizers:
                    o.found_inf = None
        if how is Update.HOLD and isinstance(rec.deferred.first, KeptExecution):
            rec.deferred.first.keep(t)  # the step's gradients, kept for its proof (no checksum pass)
        t.ledger.after_update(how is not Update.WITHHOLD)  # QK-clip, update_norm
        if how is not Update.HOLD:
            self.snapshots.after_decision(rec)

    def at_data_end(self, rec: StepRecord) -> bool:
        """The data ran out fetching ``rec``'s batches (this step). The previous step's
        deferred decision is made now; True when it was a rollback, which then ran (as in
        the step, before this fetch) and training goes on; False: the run ends here."""
        return self.pending is not None and self._previous(rec)[0] is Outcome.DROPPED

    def settle(self, ok: bool) -> None:
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
        stats = self.trainer.ledger.recorder.host_stats(rec)
        d = rec.deferred
        rec.update_skipped = bool(stats and (d.forced or (stats[0] and d.holds) or (stats[_NOTE] and d.notes)))
        rec.decided, rec.deferred = True, None  # its rows are written (train's final drain)
        self._done(rec)

    # ------------------------------------------------------------------ the decision
    def _acts(self) -> bool:
        """Whether a flag can change what a step does (a proof or an acting ladder)."""
        ledger = self.trainer.ledger
        return ledger.guard is not None and (self.prover.mode != "off" or ledger.ladder.acts)

    def _forced(self, step: int) -> bool:
        if self._prove_at is None:
            self._prove_at = parse_skip_steps(self.trainer.config.ledger.rehearsal.prove_at,
                                              "--ledger.rehearsal.prove_at")
        return self.prover.mode != "off" and window_at(self._prove_at, step) is not None

    @property
    def deferrable(self) -> bool:
        """Whether decisions can be deferred in this run (``--ledger.on_spike.defer``): an
        acting flag, QK-clip off (its update follows the decision), fused Adam/AdamW
        optimizers (``found_inf``) and no step hook on the optimizers container (a held
        update would still run it); said once at the first step when it cannot."""
        if self._deferrable is None:
            t = self.trainer
            opts = list(getattr(t.optimizers, "optimizers", [t.optimizers]))
            fused = all(isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) and
                        all(g.get("fused") for g in o.param_groups) for o in opts)
            # a hook on the optimizers container (MoE load balancing's expert-bias update)
            # runs on every optimizers.step(), a held one included: not what a skipped step does
            hooked = bool(getattr(t.optimizers, "_optimizer_step_pre_hooks", None) or
                          getattr(t.optimizers, "_optimizer_step_post_hooks", None))
            self._deferrable = bool(t.config.ledger.on_spike.defer and self._acts() and fused
                                    and t.ledger.qk_clip is None and not hooked)
            if t.config.ledger.on_spike.defer and self._acts() and not self._deferrable and t.ledger.topo.is_rank0:
                from torchtitan.tools.logging import logger

                why = "QK-clip is on" if t.ledger.qk_clip is not None else \
                    "the optimizer is not a fused Adam/AdamW (--optimizer.implementation fused)" if not fused else \
                    "an optimizer step hook runs on every update (MoE load balancing)"
                logger.warning(f"titan_ledger: --ledger.on_spike.defer: {why}, so every step reads its spike "
                               f"flag on the host before its update (a device sync per step)")
        return self._deferrable

    def defers(self, step: int) -> bool:
        """Whether ``step`` defers its decision: not where what follows the step needs it
        made (a checkpoint or validation step, the last step, a step before a skip
        window). A logging step defers too: torchtitan logs its first execution, as the
        row does, and its row is written a step later."""
        if not self.deferrable:
            return False
        t = self.trainer
        ck = t.config.checkpoint
        return not (not t.should_continue_training()
                    or (ck.enable and (step % ck.interval == 0 or (step == 1 and ck.enable_first_step_checkpoint)))
                    or (t.config.validator.enable and t.validator.should_validate(step))
                    or t.ledger.skip_window_at(step + 1) is not None
                    or self.snapshots.due(step))

    def _decide(self, rec: StepRecord) -> Update:
        """This step's update: :attr:`Update.APPLY`/``WITHHOLD`` decided in the step, or
        :attr:`Update.HOLD` (deferred: the device withholds a flagged step's update
        through ``found_inf``)."""
        if not self._acts():
            self._done(rec)
            return Update.APPLY
        forced = self._forced(rec.step)
        if self.defers(rec.step):
            self._defer(rec, forced)
            return Update.HOLD
        try:
            applied = self._judge(rec, *self.trainer.ledger.flags_now(), forced)
        finally:
            self._done(rec)  # the step's batches are not kept past its decision
        return Update.APPLY if applied else Update.WITHHOLD

    def _defer(self, rec: StepRecord, forced: bool) -> None:
        t = self.trainer
        ledger = t.ledger
        mode = self.prover.mode
        # prove off: a flag the ladder answers with a `none` rung applies its update, so it
        # is not held (held, it would have to be recomputed a step later, from gradients gone)
        holds = mode != "off" or ledger.ladder.would_act(rec.step)
        notes = False
        if forced:
            hold = torch.ones((), dtype=torch.float32, device=t.device)
        else:
            notes = self.prover.notes_allowed(rec.step)
            hold = ledger.guard.hold(acting=holds, notes=notes)
        opts = list(t.optimizers.optimizers)
        for o in opts:
            o.found_inf = hold
        first = None
        if mode != "off":  # the gradients are freed every step anyway: kept, checksummed only if held
            first = KeptExecution(t) if self._keeps_grads() else FirstExecution.of(t)
        rec.deferred = Deferred(lrs=[[group_lr(g) for g in o.param_groups] for o in opts], first=first,
                                forced=forced, holds=holds, notes=notes)
        rec.decided = False  # its rows wait for the decision
        self.pending = rec
        self.deferred += 1

    def _keeps_grads(self) -> bool:
        """Whether a deferred step's first execution is kept as its gradient tensors
        (:class:`KeptExecution`): on the CPU, where every step's ``zero_grad`` sets them to
        None (a checksum pass costs CPU time there, a step's gradients little memory)."""
        t = self.trainer
        return t.device.type == "cpu" and bool(t.config.training.disable_cuda_graphs)

    def _previous(self, rec: StepRecord) -> tuple[Outcome, StepRecord | None]:
        """The previous step's deferred decision, made while ``rec`` (this step) was
        fetched or executed; on a rollback ``rec`` is dropped (:meth:`_drop`). Returns
        the outcome and the decided step's record (its proof)."""
        decided = self.pending
        outcome = self._resolve()
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
        t = self.trainer
        ledger = t.ledger
        d, rec.deferred = rec.deferred, None
        stats = ledger.recorder.host_stats(rec)
        if stats is None:
            raise RuntimeError(f"titan_ledger: step {rec.step}'s decision was deferred but its flag was not queued")
        acting, note = bool(stats[0]), bool(stats[_NOTE])
        rec.decided = True
        held = d.forced or (acting and d.holds) or (note and d.notes)
        if not held:  # the device applied the update
            if note and not acting and self.prover.mode == "all":
                rec.unproven = "budget"
            self._done(rec)
            if acting and not self._judge(rec, acting, note, False, decided_at=t.step):  # the ladder's `none` rung
                raise RuntimeError(f"titan_ledger: step {rec.step}'s flag was not held but its action withholds "
                                   f"the update")  # (Ladder.would_act answered for this very flag)
            return Outcome.STANDS
        now, t.step = t.step, rec.step  # the hooks and messages see the flagged step
        try:
            first = d.first.first(t) if isinstance(d.first, KeptExecution) else d.first
            applied = self._judge(rec, acting, note, d.forced, first=first, decided_at=now)
            if applied:
                self.prover.load_update(rec, rec.proof["applied"] if rec.proof is not None else "original")
                self._apply_late(rec, d.lrs)
        finally:
            t.step = now
            self._done(rec)
        self.snapshots.after_decision(rec, late=True)  # a late update the replay cannot repeat clears the ring
        # its rows now, as in the step: the ledger stops at a non-finite row before this
        # step is recorded (a non-finite loss always flags)
        ledger.drain(block=False, metrics_logger=t.metrics_processor.logger)
        if self.pending_rollback is not None:
            return Outcome.DROPPED
        return Outcome.REDONE if (applied or rec.proof is not None) else Outcome.STANDS

    def _done(self, rec: StepRecord) -> None:
        """``rec``'s decision is made: its batches (device tensors once executed) and the
        proof's hold on them are let go."""
        rec.batches = None
        self.prover.release()

    def _judge(self, rec: StepRecord, acting: bool, note: bool, forced: bool,
               first: FirstExecution | None = None, decided_at: int | None = None) -> bool:
        """Is this step's update applied? A flagged step is proven first
        (``--ledger.on_spike.prove``) and acted on by what the proof says; the ladder acts
        on an acting flag the proof left standing. In the step, or deferred (``first``:
        what was kept of the first execution)."""
        ledger = self.trainer.ledger
        wanted = self.prover.wanted(acting, note, rec.step)
        if note and not acting and self.prover.mode == "all" and not wanted:
            rec.unproven = "budget"  # past the note budget: recorded, not proven
        if wanted and not acting:
            ledger.note_budget.spend(rec.step)  # a note's proof
        if wanted or forced:
            proof = rec.proof = self.prover.prove(
                rec, acting=acting, event=ledger.step_event(), first=first)
            if decided_at is not None:
                proof["decided_at"] = decided_at  # deferred: proven behind the next step's launch
            if self.window.wanted(proof, forced):  # not the data: which cause, from the host snapshot's window
                proof["window"] = self.window.prove(rec)
            self._say(rec, proof)
            if proof["verdict"] != "not_data":  # resolved by the proof (its event says so), not by the ladder
                rec.update_skipped = proof["applied"] == "none"
                return proof["applied"] != "none"
        if not (ledger.ladder.acts and acting):
            return True
        rung, action = ledger.ladder.on_spike(rec.step)  # the recovery ladder decides
        if decided_at is not None:  # deferred: decided at that step, its update held until then
            action = {**action, "decided_at": decided_at}
        ledger.record_action(action)
        if rung is not None and rung.action == "none":
            return True
        rec.update_skipped = True
        if rung is None or rung.action == "stop":
            # the ladder is exhausted (or says stop): write what is pending, then stop
            # with a one-screen report (exit 1)
            ledger.drain(block=True, metrics_logger=self.trainer.metrics_processor.logger)
            raise LedgerStop(ladder_report(ledger, self.trainer.config, action))
        if rung.rolls_back:
            self.pending_rollback = rec.step
            if rung.lr is not None:
                self.lr_scale *= rung.lr  # kept across every later checkpoint load
        return False

    def _say(self, rec: StepRecord, proof: dict) -> None:
        from torchtitan.tools.logging import logger

        if self.trainer.ledger.topo.is_rank0:
            logger.warning(f"titan_ledger: step {rec.step}: {describe_proof(proof)}")

    # ------------------------------------------------------------------ actions
    def _drop(self, rec: StepRecord) -> None:
        """``rec`` (this step) is dropped: the previous step's deferred decision was a
        rollback, which in the step would have run before this step's fetch. What the
        fetch and execution left is taken back -- the per-step accumulators, the
        batches and fetch times in torchtitan's throughput metrics -- and the rollback
        and its skip window run now."""
        t = self.trainer
        t.ledger.discard_step_state()
        mp = t.metrics_processor
        mp.ntokens_since_last_log -= sum(rec.fetched)
        if rec.fetched:
            del mp.data_loading_times[-len(rec.fetched):]
        t.step_record = rec.batches = None
        self.before_step()

    def _apply_late(self, rec: StepRecord, lrs: list[list]) -> None:
        """The held update of ``rec``, applied a step late at its own learning rates (the
        schedule has moved on since)."""
        t = self.trainer
        opts = list(t.optimizers.optimizers)
        now = [[group_lr(g) for g in o.param_groups] for o in opts]
        for o, lr in zip(opts, lrs):
            for g, x in zip(o.param_groups, lr):
                set_group_lr(g, x)
        if t.ledger.recorder is not None and t.ledger.config.update_norm:
            t.ledger.recorder.snapshot_params()
        try:
            t.optimizers.step()
        finally:
            for o, lr in zip(opts, now):
                for g, x in zip(o.param_groups, lr):
                    set_group_lr(g, x)
        t.ledger.after_update(True, rec)

    def _redo(self, rec: StepRecord, proof: dict | None, need_loss: bool):
        """This step again, after the previous step's deferred decision changed the
        parameters or the gradients: its first execution is replaced
        (:class:`Reexecution` with ``replaces``: its accumulators drained, the rehearsal's
        one-time faults re-armed), documents the decision convicted are masked in its
        batches as the fetch would have, and ``execute`` runs once more."""
        t = self.trainer
        if proof is not None and proof["verdict"] == "bad_data":  # (``proof``: the decided step's)
            t.ledger.remask(rec, [tuple(x) for x in proof.get("documents", [])])
        self.redone += 1
        with Reexecution(t, rec, replaces=True) as again:
            return again.run(rec.batches, need_loss)

    def _skip_window(self, window: tuple[int, int]) -> None:
        """Consume the data of steps ``step..window end`` at once: no forward, backward
        or optimizer step; the LR schedule frozen or advanced per ``--ledger.skip.lr``.
        torchtitan's loop then continues from the last skipped step (its
        checkpoint/validation checks see that step)."""
        from torchtitan.tools.logging import logger

        t = self.trainer
        step_start = time.perf_counter()
        first = t.step
        last = min(window[1], t.config.training.steps)
        n = last - first + 1
        info = t.ledger.loader.skip(n * t.gradient_accumulation_steps * t.num_pipeline_parallel_microbatches)
        if t.config.ledger.skip.lr == "advance":
            for sched in t.lr_schedulers.schedulers:
                sched.last_epoch += n - 1  # O(1) for any window: one step() applies it
                sched.step()
        lr = next(iter(t.lr_schedulers.get_metrics().values()), float("nan"))
        t.ledger.record_skip(first=first, last=last, info=info, lr=lr, step_start=step_start,
                             metrics_logger=t.metrics_processor.logger)
        logger.info(f"titan_ledger: skipped steps {first}-{last}: samples "
                    f"[{info.position_before}, {info.position_after}) consumed without training, "
                    f"LR schedule {t.config.ledger.skip.lr}")
        t.step = last
        self.snapshots.clear()  # skipped steps are not replayed: the next due step starts the ring again

    def _rollback(self, spike_step: int) -> None:
        """Reload the last checkpoint at or before ``spike - rollback_back`` in this
        process and skip from there past the spike (PaLM's fix, no relaunch).

        What makes this safe on torchtitan 0.3.0: the checkpoint load is the same DCP
        in-place load a relaunch does (model, optimizer, LR schedulers, dataloader
        position, train state, ledger counters); the spiked step's update was not
        applied; the data iterator restarts at the restored position; the ledgers open a
        new segment that supersedes the rewound steps.
        """
        import torch.distributed as dist
        from torchtitan.tools.logging import logger

        from titan_ledger.format.reader import checkpoints

        t = self.trainer
        ledger, cfg = t.ledger, t.config.ledger.on_spike
        self.pending_rollback = None
        unlimited = len(ledger.ladder.rungs) == 1  # a single action; a ladder sets its own limits
        if unlimited and ledger.rewinds >= cfg.max_rollbacks:
            raise RuntimeError(f"titan_ledger: spike at step {spike_step} after {ledger.rewinds} "
                               f"rollbacks (--ledger.on_spike.max_rollbacks); stopping. See "
                               f"{ledger.folder / records.SPIKES_FILE}")
        t.checkpointer.maybe_wait_for_staging()
        # an async save in flight is finished first: which checkpoints exist must not depend
        # on when the decision was made (in the step, or a step late)
        t.checkpointer.maybe_wait_for_saving()
        # rows first: a deferred step's rows waited for this decision, and the load resets
        # the counters a row reads (skipped_samples)
        ledger.drain(block=True, metrics_logger=t.metrics_processor.logger)
        decision = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:  # one list, rank 0's, for every rank
            steps = [c for c in checkpoints(t.config.dump_folder, t.config.checkpoint.folder)
                     if c <= spike_step - cfg.rollback_back]
            decision = [steps[-1] if steps else None]
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0)
        load = decision[0]
        # a host snapshot at least as recent as that checkpoint is restored instead (seconds, no load)
        snap = self.snapshots.covering(spike_step - cfg.rollback_back, load)
        if snap is not None:
            load = snap.step
        if load is None:
            raise RuntimeError(f"titan_ledger: spike at step {spike_step}: no checkpoint at or before "
                               f"step {spike_step - cfg.rollback_back} to roll back to "
                               f"(--ledger.on_spike.rollback_back, --checkpoint.interval)")
        window = (load + 1, load + max(cfg.rollback_skip, spike_step - load))
        logger.warning(f"titan_ledger: rolling back from step {spike_step} to "
                       f"{'the host snapshot of step ' if snap else 'checkpoint step-'}{load}; "
                       f"skipping steps {window[0]}-{window[1]}")
        loaded = time.perf_counter()
        with ledger.keeping_ladder():
            if snap is not None:
                self.snapshots.restore_run(snap)  # sets t.step = load via the train state
            else:
                t.checkpointer.load(step=load)  # sets t.step = load via the train state
        logger.info(f"titan_ledger: step {load}'s state restored in {time.perf_counter() - loaded:.3f} s "
                    f"({'host memory' if snap is not None else 'checkpoint load'})")
        if self.lr_scale != 1.0:
            scale_lr(t.lr_schedulers, self.lr_scale)
        ledger.rewind(from_step=spike_step, to_step=load, window=window,
                      metrics_logger=t.metrics_processor.logger)
        t.step = load + 1
        self.snapshots.clear()  # the rewound steps are another timeline (and a skip window follows)
