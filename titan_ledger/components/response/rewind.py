"""Moving the run's position: the in-process rollback and the skip window.

Design decision: what a rollback needs -- the checkpoint list, the host snapshot that
covers its target, the rewind's limit, the LR factor ``rollback_lr`` rungs leave for every
later load -- is this class's, apart from ``Recovery``'s protocol and deferral; ``Recovery``
decides *that* the run rewinds (the ladder) and asks :meth:`Rewind.rollback` or
:meth:`Rewind.skip_window` at the step's start (``before_step``), each from one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from titan_ledger.components.prevention.optimizer import scale_lr
from titan_ledger.components.response.config import RollbackConfig
from titan_ledger.components.response.host import Host, LedgerPort, RunFacts
from titan_ledger.components.response.snapshots import SnapshotRing
from titan_ledger.format import records


class Rewind:
    """The rollback and the skip window of one ``LedgerTrainer`` (``Recovery`` owns one)."""

    def __init__(self, host: Host, ledger: LedgerPort, facts: RunFacts, config: RollbackConfig,
                 ring: SnapshotRing) -> None:
        """``config``: the run's ``[ledger.rollback]``; ``ring``: the host snapshots a
        rollback restores instead of a checkpoint."""
        self.host, self.ledger, self.facts, self.config, self.ring = host, ledger, facts, config, ring
        self.pending: int | None = None  # the spiked step a rollback starts from (at the next step's start)
        self.lr_scale = 1.0  # the recovery ladder's rollback_lr factors, multiplied

    def skip_window(self, window: tuple[int, int]) -> None:
        """Consume the data of steps ``step..window end`` at once: no forward, backward
        or optimizer step; the LR schedule frozen or advanced per ``--ledger.skip.lr``.
        torchtitan's loop then continues from the last skipped step (its
        checkpoint/validation checks see that step)."""
        from torchtitan.tools.logging import logger

        t = self.host
        step_start = time.perf_counter()
        first = t.step
        last = min(window[1], self.facts.steps)
        n = last - first + 1
        info = self.facts.loader.skip(n * self.facts.microbatches)
        if self.facts.skip_lr == "advance":
            for sched in self.facts.parts.lr_schedulers.schedulers:
                sched.last_epoch += n - 1  # O(1) for any window: one step() applies it
                sched.step()
        lr = next(iter(self.facts.parts.lr_schedulers.get_metrics().values()), float("nan"))
        self.ledger.record_skip(first=first, last=last, info=info, lr=lr, step_start=step_start,
                             metrics_logger=self.facts.parts.metrics_logger)
        logger.info(f"titan_ledger: skipped steps {first}-{last}: samples "
                    f"[{info.position_before}, {info.position_after}) consumed without training, "
                    f"LR schedule {self.facts.skip_lr}")
        t.move_to(last)
        self.ring.clear()  # skipped steps are not replayed: the next due step starts the ring again

    def rollback(self, spike_step: int, *, unlimited: bool, keeping_history: Callable[[], Any],
                 restore_failed: Callable[[int, str, BaseException], None]) -> None:
        """Reload the last checkpoint at or before ``spike - [ledger.rollback] back`` in this
        process and skip from there past the spike (PaLM's fix, no relaunch).

        What makes this safe on torchtitan 0.3.0: the checkpoint load is the same DCP
        in-place load a relaunch does (model, optimizer, LR schedulers, dataloader
        position, train state, ledger counters); the spiked step's update was not
        applied; the data iterator restarts at the restored position; the ledgers open a
        new segment that supersedes the rewound steps.

        ``unlimited``: a single action repeats (``[ledger.rollback] limit`` caps the rewinds;
        a ladder sets its own); ``keeping_history``: the context in which the checkpoint load
        keeps the ladder's and breaker's own history; ``restore_failed``: records a host
        snapshot that could not be restored (the checkpoint is loaded instead).
        """
        import torch.distributed as dist
        from torchtitan.tools.logging import logger

        from titan_ledger.format.reader import checkpoints

        t = self.host
        ledger, cfg = self.ledger, self.config
        self.pending = None
        rewinds = ledger.history().rewinds
        if unlimited and rewinds >= cfg.limit:
            raise RuntimeError(f"titan_ledger: spike at step {spike_step} after {rewinds} "
                               f"rollbacks (--ledger.rollback.limit); stopping. See "
                               f"{self.facts.folder / records.SPIKES_FILE}")
        self.facts.parts.checkpointer.maybe_wait_for_staging()
        # an async save in flight is finished first: which checkpoints exist must not depend
        # on when the decision was made (in the step, or a step late)
        self.facts.parts.checkpointer.maybe_wait_for_saving()
        # rows first: a deferred step's rows waited for this decision, and the load resets
        # the counters a row reads (skipped_samples)
        ledger.drain(block=True, metrics_logger=self.facts.parts.metrics_logger)
        decision = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:  # one list, rank 0's, for every rank
            steps = [c for c in checkpoints(self.facts.dump_folder, self.facts.checkpoint_folder)
                     if c <= spike_step - cfg.back]
            decision = [steps[-1] if steps else None]
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0)
        checkpoint = decision[0]
        # a host snapshot at least as recent as that checkpoint is restored instead (seconds, no load)
        snap = self.ring.covering(spike_step - cfg.back, checkpoint)
        load = snap.step if snap is not None else checkpoint
        if load is None:
            raise RuntimeError(f"titan_ledger: spike at step {spike_step}: no checkpoint at or before "
                               f"step {spike_step - cfg.back} to roll back to "
                               f"(--ledger.rollback.back, --checkpoint.interval)")
        loaded = time.perf_counter()
        with keeping_history():
            if snap is not None:
                try:
                    self.ring.restore_run(snap)  # sets t.step = load via the train state
                except Exception as e:  # the checkpoint load overwrites whatever the restore left
                    restore_failed(spike_step, "restore", e)
                    if checkpoint is None:
                        raise RuntimeError(f"titan_ledger: spike at step {spike_step}: the host snapshot of step "
                                           f"{snap.step} could not be restored and no checkpoint at or before step "
                                           f"{spike_step - cfg.back} exists to roll back to") from e
                    snap, load = None, checkpoint
            if snap is None:
                self.facts.parts.checkpointer.load(step=load)  # sets t.step = load via the train state
        window = (load + 1, load + max(cfg.skip, spike_step - load))
        logger.warning(f"titan_ledger: rolling back from step {spike_step} to "
                       f"{'the host snapshot of step ' if snap else 'checkpoint step-'}{load}; "
                       f"skipping steps {window[0]}-{window[1]}")
        logger.info(f"titan_ledger: step {load}'s state restored in {time.perf_counter() - loaded:.3f} s "
                    f"({'host memory' if snap is not None else 'checkpoint load'})")
        if self.lr_scale != 1.0:
            scale_lr(self.facts.parts.lr_schedulers, self.lr_scale)
        ledger.rewind(from_step=spike_step, to_step=load, window=window,
                      metrics_logger=self.facts.parts.metrics_logger)
        t.move_to(load + 1)
        self.ring.clear()  # the rewound steps are another timeline (and a skip window follows)
