"""The ``[ledger]`` table's own sub-sections: ``doc_loss``, ``filter``, ``skip``, ``rehearsal``
(the response's sections are its own: :mod:`titan_ledger.components.response.config`).

Design decision: the table groups its fields by what they control, each group a
nested dataclass (torchtitan's own nesting: ``--ledger.skip.steps``), one name per
key. Each section's ``__post_init__`` checks its own values' syntax when the flags are
parsed (a bad ladder or skip range fails before anything is built); checks of a value
against others -- another section, the world size, the dataloader -- are launch checks
and live in :func:`titan_ledger.config.validate.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titan_ledger.components.response.counterfactual import parse_overrides
from titan_ledger.data.filters import Quarantine
from titan_ledger.data.layout import parse_skip_steps
from titan_ledger.errors import ConfigError
from titan_ledger.rehearsal.faults import parse_die, parse_inject, parse_response_faults


@dataclass(kw_only=True, slots=True)
class DocLossConfig:
    enable: bool = True
    """Per-document loss: attribute each token's loss to its document segment (in the
    loss torchtitan already computes; no extra forward) and write each DP rank's
    ``k`` highest- and lowest-loss segments per step to the data ledger."""

    k: int = 4
    """Segments kept per DP rank and step at each end (highest and lowest mean loss)."""

    min_tokens: int = 16
    """Segments with fewer label tokens are not ranked (their mean loss is noise)."""

    def __post_init__(self) -> None:
        if self.k < 1 or self.min_tokens < 1:
            raise ConfigError(f"--ledger.doc_loss.k and --ledger.doc_loss.min_tokens must be >= 1 "
                              f"(got {self.k}, {self.min_tokens})")


@dataclass(kw_only=True, slots=True)
class FilterConfig:
    quarantine: list[str] = field(default_factory=list)
    """Quarantine files: one ``{"source": ..., "doc": ...}`` per line (``lookup --json``
    names documents this way; ``diagnose --write-quarantine`` writes them). Those
    documents' tokens are loss-masked wherever they appear; the sample sequence is
    unchanged, so adding a file when resuming after a spike is not a data change."""

    repetition: bool = False
    """Mask document segments holding an n-gram repeated ``repetition_min`` times in
    a row (OLMo-core's instance filter rule), counted per step in the ledgers."""

    repetition_min: int = 32
    """Repetition filter: repeats of one n-gram that mask its segment."""

    repetition_max_period: int = 13
    """Repetition filter: the longest n-gram period checked (1 = one token repeated)."""

    def __post_init__(self) -> None:
        if self.repetition_min < 2 or self.repetition_max_period < 1:
            raise ConfigError(f"--ledger.filter.repetition_min must be >= 2 and "
                              f"--ledger.filter.repetition_max_period >= 1 (got {self.repetition_min}, "
                              f"{self.repetition_max_period})")
        Quarantine(self.quarantine)  # the files exist and parse


@dataclass(kw_only=True, slots=True)
class SkipConfig:
    steps: list[str] = field(default_factory=list)
    """Steps whose data is consumed without forward/backward or update: absolute,
    1-indexed, inclusive ranges or single steps, e.g. ``["137000-137300", "140001"]``
    (on the command line also comma-separated). Needs LedgerDataLoader."""

    lr: Literal["freeze", "advance"] = "freeze"
    """LR schedule over skipped steps: ``freeze`` (Megatron: the schedule does not
    advance) or ``advance`` (as if the steps had trained)."""

    auto: bool = False
    """Add the steps listed in ``<dump_folder>/ledger/rejected_steps.jsonl`` (every
    flagged step of earlier launches) to ``steps`` (Megatron's tracker-file flow)."""

    def __post_init__(self) -> None:
        parse_skip_steps(self.steps)  # raises SkipError naming the entry


@dataclass(kw_only=True, slots=True)
class RehearsalConfig:
    inject: str = ""
    """Rehearsal only: ``STEP:DP_RANK:KIND`` replaces that DP rank's batch at that step
    by a single repeated token (``repeat``) or uniform random tokens (``random``);
    see ``python -m titan_ledger.replay inject``. ``bitflip`` (a hardware-fault
    rehearsal, :mod:`titan_ledger.rehearsal.faults`) flips one exponent bit of one gradient
    element on that DP rank after the backward, before the clip; ``bitflip@F`` (e.g.
    ``bitflip@2``) flips the one bit of that DP rank's gradients that moves the
    step's grad norm closest to F x, a finite corruption of a chosen size; ``swap`` makes every DP
    rank r train on rank (r+1) % dp's batch at that step (the rank is ignored; write 0).
    Comma-separated specs combine one data kind with faults, e.g. ``8:1:repeat,11:0:bitflip``."""

    rerun: str = ""
    """Set by ``python -m titan_ledger.replay rerun`` only (:mod:`titan_ledger.components.response.counterfactual`):
    ``stop=N`` ends training after step N (the LR schedule still spans
    ``--training.steps``), ``lr_scale=X`` / ``eps=X`` override the checkpoint's
    learning rate (scaled) and Adam epsilon from the first step on, e.g.
    ``stop=9,lr_scale=0.5``."""

    prove_at: str = ""
    """Rehearsal only: prove these steps (``"2,5-7"``) at the alarm as if a note had
    fired (``components.response.prover``), whatever the rules say: every parallelism's
    re-execution checked against its first, on clean steps. The proof is recorded as an
    event of its own in spikes.jsonl (``"forced": true``)."""

    die: str = ""
    """Rehearsal only: ``STEP:RANK:HOW`` -- global rank RANK ends itself at the start of
    step STEP, for real: ``SIGKILL`` (what the OOM killer does) or another signal name,
    or ``exitN`` (``os._exit(N)``). What the launcher then says (the rank, the signal, the
    last step the ledger completed, the command that resumes) is what a real lost rank
    gets; see docs/running.md."""

    nondeterminism: float = 0.0
    """Rehearsal only: after every backward, scale each gradient by ``1 + X * u`` (``u``
    uniform in [-1, 1], one draw per parameter, from a generator seeded alike on every
    rank, so replicated gradients stay equal), so
    that no two executions of a step are bit-equal, as on a GPU without
    ``--debug.deterministic``: what proofs at the alarm then measure as the noise floor
    (``--ledger.proof.noise_factor``). 0: off."""

    response_fault: str = ""
    """Rehearsal only: ``PLACE:KIND[,PLACE:KIND]`` -- the response itself fails at every pass
    through PLACE (``proof``: its executions; ``bisect``: group testing; ``window``: the
    window proof; ``snapshot``: a host snapshot's copy; ``restore``: a rollback's restore
    from host memory) with KIND (``raise``: an exception; ``oom``: out of memory, host
    memory for snapshot and restore; ``nan``: the execution's results not finite;
    ``timeout``: the proof's deadline passed), e.g. ``proof:raise``. Training goes on as
    it would without that part of the response, and the event records the failure."""

    data_end: int = 0
    """Rehearsal only: the data runs out at step N -- fetching its first batch raises
    torchtitan's ``DataloaderExhaustedError``, as a finite dataset does
    (``--dataloader.infinite false`` on torchtitan's loader; titan_ledger's own sources
    loop over epochs), and training ends there. A rollback may bring training back to
    step N, where the data runs out again. 0: off."""

    def __post_init__(self) -> None:
        if self.data_end < 0:
            raise ConfigError(f"--ledger.rehearsal.data_end must be >= 0 (0: off), got {self.data_end}")
        if not (0.0 <= self.nondeterminism < 1.0):
            raise ConfigError(f"--ledger.rehearsal.nondeterminism must be in [0, 1), got {self.nondeterminism}")
        parse_inject(self.inject)
        parse_die(self.die)
        parse_response_faults(self.response_fault)
        parse_skip_steps(self.prove_at, "--ledger.rehearsal.prove_at")
        parse_overrides(self.rerun)  # raises ConfigError naming the entry
