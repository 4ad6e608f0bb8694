"""Test doubles of the response's two ports (``components/response/host.py``).

Design decision: a unit test of the response gives it what the trainer gives it -- a
``Host`` and a ``LedgerPort`` -- and nothing grafted. :class:`HostDouble` *is* a
``LedgerTrainer`` built without torchtitan's ``__init__``: the protocol's methods
(``attend``, ``as_step``, ``move_to``, ``decision_due``, the trainer's own ``train_step``
where a test runs it) are the trainer's, inherited, and torchtitan's components are the
test's fakes. :class:`LedgerDouble` implements every member the ``LedgerPort`` protocol
declares, over plain state a test sets and reads back (the actions, events, quarantines
and rows the response wrote). Both are checked against their protocol when built.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from torchtitan.components.checkpoint import CheckpointManager

from titan_ledger.components.response.host import History, Host, LedgerPort, Recorded
from titan_ledger.components.signals.topology import Topology
from titan_ledger.trainer import LedgerTrainer


class HostDouble(LedgerTrainer):
    """A ``LedgerTrainer`` whose torchtitan components the test fakes (``attrs``, or set by
    a subclass's ``__init__`` before :meth:`ready`)."""

    def __init__(self, **attrs) -> None:  # torchtitan's __init__ not run: the components are the test's
        self.step, self.step_record, self.ntokens_seen, self._overrides = 0, None, 0, {}
        for k, v in attrs.items():
            setattr(self, k, v)
        if attrs:
            self.ready()

    def ready(self) -> HostDouble:
        """The double is complete: torchtitan's own save rule over its checkpoint settings
        (``CheckpointManager._should_save``, where it fakes no checkpointer), then checked
        against ``Host``."""
        ck = getattr(getattr(self, "config", None), "checkpoint", None)
        if ck is not None and hasattr(ck, "interval") and not hasattr(self, "checkpointer"):
            self.checkpointer = CheckpointerDouble(enable=ck.enable, interval=ck.interval,
                                                   enable_first_step_checkpoint=ck.enable_first_step_checkpoint)
        training = getattr(getattr(self, "config", None), "training", None)
        if training is not None and not hasattr(training, "steps"):
            training.steps = 10**9  # (the double's last step: should_continue_training says)
        for name in ("optimizers", "lr_schedulers", "dataloader", "checkpointer", "metrics_processor", "loss_fn"):
            if not hasattr(self, name):
                setattr(self, name, None)  # (a part the test's response never touches)
        if not hasattr(self, "model_parts"):
            self.model_parts = []
        assert isinstance(self, Host)
        return self


class CheckpointerDouble(CheckpointManager):
    """torchtitan's ``CheckpointManager`` without its ``__init__`` (no folder, no process
    group): its own save rule (``_should_save``), inherited, over the test's settings;
    ``load`` and the waits are the test's (``attrs``)."""

    def __init__(self, *, enable: bool, interval: int, enable_first_step_checkpoint: bool = False,
                 load_only: bool = False, **attrs) -> None:
        self.enable, self.interval, self.load_only = enable, interval, load_only
        self.stager = None  # (torchtitan's close, run when the double is collected, reads it)
        self.enable_first_step_checkpoint = enable_first_step_checkpoint
        for k, v in attrs.items():
            setattr(self, k, v)


class LedgerDouble:
    """The ledger's side of the response: flags and the step's execution a test sets, what
    the response writes kept in lists (``actions``, ``events``, ``alerts``, ``quarantined``,
    ``remasked``, ``trained``, ``skips``, ``masked_steps``, ``rewound``). ``topo``,
    ``folder``, ``global_batch``, ``clips_qk``, ``loader`` and ``owned_params`` are the facts the
    trainer reads of its ledger when it builds the response (``helpers.run_facts`` reads
    them here, so a test sets them before it builds)."""

    def __init__(self, *, topo: Topology | None = None, folder: Path | None = None, global_batch: int = 1,
                 loader=None, guard=None, detector=None, clips_qk: bool = False, **state) -> None:
        self.topo = topo or Topology.single()
        self.folder = folder or Path("ledger")
        self.global_batch = global_batch
        self.loader = loader
        self.last_execution = None
        self.clips_qk = clips_qk
        self.guard = guard  # a SpikeGuard (its hold and stats), where the test runs the rules
        self._detector = detector if detector is not None else getattr(guard, "detector", None)
        # history
        self.recent: deque[dict] = deque(maxlen=64)
        self.flagged_at: set[int] = set()
        self.flagged: set[int] = set()
        self.stalls: list[dict] = []
        self.rewinds = 0
        self.content = None
        self.onset: int | None = None
        self.adam_level = None  # an AdamLevel (signals/adam_level.py) where the test measures one
        self.owned_params: list | None = None
        self.windows: list[tuple[int, int]] = []
        # the step just recorded
        self.stats: dict[int, list[float]] = {}
        self.event: dict = {"rules": ["ratio"]}
        self.dp_loss: list[float] = [2.0]
        self.documents: dict | None = None
        # what the response wrote
        self.actions: list[dict] = []
        self.events: list[dict] = []
        self.alerts: list[str] = []
        self.quarantined: list[tuple[list, int]] = []
        self.remasked: list[tuple[int, list]] = []
        self.trained: list[tuple[int, dict]] = []
        self.skips: list[dict] = []
        self.masked_steps: list[int] = []
        self.rewound: list[dict] = []
        self.discards = self.updates = 0
        for k, v in state.items():
            setattr(self, k, v)
        assert isinstance(self, LedgerPort)

    # reads: the flags and the step just recorded
    @property
    def detector(self):
        return self._detector

    @detector.setter
    def detector(self, value) -> None:
        self._detector = value

    def flags(self, rec=None) -> tuple[bool, bool] | None:
        from titan_ledger.components.detection.spikes import STAT_KEYS

        note = STAT_KEYS.index("note")
        if rec is not None:  # a deferred step's, from what the test queued
            stats = self.stats.get(rec.step)
            return None if stats is None else (bool(stats[0]), bool(stats[note]))
        stats = getattr(self.guard, "last_stats", None)
        return (False, False) if stats is None else (bool(stats[0]), bool(stats[note]))

    def hold(self, *, acting: bool, notes: bool) -> torch.Tensor:
        return self.guard.hold(acting=acting, notes=notes)

    def recorded(self) -> Recorded:
        return Recorded(self.last_execution, lambda: (dict(self.event), list(self.dp_loss), self.documents))

    # reads: history
    def history(self) -> History:
        return History(recent=self.recent, flagged_at=self.flagged_at, flagged=self.flagged, stalls=self.stalls,
                       rewinds=self.rewinds, content=self.content, stall_onset=self.onset,
                       skip_windows=sorted(self.windows), adam=self.adam_level,
                       broken_since=getattr(self, "broken_since", None))

    # writes
    def record_event(self, ev: dict, alert: tuple[str, str] | None = None, metrics_logger=None) -> None:
        if ev.get("ladder"):  # a ladder's action
            self.actions.append({k: v for k, v in ev.items() if k not in ("decided_at", "ladder")})
        else:
            self.events.append(ev)
        if alert is not None:
            self.alerts.append(alert[1])

    def quarantine_proven(self, docs: list, step: int) -> None:
        self.quarantined.append((docs, step))

    def remask(self, rec, docs: list) -> None:
        self.remasked.append((rec.step, docs))

    def trained_as(self, rec, execution: dict) -> None:
        self.trained.append((rec.step, execution))

    def record_skip(self, *, first: int, last: int, info, lr: float, step_start: float, rec=None,
                    metrics_logger=None) -> None:
        if rec is not None:  # a step whose masks left no token
            self.masked_steps.append(rec.step)
        else:
            self.skips.append({"first": first, "last": last, "lr": lr})

    def rewind(self, *, from_step: int, to_step: int, window: tuple[int, int], metrics_logger=None) -> None:
        self.rewinds += 1
        self.windows.append(window)
        self.rewound.append({"from": from_step, "to": to_step, "window": window})

    def drain(self, block: bool, metrics_logger=None) -> None:
        pass

    def discard_step_state(self) -> None:
        self.discards += 1

    def update(self, step, rec=None) -> None:
        if step is not None:
            step()
        self.updates += 1
