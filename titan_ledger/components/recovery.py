"""``Recovery``: what a flagged step does -- the update guard, the recovery ladder's
actions (in-process rollback, skip windows, stop with a report).

Design decision: the trainer asks two questions and nothing else. Before a step,
:meth:`Recovery.before_step` runs what an earlier decision left pending (a rollback
reloads a checkpoint in this process; a skip window consumes its steps' data without
training). Between the clip and ``optimizers.step()``, :meth:`Recovery.decide` says
whether this step's update is applied. Everything those answers need -- the ladder,
the checkpoint list, the LR factor that a ``rollback_lr`` rung leaves for every later
load -- lives here, so the copied ``train_step`` in ``trainer.py`` carries two calls,
not the policy.

Not calling ``optimizers.step()`` on a rejected step leaves parameters, moments and
Adam's step count as they were (OLMo-core PR 309/317: the count must not advance).
"""

from __future__ import annotations

import time

from titan_ledger.components.optimizer import scale_lr
from titan_ledger.components.proof import Prover
from titan_ledger.components.step_record import StepRecord
from titan_ledger.data.layout import parse_skip_steps, window_at
from titan_ledger.errors import LedgerStop, python_command
from titan_ledger.format import records
from titan_ledger.format.proofs import describe_proof


class Recovery:
    """The recovery side of one ``LedgerTrainer``: built with it, asked once per step."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.prover = Prover(trainer)
        self._prove_at: list | None = None  # (the trainer's config exists after torchtitan's __init__)
        self.pending_rollback: int | None = None  # the spiked step a rollback starts from
        self.lr_scale = 1.0  # the recovery ladder's rollback_lr factors, multiplied

    # ------------------------------------------------------------------ before a step
    def before_step(self) -> bool:
        """Run what is pending; True when this call consumed the step (a skip window)."""
        t = self.trainer
        if self.pending_rollback is not None:  # in-process rollback (on_spike)
            self._rollback(self.pending_rollback)
        window = t.ledger.skip_window_at(t.step)  # skipped steps train nothing
        if window is None:
            return False
        self._skip_window(window)
        return True

    # ------------------------------------------------------------------ the decision
    def decide(self, rec: StepRecord) -> bool:
        try:
            return self._decide(rec)
        finally:
            rec.batches = None  # the step's batches are not kept past its decision

    def _decide(self, rec: StepRecord) -> bool:
        """Between the clip and ``optimizers.step()``: is this step's update applied?
        A flagged step is proven first (``--ledger.on_spike.prove``) and acted on by what
        the proof says; the ladder acts on an acting flag the proof left standing. The
        flag costs one host read per step, made only when a proof or an action may follow."""
        ledger = self.trainer.ledger
        if ledger.guard is None or not (self.prover.mode != "off" or ledger.ladder.acts):
            return True
        acting, note = ledger.flags_now()
        if self._prove_at is None:
            self._prove_at = parse_skip_steps(self.trainer.config.ledger.rehearsal.prove_at,
                                              "--ledger.rehearsal.prove_at")
        forced = window_at(self._prove_at, rec.step) is not None  # --ledger.rehearsal.prove_at
        if self.prover.wanted(acting, note) or (forced and self.prover.mode != "off"):
            proof = rec.proof = self.prover.prove(rec, acting=acting, event=ledger.step_event())
            self._say(rec, proof)
            if proof["verdict"] != "not_data":  # resolved by the proof (its event says so), not by the ladder
                rec.update_skipped = proof["applied"] == "none"
                return proof["applied"] != "none"
        if not (ledger.ladder.acts and acting):
            return True
        rung, action = ledger.ladder.on_spike(rec.step)  # the recovery ladder decides
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

        from titan_ledger.components.dashboards import log_rewind
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
        decision = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:  # one list, rank 0's, for every rank
            steps = [c for c in checkpoints(t.config.dump_folder, t.config.checkpoint.folder)
                     if c <= spike_step - cfg.rollback_back]
            decision = [steps[-1] if steps else None]
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0)
        load = decision[0]
        if load is None:
            raise RuntimeError(f"titan_ledger: spike at step {spike_step}: no checkpoint at or before "
                               f"step {spike_step - cfg.rollback_back} to roll back to "
                               f"(--ledger.on_spike.rollback_back, --checkpoint.interval)")
        window = (load + 1, load + max(cfg.rollback_skip, spike_step - load))
        logger.warning(f"titan_ledger: rolling back from step {spike_step} to checkpoint step-{load}; "
                       f"skipping steps {window[0]}-{window[1]}")
        with ledger.keeping_ladder():
            t.checkpointer.load(step=load)  # sets t.step = load via the train state
        if self.lr_scale != 1.0:
            scale_lr(t.lr_schedulers, self.lr_scale)
        ledger.rewind(from_step=spike_step, to_step=load, window=window,
                      metrics_logger=t.metrics_processor.logger)
        log_rewind(t.metrics_processor.logger, from_step=spike_step, to_step=load, window=window)
        t.step = load + 1


def ladder_report(ledger, config, action: dict) -> str:
    """One screen: what happened, what was tried, where the evidence is, what to run."""
    folder = ledger.folder
    dump = config.dump_folder
    step = action["step"]
    py = python_command()  # the interpreter that trained: the commands run as printed
    tried = "; ".join(f"step {h['step']}: {h['action']}" + (f" ({h['attempt']})" if "attempt" in h else "")
                      for h in ledger.ladder.history) or "nothing"
    on_spike = config.ledger.on_spike
    return "\n".join([
        f"the recovery ladder stopped training at step {step} "
        f"(--ledger.on_spike.action {on_spike.action}, horizon {on_spike.ladder_horizon} steps)",
        f"  what happened: spikes kept coming back within the horizon; last at step {step}",
        f"  what was tried: {tried}",
        f"  evidence: {folder / records.SPIKES_FILE} (every flag and decision), {folder / records.SIGNALS_FILE}, "
        f"{folder}/{records.DATA_GLOB} (documents and their losses), checkpoints in {dump}/{config.checkpoint.folder}",
        f"  next: {py} -m titan_ledger.diagnose {dump} --step {step}",
        f"        {py} -m titan_ledger.report {dump} --step {step} -o incident.html",
        f"        {py} -m titan_ledger.replay rerun --dump-folder {dump} --step {step}  (reuses this run's launch)",
    ])
