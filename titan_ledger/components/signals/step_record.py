"""One trained step as the ledger records it.

Design decision: a step's facts are gathered in one object and fanned out to the
writers in one place (``Ledger.drain``), so what the signals row, the rank row, the
data row and a spike event say of a step comes from the same record. Who writes which
fields, in the order a step runs:

=========================================  ==========================================
writer                                     fields
=========================================  ==========================================
the trainer (``train_step``)               ``step``, ``start``, ``inject``, ``faults``
                                           (``rehearsal.faults.plan``, which may clear
                                           ``inject``), ``batches``, ``lr``
``ledger.batches.Batches`` and             ``data_loading_s``, ``fetched``, ``tags``,
``Ledger.take_provenance`` (each fetch)    ``masked``, ``masked_tokens``, ``data_written``
the recorder (``Ledger.record``, drain)    ``step_time_s``, ``consumed_samples``,
                                           ``update_sq``
``Recovery`` (the decision) and its        ``update_skipped``, ``proof``, ``proof_failed``,
prover                                     ``decided``, ``masked["proof"]``, ``trained``;
                                           ``batches`` let go once decided
``Ledger.remask`` (a redo after a          ``masked``, ``masked_tokens``
deferred proof convicted documents)
=========================================  ==========================================

Kept beside the record rather than in it: the step's reduced device vector and first
execution (``Ledger.last_reduced``/``last_execution``, by reference, read only by a
proof), the rules' stats (``SpikeGuard.last_stats``): device tensors an unflagged
step must not copy; and what a deferred decision needs a step later (``Recovery.held``):
the response's own state, not a field of this signals-layer record. No field is ``Any``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titan_ledger.format.proofs import ProofRecord

if TYPE_CHECKING:  # (annotations only)
    import torch

    from titan_ledger.data.layout import RowTag
    from titan_ledger.rehearsal.faults import StepFaults


@dataclass
class StepRecord:
    """What the step's hooks (``batch_generator``, ``forward_backward_step``, the copied
    ``_train_step``) gather about one trained step."""

    step: int
    start: float  # perf_counter at the step's start (the row's step_time_s)
    inject: str | None = None  # the rehearsal batch replacement of this DP rank (repeat / random)
    data_loading_s: float = 0.0
    fetched: list[int] = field(default_factory=list)  # tokens of each batch fetched (torchtitan's metrics counted them)
    tags: list[RowTag] = field(default_factory=list)  # this DP rank's rows (RowTag), in fetch order
    masked: dict[str, list[list[int]]] = field(default_factory=dict)  # {"quarantine"|"repetition": [[row, segment]]}
    masked_tokens: int = 0  # label tokens those masks removed
    faults: StepFaults | None = None  # rehearsal.faults.StepFaults: this step's fault injections
    data_written: bool = False  # the data row went out before the forward (signals off)
    # set by Ledger.record / the recovery decision
    lr: float = math.nan
    step_time_s: float = 0.0
    consumed_samples: int = 0
    update_skipped: bool = False
    batches: list[list[tuple[dict, torch.Tensor]]] | None = None  # the step's fetched microbatch groups (a proof re-executes them)
    proof: ProofRecord | None = None  # the proof at the alarm (components.response.prover), when one ran
    proof_failed: dict | None = None  # {"where", "error"}: the proof failed, the step decided without it
    unproven: str | None = None  # why a note was not proven under scope = "all" ("budget")
    #: the execution whose update trained, where a proof applied another than the first (its data
    #: masked, a recomputed update): ``loss_by_dp``, ``tok_by_dp``, ``grad_norm``, ``masked_tokens``
    #: (the labels its masks removed) -- the step's rows record what trained (issue 68)
    trained: dict | None = None
    update_sq: torch.Tensor | None = None  # [ledger] update_norm: the update's squared norm (device scalar, all ranks summed)
    decided: bool = True  # False while the step's decision is deferred (its rows wait for it)

    def masked_or_none(self) -> dict | None:
        """The masks that hit something (the data row omits an empty ``masked``)."""
        return {k: v for k, v in self.masked.items() if v} or None
