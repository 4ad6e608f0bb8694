"""What the response is given: two narrow ports and the run's facts, all typed.

Design decision: ``Recovery`` and its parts (``Prover``, ``Reexecution``, the snapshot ring,
the window proof, ``Rewind``) act on a running ``LedgerTrainer`` and its ``Ledger``, but they
are given these surfaces, not the classes, and are built after both exist
(``Recovery.Config.build(host=..., ledger=..., facts=...)``): nothing here reads a setting
later through either.

* :class:`Host` (10 members) -- the trainer's loop: its position (``step``,
  ``step_record``, ``ntokens_seen``), ``execute`` (the copied step body, called only
  through ``Reexecution``), ``decision_due`` (torchtitan's save rule, one copy, with the last
  step and validation), the train state a host snapshot copies, and three named changes of
  the loop's position. Only ``trainer.py`` writes ``step`` and ``step_record``
  (``tests/unit/test_seam.py`` checks every module's assignments): :meth:`Host.attend` (the
  record the hooks fill), :meth:`Host.as_step` (the step a late decision's hooks and
  messages see), :meth:`Host.move_to` (where a skip window or a rollback moved the loop).
* :class:`LedgerPort` (14) -- the ledger: what the response reads (the step's flags, the
  step just recorded as :class:`Recorded`, the rows so far as one :class:`History`) and what
  it writes (an event -- a ladder's action is one --, a quarantine, the rows of a step
  consumed or moved, the drain), and the update as the ledger measures it.
* :class:`Parts` -- torchtitan's components (model, optimizers, schedulers, dataloader,
  checkpointer, metrics, loss), references its ``__init__`` built: dependencies passed once,
  as torchtitan passes them to its ``CheckpointManager``, not members of a port.
* :class:`RunFacts` -- the parts, torchtitan's settings, the ledger's other sections and the
  ledger's own facts once set up (its topology, folder, global batch, loader), read once at
  build.

No member of either port is ``Any`` and the response uses no member they do not declare
(test_seam.py). The unit doubles (``tests/doubles.py``) implement the ports: ``HostDouble``
is a ``LedgerTrainer`` built without torchtitan's ``__init__``, its protocol methods and
step inherited, and ``LedgerDouble`` declares every ``LedgerPort`` member.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from titan_ledger.components.detection.spikes import SpikeDetector
from titan_ledger.components.detection.stall import StallConfig
from titan_ledger.components.signals.topology import Topology

if TYPE_CHECKING:  # (annotations only: torchtitan is imported after the device backend is installed)
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.metrics import BaseLogger, MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

    from titan_ledger.components.signals.adam_level import AdamLevel
    from titan_ledger.components.signals.step_record import StepRecord
    from titan_ledger.data.content import ContentMemory
    from titan_ledger.data.loader import LedgerDataLoader, SkipInfo


@runtime_checkable
class Host(Protocol):
    """The trainer as the response layer sees it (``LedgerTrainer`` implements it): the
    loop's position, the step body, and the train state torchtitan checkpoints. The
    components a step is made of are :class:`Parts`, passed once at build."""

    ntokens_seen: int  # (Reexecution puts an extra execution's count back)

    @property
    def step(self) -> int:
        """The step being trained (read-only here: :meth:`move_to`, :meth:`as_step`)."""
        ...

    @property
    def step_record(self) -> StepRecord | None:
        """The record the hooks fill (read-only here: :meth:`attend`)."""
        ...

    def execute(self, microbatch_groups: list, need_loss: bool,
                tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
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


@dataclass(frozen=True, kw_only=True)
class Parts:
    """torchtitan's components as its ``__init__`` built them, passed to the response once at
    build (as torchtitan passes them to its ``CheckpointManager``): references that do not
    change after it, read and driven as torchtitan's loop drives them."""

    model_parts: list[torch.nn.Module]
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: BaseDataLoader
    checkpointer: CheckpointManager
    metrics_processor: MetricsProcessor
    loss_fn: Callable[..., torch.Tensor]  # (the window proof's z-loss variant finds the ledger's loss in it)

    @classmethod
    def of(cls, trainer: Any) -> Parts:
        """The components of a built ``Trainer``."""
        return cls(**{f: getattr(trainer, f) for f in cls.__dataclass_fields__})

    @property
    def metrics_logger(self) -> BaseLogger | None:
        """torchtitan's dashboards (the response's own scalars and alerts)."""
        return getattr(self.metrics_processor, "logger", None)


@dataclass(frozen=True)
class History:
    """What the rows written so far say, as the response reads it (``LedgerPort.history``):
    the ledger's collections by reference, typed read-only (no response code mutates them)."""

    recent: Sequence[dict]  # the last rows written (the ledger keeps 64)
    flagged_at: AbstractSet[int]  # the consumed-sample positions of the steps flagged (a look-back)
    flagged: AbstractSet[int]  # the steps this process flagged (acting rules)
    stalls: Sequence[dict]  # the stall rule's events this process raised
    rewinds: int  # in-process rollbacks so far
    content: ContentMemory | None  # the content the look-back remembers (a conviction's checks)
    stall_onset: int | None  # where the stall rule's best window ended (None: no stall rule)
    skip_windows: Sequence[tuple[int, int]] = ()  # the steps skipped whole, --ledger.skip.steps and rollbacks'
    adam: AdamLevel | None = None  # Adam's second moment's level as the rows measured it (None: not measured)
    broken_since: int | None = None  # the model's health: the onset of the broken stretch it is in (None: healthy)

    def skip_window_at(self, step: int) -> tuple[int, int] | None:
        """The skip window ``step`` is in (None: it trains)."""
        from titan_ledger.data.layout import window_at  # (the one rule: sorted, disjoint windows)

        return window_at(self.skip_windows, step)


class Recorded:
    """The step the last ``Ledger.record`` reduced, as the response reads it
    (``LedgerPort.recorded``): its execution as device values (no read), and -- read on the
    host when first asked, a flagged step's proof only -- its spike event, each DP rank's
    loss and this rank's documents."""

    __slots__ = ("execution", "_read", "_host")

    def __init__(self, execution: tuple | None,
                 read: Callable[[], tuple[dict[str, Any], list[float], dict | None]]) -> None:
        self.execution = execution  # (local loss sum, local tokens, grad norm); None: nothing recorded yet
        self._read, self._host = read, None

    def _values(self) -> tuple[dict[str, Any], list[float], dict | None]:
        if self._host is None:
            self._host = self._read()
        return self._host

    @property
    def event(self) -> dict[str, Any]:
        """Its spike rules, as its event will describe them."""
        return self._values()[0]

    @property
    def dp_loss(self) -> list[float]:
        """Each DP rank's mean loss."""
        return self._values()[1]

    @property
    def documents(self) -> dict | None:
        """This DP rank's per-document summary (None: per-document loss off, or no tokens here)."""
        return self._values()[2]


@runtime_checkable
class LedgerPort(Protocol):
    """The ledger as the response layer sees it (``Ledger`` implements it): what it reads
    -- the step's flags and stats, the history the rows left -- and what it writes -- an
    event (an action is one), a quarantine, the rows of a step consumed or moved, and the
    update as the ledger measures it."""

    # reads: the flags and the step just recorded
    @property
    def detector(self) -> SpikeDetector | None:
        """The spike rules' detector (a proof judges a re-execution by its bars); None where
        no rule runs (``[ledger] signals`` off): no step is ever flagged."""
        ...

    def flags(self, rec: StepRecord | None = None) -> tuple[bool, bool] | None:
        """(acting flag, note): this step's on the host, one device->host read (``rec`` None;
        no rule ran: both False), or a deferred step's from the recorder's queued copy
        (None: not queued)."""
        ...

    def hold(self, *, acting: bool, notes: bool) -> torch.Tensor:
        """The device-side guard of a deferred update (the fused optimizer's ``found_inf``)."""
        ...

    def recorded(self) -> Recorded:
        """The step the last record reduced (its host values read only when asked)."""
        ...

    def history(self) -> History:
        """What the rows written so far say (by reference; asked every step)."""
        ...

    # writes: an event, a quarantine, a step's rows
    def record_event(self, ev: dict, alert: tuple[str, str] | None = None,
                     metrics_logger: BaseLogger | None = None) -> None:
        """An event of the response itself in spikes.jsonl (a ladder's action, the breaker, a
        failure inside the response); ``alert`` (title, text): also on this rank's dashboards."""
        ...

    def quarantine_proven(self, docs: list, step: int) -> None:
        """Documents a proof convicted at ``step``: masked from the next fetch on."""
        ...

    def remask(self, rec: StepRecord, docs: list) -> None:
        """A step fetched before a deferred proof convicted ``docs``: masked in its batches now."""
        ...

    def trained_as(self, rec: StepRecord, execution: dict) -> None:
        """A proof applied ``execution``, not the step's first: its rows record what trained."""
        ...

    def record_skip(self, *, first: int, last: int, info: SkipInfo, lr: float, step_start: float,
                    rec: StepRecord | None = None, metrics_logger: BaseLogger | None = None) -> None:
        """Steps ``first..last`` consumed untrained: a skip window, or (``rec``) one step whose
        masks left no label token (its rows and masks, ``"why": "no_tokens"``)."""
        ...

    def rewind(self, *, from_step: int, to_step: int, window: tuple[int, int],
               metrics_logger: BaseLogger | None = None) -> None:
        """An in-process rollback: rows after ``to_step`` superseded, ``window`` skipped."""
        ...

    def drain(self, block: bool, metrics_logger: BaseLogger | None = None) -> None:
        """Write every step whose device->host copy is done (``block``: wait for all)."""
        ...

    def discard_step_state(self) -> None:
        """Drain what an extra execution of the step refilled (its row was reduced from the first)."""
        ...

    # the update
    def update(self, step: Callable[[], None] | None, rec: StepRecord | None = None) -> None:
        """The optimizer's update as the ledger measures it: ``step`` (``optimizers.step``;
        None: withheld) between what ``update_norm`` needs before it (``rec``: a deferred
        step's update, applied a step late) and what follows it (update norm, QK-clip)."""
        ...


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What the response reads of the run beyond its own sections: torchtitan's settings,
    the ledger's other sections, the trainer's layout -- read once by the trainer when it
    builds the response (``Recovery.Config.build(..., facts=RunFacts(...))``), never later
    through it. A unit test names the few it exercises; the rest keep these defaults."""

    device: torch.device
    parts: Parts  # torchtitan's components, as its __init__ built them
    topo: Topology = field(default_factory=lambda: Topology.single())  # the ledger's, once set up
    folder: Path = Path("ledger")  # the ledger's folder (<dump_folder>/<[ledger] folder>)
    global_batch: int = 1  # samples per step, every DP rank's
    clips_qk: bool = False  # QK-clip rewrites Q and K after every update ([qk_clip] enable; a held update would not)
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
    loader: LedgerDataLoader | None = None  # the ledger's sample-id loader (skip, corpus reads), when the run uses one
    owned_params: list | None = None  # the parameters' owned pieces, every logical element once (None: no signals)
    prove_at: list = field(default_factory=list)  # --ledger.rehearsal.prove_at, parsed (forced proofs)
    faults: dict[str, str] = field(default_factory=dict)  # --ledger.rehearsal.response_fault, parsed

    @classmethod
    def of(cls, config: Any, ledger: Any, parts: Parts, *, device: torch.device, microbatches: int) -> RunFacts:
        """The facts of a ``LedgerTrainer.Config`` (its torchtitan sections and the ledger's
        other sections) and of the ledger once set up (its topology, global batch, QK-clip),
        read once when the trainer builds the response; the rehearsal flags parsed here, so
        a bad one fails the launch, not the step it names."""
        from titan_ledger.data.layout import parse_skip_steps
        from titan_ledger.rehearsal.faults import parse_response_faults

        table, training = config.ledger, config.training
        return cls(
            device=device, topo=ledger.topo, folder=Path(config.dump_folder) / table.folder,
            global_batch=ledger.global_batch, clips_qk=ledger.clips_qk, dump_folder=config.dump_folder, checkpoint_folder=config.checkpoint.folder,
            exclude_from_loading=tuple(config.checkpoint.exclude_from_loading or ()), steps=training.steps,
            seq_len=training.seq_len, local_batch_size=training.local_batch_size, max_norm=training.max_norm,
            microbatches=microbatches, grads_freed=device.type == "cpu" and bool(training.disable_cuda_graphs),
            skip_lr=table.skip.lr, stall=table.stall, spike=table.spike, parts=parts, loader=ledger.loader,
            owned_params=ledger.owned_params,
            prove_at=parse_skip_steps(table.rehearsal.prove_at, "--ledger.rehearsal.prove_at"),
            faults=parse_response_faults(table.rehearsal.response_fault))
