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
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # (annotations only: torchtitan is imported after the device backend is installed)
    import torch
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.validate import BaseValidator

    from titan_ledger.components.signals.step_record import StepRecord


@runtime_checkable
class Host(Protocol):
    """The trainer as the response layer sees it (``LedgerTrainer`` implements it)."""

    # torchtitan's components, read and driven as torchtitan's loop drives them
    config: Any  # LedgerTrainer.Config (the trainer layer, above this one)
    device: torch.device
    model_parts: list[torch.nn.Module]
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: BaseDataLoader
    checkpointer: CheckpointManager
    metrics_processor: MetricsProcessor
    validator: BaseValidator | None
    gradient_accumulation_steps: int
    num_pipeline_parallel_microbatches: int
    ntokens_seen: int  # (Reexecution puts an extra execution's count back)
    # ours: the Ledger, asked through its methods (``watches``, ``detector``, ``hold``,
    # ``host_stats``, ``record_action``, ``drain``, ...) and its public facts (``topo``,
    # ``loader``, ``folder``), never its parts (``recorder``, ``guard``: test_seam.py)
    ledger: Any

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

    def should_continue_training(self) -> bool: ...

    def attend(self, rec: StepRecord | None) -> StepRecord | None:
        """The hooks fill ``rec`` from now (None: no step's); returns the record before."""
        ...

    def as_step(self, step: int) -> AbstractContextManager[None]:
        """Within the block the hooks and messages see ``step``; then the step before."""
        ...

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is saved after ``step`` (torchtitan's rule, the trainer's one copy)."""
        ...

    def move_to(self, step: int) -> None:
        """This ``train_step`` call is ``step`` (a skip window consumed up to it, a rollback
        restarted from before it); the loop trains ``step + 1`` next."""
        ...

