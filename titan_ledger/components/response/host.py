"""``Host``: what the response layer uses of the trainer that runs it, as a typed protocol.

Design decision: ``Recovery``, ``Prover``, ``Reexecution``, the snapshot ring and the
window proof act on a running ``LedgerTrainer``, but they are given this surface, not
the class: torchtitan's own components (read and driven as torchtitan drives them),
``execute`` (the copied step body, called only through ``Reexecution``), and three
named changes of the loop's position. Only ``trainer.py`` writes ``step`` and
``step_record`` (``tests/unit/test_seam.py`` checks every module's assignments): the
response asks for

* :meth:`Host.attend` -- the record the hooks fill (a re-execution's step, none after a
  step was consumed whole or dropped),
* :meth:`Host.as_step` -- the step the hooks and messages see while a decision made a step
  late runs (the flagged step's, then the current one's again),
* :meth:`Host.move_to` -- the step this ``train_step`` call is, where a skip window or a
  rollback moved it (torchtitan's loop adds one per call).

A test double (``tests/unit/components/response/test_recovery.py``) implements the same
protocol with the trainer's own three methods and runs the trainer's own ``train_step``
(the wrapper and the copied step, bound to it), so the state machine is exercised on
the surface the trainer offers and through the calls it makes, not a copy of them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from titan_ledger.components.detection.spikes import SpikeDetector
from titan_ledger.components.detection.stall import StallConfig

if TYPE_CHECKING:  # (annotations only: torchtitan is imported after the device backend is installed)
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

    from titan_ledger.components.signals.step_record import StepRecord
    from titan_ledger.components.signals.topology import Topology
    from titan_ledger.data.loader import LedgerDataLoader


@runtime_checkable
class Host(Protocol):
    """The trainer as the response layer sees it (``LedgerTrainer`` implements it): the
    torchtitan components a step is made of, the loop's position, and the step body."""

    # torchtitan's components, read and driven as torchtitan's loop drives them
    model_parts: list[torch.nn.Module]
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: BaseDataLoader
    checkpointer: CheckpointManager
    metrics_processor: MetricsProcessor
    ntokens_seen: int  # (Reexecution puts an extra execution's count back)

    @property
    def step(self) -> int:
        """The step being trained (read-only here: :meth:`move_to`, :meth:`as_step`)."""
        ...

    @property
    def step_record(self) -> StepRecord | None:
        """The record the hooks fill (read-only here: :meth:`attend`)."""
        ...

    def execute(self, microbatch_groups: list, need_loss: bool, tokens: Any = None) -> tuple:
        """The copied step body: forward/backward and clip (through ``Reexecution`` only)."""
        ...

    def attend(self, rec: StepRecord | None) -> StepRecord | None:
        """The hooks fill ``rec`` from now (None: no step's); returns the record before."""
        ...

    def as_step(self, step: int) -> AbstractContextManager[None]:
        """Within the block the hooks and messages see ``step``; then the step before."""
        ...

    def move_to(self, step: int) -> None:
        """This ``train_step`` call is ``step`` (a skip window consumed up to it, a rollback
        restarted from before it); the loop trains ``step + 1`` next."""
        ...

    def decision_due(self, step: int) -> bool:
        """Whether what follows ``step`` needs its decision made in the step: the last step
        (``should_continue_training``), a checkpoint saved after it (torchtitan's
        ``_should_save``, the trainer's one copy of the rule), a validation after it."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The train state torchtitan checkpoints (a host snapshot copies it)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class LedgerPort(Protocol):
    """The ledger as the response layer sees it (``Ledger`` implements it): what it reads
    -- the run's facts, the step's flags and stats, the history the rows left -- and what it
    writes -- an action, an event, a quarantine, the rows of a step consumed or moved."""

    # facts (set when the ledger is set up)
    topo: Topology
    folder: Path
    global_batch: int
    loader: LedgerDataLoader | None  # the sample-id loader (skip, corpus reads), when the run uses one
    last_execution: tuple | None  # (local loss sum, local tokens, grad norm) as the last record saw them

    @property
    def watches(self) -> bool: ...

    @property
    def clips_qk(self) -> bool: ...

    # reads: the flags and the step just recorded
    @property
    def detector(self) -> SpikeDetector: ...

    def flags_now(self) -> tuple[bool, bool]: ...

    def hold(self, *, acting: bool, notes: bool) -> torch.Tensor: ...

    def host_stats(self, rec: StepRecord) -> list | None: ...

    def step_event(self) -> dict[str, Any]: ...

    def last_dp_loss(self) -> list[float]: ...

    def step_documents(self) -> dict | None: ...

    # reads: history
    recent: Any  # the last rows written (a deque of dicts)
    flagged_at: set[int]
    stalls: list[dict]
    rewinds: int
    content: Any

    def flagged_steps(self) -> set[int]: ...

    def stall_onset(self) -> int | None: ...

    def adam_ratio(self) -> float | None: ...

    def owned_params(self) -> list | None: ...

    def skip_window_at(self, step: int) -> tuple[int, int] | None: ...

    # writes
    def record_action(self, rec: dict) -> None: ...

    def record_event(self, ev: dict) -> None: ...

    def alert(self, title: str, text: str, metrics_logger: Any = None) -> None: ...

    def quarantine_proven(self, docs: list, step: int) -> None: ...

    def remask(self, rec: StepRecord, docs: list) -> None: ...

    def trained_as(self, rec: StepRecord, execution: dict) -> None: ...

    def record_skip(self, *, first: int, last: int, info: Any, lr: float, step_start: float,
                    metrics_logger: Any = None) -> None: ...

    def record_masked_step(self, rec: StepRecord, *, lr: float, metrics_logger: Any = None) -> None: ...

    def rewind(self, *, from_step: int, to_step: int, window: tuple[int, int], metrics_logger: Any = None) -> None: ...

    def drain(self, block: bool, metrics_logger: Any = None) -> None: ...

    def discard_step_state(self) -> None: ...

    def before_late_update(self) -> None: ...

    def after_update(self, applied: bool, rec: StepRecord | None = None) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What the response reads of the run beyond its own sections: torchtitan's settings,
    the ledger's other sections, the trainer's layout -- read once by the trainer when it
    builds the response (``Recovery.Config.build(..., facts=RunFacts(...))``), never later
    through it. A unit test names the few it exercises; the rest keep these defaults."""

    device: torch.device
    dump_folder: str = "."
    checkpoint_folder: str = "checkpoint"  # --checkpoint.folder (under dump_folder)
    exclude_from_loading: tuple[str, ...] = ()  # --checkpoint.exclude_from_loading (a host snapshot's restore)
    steps: int = 10**9  # --training.steps (a skip window ends at the last step)
    seq_len: int = 0  # --training.seq_len (a conviction's documents)
    local_batch_size: int = 1  # --training.local_batch_size (a row's first sample id)
    max_norm: float = 1.0  # --training.max_norm (the proof's clip, as the step's)
    microbatches: int = 1  # batches fetched per step: gradient accumulation x PP microbatches (a skip window)
    grads_freed: bool = False  # zero_grad sets gradients to None every step (the CPU's disable_cuda_graphs)
    skip_lr: str = "freeze"  # --ledger.skip.lr (a step consumed untrained)
    stall: StallConfig = field(default_factory=StallConfig)  # [ledger.stall] (the stall anchor, the stall proof)
    spike: SpikeDetector.Config = field(default_factory=SpikeDetector.Config)  # [ledger.spike] (loss_jump, doc_outlier_floor)
    prove_at: list = field(default_factory=list)  # --ledger.rehearsal.prove_at, parsed (forced proofs)
    faults: dict[str, str] = field(default_factory=dict)  # --ledger.rehearsal.response_fault, parsed

    @classmethod
    def of(cls, config: Any, *, device: torch.device, microbatches: int) -> RunFacts:
        """The facts of a ``LedgerTrainer.Config`` (its torchtitan sections and the ledger's
        other sections), read once when the trainer builds the response; the rehearsal
        flags parsed here, so a bad one fails the launch, not the step it names."""
        from titan_ledger.data.layout import parse_skip_steps
        from titan_ledger.rehearsal.faults import parse_response_faults

        table, training = config.ledger, config.training
        return cls(
            device=device, dump_folder=config.dump_folder, checkpoint_folder=config.checkpoint.folder,
            exclude_from_loading=tuple(config.checkpoint.exclude_from_loading or ()), steps=training.steps,
            seq_len=training.seq_len, local_batch_size=training.local_batch_size, max_norm=training.max_norm,
            microbatches=microbatches, grads_freed=device.type == "cpu" and bool(training.disable_cuda_graphs),
            skip_lr=table.skip.lr, stall=table.stall, spike=table.spike,
            prove_at=parse_skip_steps(table.rehearsal.prove_at, "--table.rehearsal.prove_at"),
            faults=parse_response_faults(table.rehearsal.response_fault))
