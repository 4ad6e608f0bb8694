"""The ``[ledger]`` table's sub-sections: ``doc_loss``, ``filter``, ``skip``, ``on_spike``, ``snapshots``, ``rehearsal``.

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
from titan_ledger.components.response.ladder import parse_ladder
from titan_ledger.components.response.verdict import SNAPSHOT_CAUSES
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


#: what the response may change by itself (``--ledger.on_spike.act``)
POLICIES = ("observe", "act")


@dataclass(kw_only=True, slots=True)
class OnSpikeConfig:
    act: Literal["observe", "act"] = "observe"
    """What the response may change by itself -- one contract for every automatic
    action. ``observe`` (the default): flagged steps are proven and recorded -- the
    verdict, its evidence and what acting would have done ("would have ...") -- and
    training is bit-equal to a run with ``prove = "off"``: no update withheld or
    replaced, no document masked or quarantined, no rollback. The default because an
    action on a false conviction can damage or end a week-long run (a memorisation
    plateau convicted an innocent document, emptied the next step and stopped the run on
    a NaN); read what the proofs say (``diagnose``, ``report``), then opt in. ``act``:
    the proof's verdicts act -- ``hardware``: the update of the executions that agree;
    ``bad_data``: the step trained without the convicted documents and those
    quarantined, within ``quarantine_max`` -- and ``action`` (the ladder) acts on flags
    no proof resolved; at most ``breaker_actions`` actions within ``breaker_window``
    steps. An ``action`` other than ``none`` needs ``act``."""

    action: str = "none"
    """What a flagged step does (``act = "act"``): ``none`` (record it), ``skip_update`` (do not apply
    its optimizer update; Adam's step count does not advance; decided on the device,
    see ``defer``), ``rollback`` (reload the last
    checkpoint at or before step - rollback_back, skip rollback_skip steps from
    there and continue in the same process), ``rollback_lr:X`` (the same, and the
    LR scaled by X from then on), ``stop`` (stop with a report, exit 1). One action
    repeats without limit (rollbacks capped by max_rollbacks); a comma-separated
    **ladder** escalates when a spike repeats within ``ladder_horizon`` steps, each
    rung ``*N`` attempts (default 1), e.g. ``skip_update*2,rollback,rollback_lr:0.5,stop``;
    past the last rung the run stops. Every decision is recorded in spikes.jsonl."""

    ladder_horizon: int = 100
    """A spike within this many steps of the previous one is a repeat (next attempt
    or next rung); after a quiet horizon the ladder starts again at its first rung."""

    rollback_back: int = 100
    """Rollbacks: go back to a checkpoint at or before spike - this many steps."""

    rollback_skip: int = 200
    """Rollbacks: steps skipped from the checkpoint on (the window is widened to
    reach the spike step)."""

    max_rollbacks: int = 3
    """Rollbacks: stop with an error after this many rewinds in one run."""

    prove: Literal["off", "acting", "all"] = "all"
    """Proof at the alarm (:mod:`titan_ledger.components.response.prover`): before its update, a
    flagged step is re-executed as is (``same``: a difference is a transient ``hardware``
    fault), its Adam update recomputed under a healthy second moment (``adam_check``:
    ``optimizer_state``) and, when the update is abnormal, with the suspect data
    loss-masked against a control of other content (``bad_data``); ``outlier`` and
    ``not_data`` name no harmful data. What a verdict changes is ``act``'s: under
    ``observe`` nothing (the event says what acting would have done); under ``act``
    ``hardware`` applies the recomputed update, ``bad_data`` the update without the
    documents and quarantines them, and the ladder (``action``) takes the rest. ``all`` (the default): steps an acting rule
    flags, and notes within the note budget (``prove_notes_rate``; a note proven harmful
    acts: a finite silent corruption of 2x is a note); ``acting``: acting flags only;
    ``off``: act on the flag alone. Costs 1-3 extra forward/backward passes per proven
    step, nothing on other steps (docs/spike-response.md: the measured note rate)."""

    prove_notes_rate: float = 0.01
    """``prove = "all"``: the notes proven are a token bucket's, refilled by this many
    proofs a step (0.01: one note proof per 100 steps, sustained; a proof of a note
    costs 1 extra forward/backward, 2 deferred, 3 on a GPU without determinism) and
    holding at most ``prove_notes_burst``. A note past it is recorded unproven (its
    event says ``"unproven": "budget"``); acting flags are always proven. Part of the
    checkpoint, so a resumed run proves the notes the uninterrupted one did."""

    prove_notes_burst: int = 8
    """``prove = "all"``: how many note proofs the bucket holds (full at the start), so a
    burst of notes -- a cold start's first steps -- is proven while the sustained rate
    stays at ``prove_notes_rate``."""

    prove_rtol: float = 0.0
    """Proofs: how far two executions of the same data may differ (relative, per rank's
    loss and gradient sum of squares) and count as equal; 0: bit for bit (CPU, and GPU
    with ``--debug.deterministic``). Without determinism 0 still works: a third
    execution then measures the machine's noise (``prove_noise_factor``)."""

    prove_noise_factor: float = 100.0
    """Proofs on a machine that does not execute a step bit for bit (all three
    executions differ): an execution is a transient fault only when it stands this many
    times farther from both others than the closest two stand apart (their distance is
    the noise floor, measured per parameter and rank and recorded with the proof as
    ``noise``); otherwise the step reproduced within that noise."""

    prove_bisect: bool = True
    """When the proof's masks leave a reproducible abnormal update unexplained (masking the
    suspect rank does not restore it, or no rank stands out) or convict a whole rank's
    batch: group testing over the step's documents across every DP rank -- mask one
    half, the other half as its control, down to the documents whose masking alone
    restores the update (at most 2 ceil(log2 k) extra forward/backward passes for k
    documents). Convicts those documents instead of the batch. Never runs on a step
    whose first update is normal (every proof of a clean step), so it costs nothing
    there; ``--ledger.on_spike.no_prove_bisect`` keeps the rank-level verdicts."""

    defer: bool = True
    """Decide a flagged step one step late, with no host read on the others: the update
    is withheld on the device (the flag is the fused AdamW's ``found_inf``), the host
    reads the flag at the next step, behind that step's forward/backward, and proves and
    acts then (an update the decision applies is applied at the flagged step's LR, and
    the next step is executed again). Checkpoint and validation steps and the last
    step decide in the step. Needs a fused
    Adam/AdamW (``--optimizer.implementation fused``, the default) and QK-clip off;
    otherwise, or with ``false``, every step reads its flag on the host before its update."""

    quarantine_max: float = 0.01
    """``act``: the largest share of the corpus's tokens a proof's quarantine may mask
    (the convicted documents' tokens over the corpus's: 0.01 = 1%, the expected share of
    any 1,000 steps of a shuffled corpus). A conviction whose documents cover more, or any
    of whose documents holds as many tokens as a whole step (masking it would leave a
    step with nothing to train on), is not applied: the verdict stands, one warning
    names the documents and their share, and the ladder (``action``) decides the step."""

    quarantine_fragile: bool = False
    """Convict data in a run the LR's fingerprint already marks fragile (``diagnose``'s F2:
    the updates moving >= 1% of the weights' norm a step): off, the proof's verdict there
    is ``not_data`` (the documents recorded as the suspect's, the reading as ``fragile``):
    in the real set's LR runs every document convicted so had no bad data planted, and no
    planted zoo document sat in a fragile run (F2's reading 40x below its bar)."""

    adam_check: float = 4.0
    """The proof's optimizer-state test, before any data is masked (no extra
    forward/backward): Adam's updates are recomputed from the same state and gradients
    with the second moment restored to its long-run level (``adam_horizon``); when the
    updates the state stood for are at least this many times the restored ones, Adam's
    state, not the data, made the step abnormal (its second moment decayed over quiet
    gradients, Bai et al. 2025): the verdict is ``optimizer_state`` and no data is
    masked. 4: v 16x below its long-run level (a memorisation plateau: 53-1,300x; clean
    runs: at most 1.15x). 0: off."""

    unstable_flags: int = 4
    """A conviction needs a run that is stable around the step: with at least this many
    flagged steps among the 64 before it, the run is unstable as a whole (an LR that
    diverges it), masking a document tests the model's fragility, not the data, and
    nothing is convicted (``not_data``, why said). Measured: every planted document of the
    zoo was convicted with 0 flags in the 64 steps before; the LR-1.0 divergence's false
    convictions had 5-21. 0: off."""

    lookback: int = 1000
    """A conviction's look-back by content: data is not convicted when content like it
    (>= half its token shingles) trained in the last this many steps without a flag
    (``data/content.py``'s memory of what trained, 16 MiB a rank, written with every
    fetched batch while proofs are on). 0: only the same documents, by id."""

    adam_horizon: int = 1000
    """Steps over which Adam's second moment's long-run level is averaged (an exponential
    average of the clipped gradient's squared norm; Adam's own averages over 1/(1-beta2)
    steps, 20 at beta2 0.95)."""

    prove_timeout: float = 300.0
    """Seconds a proof (its executions, group testing, the window proof) may take; past it
    the proof is abandoned at its next execution, the state put back, and the step
    decided as it would be without the proof (the event records the failure)."""

    breaker_actions: int = 4
    """``act``: the circuit breaker -- more than this many automatic actions (masked or
    recomputed updates, quarantines, withheld updates, rollbacks) within
    ``breaker_window`` steps pause acting: one ERROR line and a W&B alert, the response
    observes (records and proves, changes nothing) until ``breaker_window`` steps pass
    without one; spikes.jsonl records the pause and the resumption."""

    breaker_window: int = 100
    """The circuit breaker's window in steps (``breaker_actions``)."""

    def __post_init__(self) -> None:
        if self.act not in POLICIES:
            raise ConfigError(f"--ledger.on_spike.act {self.act!r}: expected observe (record and prove, change "
                              f"nothing) or act")
        if self.act == "observe" and any(r.action != "none" for r in parse_ladder(self.action)):
            raise ConfigError(f"--ledger.on_spike.action {self.action}: an action that changes training, and "
                              f"--ledger.on_spike.act is observe (the default: record and prove, change nothing); "
                              f"add --ledger.on_spike.act act, or set --ledger.on_spike.action none")
        if not (0 < self.quarantine_max <= 1):
            raise ConfigError(f"--ledger.on_spike.quarantine_max {self.quarantine_max}: expected a share of the "
                              f"corpus in (0, 1], e.g. 0.01")
        if self.unstable_flags < 0:
            raise ConfigError(f"--ledger.on_spike.unstable_flags {self.unstable_flags}: expected >= 0 (0: off)")
        if self.adam_check < 0 or (0 < self.adam_check <= 1) or self.adam_horizon < 1:
            raise ConfigError(f"--ledger.on_spike.adam_check {self.adam_check} / adam_horizon {self.adam_horizon}: "
                              f"expected adam_check 0 (off) or > 1 and adam_horizon >= 1")
        if not self.prove_timeout > 0:
            raise ConfigError(f"--ledger.on_spike.prove_timeout must be > 0 seconds, got {self.prove_timeout}")
        if self.breaker_actions < 1 or self.breaker_window < 1:
            raise ConfigError(f"--ledger.on_spike.breaker_actions {self.breaker_actions} / breaker_window "
                              f"{self.breaker_window}: expected both >= 1")
        if self.prove not in ("off", "acting", "all"):
            raise ConfigError(f"--ledger.on_spike.prove {self.prove!r}: expected off, acting or all")
        if not (self.prove_notes_rate >= 0 and self.prove_notes_burst >= 0):
            raise ConfigError(f"--ledger.on_spike.prove_notes_rate {self.prove_notes_rate} / prove_notes_burst "
                              f"{self.prove_notes_burst}: expected >= 0 (0 and 0: notes are never proven)")
        if not self.prove_noise_factor > 1:
            raise ConfigError(f"--ledger.on_spike.prove_noise_factor must be > 1, got {self.prove_noise_factor}")
        if self.prove_rtol < 0:
            raise ConfigError(f"--ledger.on_spike.prove_rtol must be >= 0, got {self.prove_rtol}")
        parse_ladder(self.action)  # raises ConfigError naming the rung
        if self.ladder_horizon < 1:
            raise ConfigError(f"--ledger.on_spike.ladder_horizon must be >= 1, got {self.ladder_horizon}")
        for name in ("rollback_back", "max_rollbacks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--ledger.on_spike.{name} must be >= 0, got {getattr(self, name)}")
        if self.rollback_skip < 1:
            raise ConfigError(f"--ledger.on_spike.rollback_skip must be >= 1, got {self.rollback_skip}")


@dataclass(kw_only=True, slots=True)
class SnapshotsConfig:
    every: int = 0
    """Keep this rank's model and optimizer state in host memory every N steps (and at
    the process's first step), a ring of ``keep``, with the batches trained since the
    oldest (:mod:`titan_ledger.components.response.snapshots`). At an acting flag the
    proof found ``not_data``, the window from the oldest snapshot to the flagged step is
    re-run in this process once per candidate cause (``causes``) and once unchanged,
    the cause whose variant alone brings the flagged step's update back to normal is
    recorded in the proof, the state is put back and the configured action runs; a
    rollback whose target a snapshot covers restores it from host memory instead of
    loading a checkpoint. 0: off. Costs ``keep`` + 1 copies of the parameters and
    optimizer moments in host memory (docs/spike-response.md)."""

    keep: int = 2
    """How many snapshots the ring holds; the window proof starts from the oldest, so the
    window reaches back ``every`` x (``keep`` - 1) to ``every`` x ``keep`` steps."""

    causes: list[str] = field(default_factory=lambda: ["lr", "adam", "eps", "logit_cap", "zloss"])
    """The fixes the window proof tries, each a re-run of the window besides the unchanged
    one: ``lr`` (every step's learning rate x ``lr_factor``: the learning rate), ``adam``
    (beta2 ``beta2``, epsilon ``eps``: the optimizer state), ``eps`` (Adam's epsilon raised
    to ``eps_fix``: the optimizer state), ``logit_cap`` (the attention logits soft-capped at
    ``logit_cap``: logit growth) and ``zloss`` (z-loss at ``zloss``: the output logits). A
    fix that would change nothing here (the run already has it) is not run. Each removes
    the spike or not, at a cost (its loss over the window's last ``cost_steps`` steps
    against the unchanged run's); the cheapest that removes it names the cause, the
    others are listed."""

    lr_factor: float = 0.1
    """The ``lr`` variant's scale on every step's learning rate in the window."""

    beta2: float = 0.95
    """The ``adam`` variant's beta2 over the window (the article's section 2.6: 0.95); a
    group whose beta2 is lower keeps its own."""

    eps: float = 1e-8
    """The ``adam`` variant's epsilon over the window; a group whose epsilon is larger
    keeps its own. A run already at ``beta2`` and ``eps`` does not run the variant (it
    would change nothing)."""

    eps_fix: float = 1e-6
    """The ``eps`` fix: Adam's epsilon raised to this over the window (a group whose epsilon
    is larger keeps its own). 1e-6 removed the memorisation plateau's spikes on the tiny
    model (docs/benchmarks.md)."""

    logit_cap: float = 30.0
    """The ``logit_cap`` fix: every attention logit soft-capped at this (``cap x
    tanh(logit / cap)``, Gemma 2's) over the window."""

    zloss: float = 1e-4
    """The ``zloss`` fix: the loss's z-loss weight over the window (PaLM's 1e-4)."""

    cost_steps: int = 5
    """A fix's cost is its mean loss over the window's last this many steps, against the
    unchanged re-run's."""

    control: float = 1.1
    """The window's control: one more re-run with every step's learning rate x this -- a
    perturbation of the trajectory that is no fix (a larger LR removes no LR-driven
    spike). Where it removes the spike too, the spike hangs on the trajectory's details
    and the fixes that removed it prove nothing (measured on the memorisation plateau,
    issue 67: every fix "removed" a spike there). 0: no control."""

    max_proofs: int = 2
    """Window proofs of spikes per process (each costs (len(causes) + 1) x the window's
    steps of forward/backward and updates); later ``not_data`` flags are recorded unproven."""

    max_stall_proofs: int = 1
    """Window proofs of stalls per process, a budget apart from ``max_proofs``: a run that
    spikes before it stalls would otherwise have spent every proof before the stall (the
    real set's logit stall did)."""

    stall_anchor: bool = True
    """A stall's window proof re-runs from the stall's onset, not from the ring's oldest
    snapshot: while a stall proof can still run, the ring also keeps (pins) the newest
    snapshot at or before the step where the stall rule's best window ended, and the
    batches since -- one more copy of the state, released when the loss improves again
    (a later snapshot is pinned) or once the onset is more than (``patience`` + 2) x
    ``window`` steps of ``[ledger.stall]`` back. A stall builds over hundreds of steps: on
    the real set's logit stall (LR 0.2, two seeds) a window from the ring's oldest
    snapshot (72 steps) could not tell the fixes apart; from the onset (201 steps) the
    logit cap lowered the loss 4-8%, the most of every fix (docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1 or self.max_proofs < 0 or self.max_stall_proofs < 0:
            raise ConfigError(f"--ledger.snapshots.every {self.every} / keep {self.keep} / max_proofs "
                              f"{self.max_proofs} / max_stall_proofs {self.max_stall_proofs}: expected every >= 0 "
                              f"(0: off), keep >= 1, max_proofs >= 0, max_stall_proofs >= 0")
        bad = [c for c in self.causes if c not in SNAPSHOT_CAUSES]
        if bad:
            raise ConfigError(f"--ledger.snapshots.causes {','.join(bad)}: expected some of "
                              f"{', '.join(SNAPSHOT_CAUSES)}")
        if not (self.eps_fix > 0 and self.logit_cap > 0 and self.zloss > 0 and self.cost_steps >= 1):
            raise ConfigError(f"--ledger.snapshots.eps_fix {self.eps_fix} / logit_cap {self.logit_cap} / zloss "
                              f"{self.zloss} / cost_steps {self.cost_steps}: expected each > 0 (cost_steps >= 1)")
        if self.control != 0 and self.control <= 1:
            raise ConfigError(f"--ledger.snapshots.control {self.control}: expected a factor > 1 on the learning "
                              f"rate (a perturbation in the direction no LR fix takes), or 0 for no control")
        if not 0 < self.lr_factor < 1 or not 0 < self.beta2 < 1 or not self.eps > 0:
            raise ConfigError(f"--ledger.snapshots.lr_factor {self.lr_factor} / beta2 {self.beta2} / eps "
                              f"{self.eps}: expected lr_factor and beta2 in (0, 1), eps > 0")


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
    (``--ledger.on_spike.prove_noise_factor``). 0: off."""

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
