"""The response's configuration: eight ``[ledger.*]`` sections, one concern each.

Design decision: the response (proof at the alarm, window proof, rollback, ladder,
breaker) owns its configuration here, beside its code, as torchtitan's components own
theirs -- not in the ledger's sections, one layer up. Until issue 69 it was two sections
of 22 and 14 fields (``[ledger.on_spike]``, ``[ledger.snapshots]``) whose prefixes
(``prove_*``, ``rollback_*``, ``breaker_*``, ``adam_*``, ``quarantine_*``) did a section's
job, with ``act`` beside ``action``. Now each section says what it controls and its
fields drop the prefix: ``[ledger.response]`` (the policy, the ladder), ``[ledger.proof]``
(the proof at the alarm), ``[ledger.adam_check]``, ``[ledger.conviction]`` (what convicting
data needs), ``[ledger.rollback]``, ``[ledger.breaker]``, ``[ledger.snapshots]`` (the host
ring) and ``[ledger.window]`` (the window proof's fixes). The old spellings are refused
with one line naming the new one; a launch the ledger recorded under them is read in
today's spelling, so an old run's fix command works as printed (both from one table,
:mod:`titan_ledger.format.spellings`). Each section checks its own values when the
flags are parsed; checks against other sections are launch checks
(:func:`titan_ledger.config.validate.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from torchtitan.config import Configurable

from titan_ledger.components.response.ladder import Action, parse_ladder
from titan_ledger.errors import ConfigError
from titan_ledger.format.answers.causes import WINDOW_CAUSE, default

#: what the response may change by itself (``--ledger.response.policy``)
POLICIES = ("observe", "act")


class ProveMode(StrEnum):
    """Which flags are proven (``--ledger.proof.scope``; the TOML's string equals its member)."""

    OFF = "off"  # none: the ladder answers every flag
    ACTING = "acting"  # acting flags
    ALL = "all"  # acting flags, and notes within the note budget


@dataclass(kw_only=True, slots=True)
class ResponseConfig:
    policy: Literal["observe", "act"] = "observe"
    """What the response may change by itself -- one contract for every automatic action.

    ``observe`` (the default): flagged steps are proven and recorded -- the verdict, its
    evidence and what acting would have done ("would have ...") -- and training is
    bit-equal to a run with ``[ledger.proof] scope = "off"``: no update withheld or
    replaced, no document masked or quarantined, no rollback. The default because an
    action on a false conviction can damage or end a week-long run (a memorisation
    plateau convicted an innocent document, emptied the next step and stopped the run on
    a NaN); read what the proofs say (``diagnose``, ``report``), then opt in.

    ``act``: the proof's verdicts act -- ``hardware``: the update of the executions that
    agree; ``bad_data``: the step trained without the convicted documents and those
    quarantined, within ``[ledger.conviction] max_share`` -- and ``action`` (the ladder)
    acts on flags no proof resolved; at most ``[ledger.breaker] actions`` actions within
    its ``window`` steps. An ``action`` other than ``none`` needs ``act``."""

    action: str = "none"
    """What a flagged step does (``policy = "act"``): ``none`` (record it), ``skip_update``
    (do not apply its optimizer update; Adam's step count does not advance; decided on the
    device, see ``defer``), ``rollback`` (reload the last checkpoint at or before step -
    ``[ledger.rollback] back``, skip its ``skip`` steps from there and continue in the same
    process), ``rollback_lr:X`` (the same, and the LR scaled by X from then on), ``stop``
    (stop with a report, exit 1).

    One action repeats without limit (rollbacks capped by ``[ledger.rollback] limit``); a
    comma-separated **ladder** escalates when a spike repeats within ``repeat_horizon``
    steps, each rung ``*N`` attempts (default 1), e.g.
    ``skip_update*2,rollback,rollback_lr:0.5,stop``; past the last rung the run stops.
    Every decision is recorded in spikes.jsonl."""

    repeat_horizon: int = 100
    """A spike within this many steps of the previous one is a repeat (the ladder's next
    attempt or next rung); after a quiet horizon the ladder starts again at its first rung."""

    defer: bool = True
    """Decide a flagged step one step late, with no host read on the others.

    The update is withheld on the device (the flag is the fused AdamW's ``found_inf``), the
    host reads the flag at the next step, behind that step's forward/backward, and proves
    and acts then (an update the decision applies is applied at the flagged step's LR, and
    the next step is executed again). Checkpoint and validation steps and the last step
    decide in the step. Needs a fused Adam/AdamW (``--optimizer.implementation fused``, the
    default) and QK-clip off; otherwise, or with ``--ledger.response.no_defer``, every step
    reads its flag on the host before its update."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--ledger.response.policy {self.policy!r}: expected observe (record and prove, "
                              f"change nothing) or act")
        if self.policy == "observe" and any(r.action != Action.NONE for r in parse_ladder(self.action)):
            raise ConfigError(f"--ledger.response.action {self.action}: an action that changes training, and "
                              f"--ledger.response.policy is observe (the default: record and prove, change "
                              f"nothing); add --ledger.response.policy act, or set --ledger.response.action none")
        parse_ladder(self.action)  # raises ConfigError naming the rung
        if self.repeat_horizon < 1:
            raise ConfigError(f"--ledger.response.repeat_horizon must be >= 1, got {self.repeat_horizon}")


@dataclass(kw_only=True, slots=True)
class ProofConfig:
    scope: Literal["off", "acting", "all"] = "all"
    """Which flagged steps are proven at the alarm (:mod:`titan_ledger.components.response.prover`).

    Before its update, a flagged step is re-executed as is (``same``: a difference is a
    transient ``hardware`` fault), its Adam update recomputed under a healthy second moment
    (``[ledger.adam_check]``: ``optimizer_state``) and, when the update is abnormal, with the
    suspect data loss-masked against a control of other content (``bad_data``); ``outlier``
    and ``not_data`` name no harmful data. What a verdict changes is
    ``[ledger.response] policy``'s: under ``observe`` nothing (the event says what acting
    would have done); under ``act`` ``hardware`` applies the recomputed update, ``bad_data``
    the update without the documents and quarantines them, and the ladder takes the rest.

    ``all`` (the default): steps an acting rule flags, and notes within the note budget
    (``notes_rate``; a note proven harmful acts: a finite silent corruption of 2x is a
    note); ``acting``: acting flags only; ``off``: act on the flag alone. Costs 1-3 extra
    forward/backward passes per proven step, nothing on other steps
    (docs/spike-response.md: the measured note rate)."""

    notes_rate: float = 0.01
    """``scope = "all"``: the notes proven are a token bucket's, refilled by this many
    proofs a step (0.01: one note proof per 100 steps, sustained; a proof of a note costs 1
    extra forward/backward, 2 deferred, 3 on a GPU without determinism) and holding at most
    ``notes_burst``. A note past it is recorded unproven (its event says
    ``"unproven": "budget"``); acting flags are always proven. Part of the checkpoint, so a
    resumed run proves the notes the uninterrupted one did."""

    notes_burst: int = 8
    """``scope = "all"``: how many note proofs the bucket holds (full at the start), so a
    burst of notes -- a cold start's first steps -- is proven while the sustained rate
    stays at ``notes_rate``."""

    rtol: float = 0.0
    """How far two executions of the same data may differ (relative, per rank's loss and
    gradient sum of squares) and count as equal; 0: bit for bit (CPU, and GPU with
    ``--debug.deterministic``). Without determinism 0 still works: a third execution then
    measures the machine's noise (``noise_factor``)."""

    noise_factor: float = 100.0
    """On a machine that does not execute a step bit for bit (all three executions differ):
    an execution is a transient fault only when it stands this many times farther from
    both others than the closest two stand apart (their distance is the noise floor,
    measured per parameter and rank and recorded with the proof as ``noise``); otherwise
    the step reproduced within that noise."""

    bisect: bool = True
    """Group testing over the step's documents, where the proof's masks leave a
    reproducible abnormal update unexplained (masking the suspect rank does not restore
    it, or no rank stands out) or convict a whole rank's batch.

    Across every DP rank: mask one half, the other half as its control, down to the
    documents whose masking alone restores the update (at most 2 ceil(log2 k) extra
    forward/backward passes for k documents). Convicts those documents instead of the
    batch. Never runs on a step whose first update is normal (every proof of a clean
    step), so it costs nothing there; ``--ledger.proof.no_bisect`` keeps the rank-level
    verdicts."""

    timeout: float = 300.0
    """Seconds a proof (its executions, group testing, the window proof) may take; past it
    the proof is abandoned at its next execution, the state put back, and the step decided
    as it would be without the proof (the event records the failure)."""

    def __post_init__(self) -> None:
        if self.scope not in tuple(ProveMode):
            raise ConfigError(f"--ledger.proof.scope {self.scope!r}: expected off, acting or all")
        if not (self.notes_rate >= 0 and self.notes_burst >= 0):
            raise ConfigError(f"--ledger.proof.notes_rate {self.notes_rate} / notes_burst {self.notes_burst}: "
                              f"expected >= 0 (0 and 0: notes are never proven)")
        if not self.noise_factor > 1:
            raise ConfigError(f"--ledger.proof.noise_factor must be > 1, got {self.noise_factor}")
        if self.rtol < 0:
            raise ConfigError(f"--ledger.proof.rtol must be >= 0, got {self.rtol}")
        if not self.timeout > 0:
            raise ConfigError(f"--ledger.proof.timeout must be > 0 seconds, got {self.timeout}")


@dataclass(kw_only=True, slots=True)
class AdamCheckConfig:
    ratio: float = 4.0
    """The proof's optimizer-state test, before any data is masked (no extra forward/backward).

    Adam's updates are recomputed from the same state and gradients with the second moment
    restored to its long-run level (``horizon``); when the updates the state stood for are
    at least this many times the restored ones, Adam's state, not the data, made the step
    abnormal (its second moment decayed over quiet gradients, Bai et al. 2025): the verdict
    is ``optimizer_state`` and no data is masked. 4: v 16x below its long-run level (a
    memorisation plateau: 53-1,300x; clean runs: at most 1.15x). 0: off."""

    horizon: int = 1000
    """Steps over which Adam's second moment's long-run level is averaged (an exponential
    average of the clipped gradient's squared norm; Adam's own averages over 1/(1-beta2)
    steps, 20 at beta2 0.95)."""

    def __post_init__(self) -> None:
        if self.ratio < 0 or (0 < self.ratio <= 1) or self.horizon < 1:
            raise ConfigError(f"--ledger.adam_check.ratio {self.ratio} / horizon {self.horizon}: expected ratio 0 "
                              f"(off) or > 1 and horizon >= 1")


@dataclass(kw_only=True, slots=True)
class ConvictionConfig:
    max_share: float = 0.01
    """``policy = "act"``: the largest share of the corpus's tokens a proof's quarantine may mask.

    The convicted documents' tokens over the corpus's: 0.01 = 1%, the expected share of any
    1,000 steps of a shuffled corpus. A conviction whose documents cover more, or any of
    whose documents holds as many tokens as a whole step (masking it would leave a step
    with nothing to train on), is not applied: the verdict stands, one warning names the
    documents and their share, and the ladder (``[ledger.response] action``) decides the
    step."""

    fragile: bool = False
    """Convict data in a run the LR's fingerprint already marks fragile (``diagnose``'s F2:
    the updates moving >= 1% of the weights' norm a step).

    Off, the proof's verdict there is ``not_data`` (the documents recorded as the
    suspect's, the reading as ``fragile``): in the real set's LR runs every document
    convicted so had no bad data planted, and no planted zoo document sat in a fragile run
    (F2's reading 40x below its bar)."""

    unstable_flags: int = 4
    """A conviction needs a run that is stable around the step.

    With at least this many flagged steps among the 64 before it, the run is unstable as a
    whole (an LR that diverges it), masking a document tests the model's fragility, not the
    data, and nothing is convicted (``not_data``, why said). Measured: every planted
    document of the zoo was convicted with 0 flags in the 64 steps before; the LR-1.0
    divergence's false convictions had 5-21. 0: off."""

    lookback: int = 1000
    """A conviction's look-back by content: data is not convicted when content like it
    (>= half its token shingles) trained in the last this many steps without a flag
    (``data/content.py``'s memory of what trained, 16 MiB a rank, written with every
    fetched batch while proofs are on). 0: only the same documents, by id."""

    def __post_init__(self) -> None:
        if not (0 < self.max_share <= 1):
            raise ConfigError(f"--ledger.conviction.max_share {self.max_share}: expected a share of the corpus in "
                              f"(0, 1], e.g. 0.01")
        if self.unstable_flags < 0:
            raise ConfigError(f"--ledger.conviction.unstable_flags {self.unstable_flags}: expected >= 0 (0: off)")
        if self.lookback < 0:
            raise ConfigError(f"--ledger.conviction.lookback {self.lookback}: expected >= 0 (0: by id only)")


@dataclass(kw_only=True, slots=True)
class RollbackConfig:
    back: int = 100
    """Go back to a checkpoint (or host snapshot) at or before the spike's step - this many steps."""

    skip: int = 200
    """Steps skipped from the checkpoint on (the window is widened to reach the spike's step)."""

    limit: int = 3
    """Stop with an error after this many rewinds in one run."""

    def __post_init__(self) -> None:
        for name in ("back", "limit"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--ledger.rollback.{name} must be >= 0, got {getattr(self, name)}")
        if self.skip < 1:
            raise ConfigError(f"--ledger.rollback.skip must be >= 1, got {self.skip}")


@dataclass(kw_only=True, slots=True)
class BreakerConfig:
    actions: int = 4
    """``policy = "act"``: the circuit breaker.

    More than this many automatic actions (masked or recomputed updates, quarantines,
    withheld updates, rollbacks) within ``window`` steps pause acting: one ERROR line and
    a W&B alert, the response observes (records and proves, changes nothing) until
    ``window`` steps pass without one; spikes.jsonl records the pause and the resumption."""

    window: int = 100
    """The circuit breaker's window in steps (``actions``)."""

    def __post_init__(self) -> None:
        if self.actions < 1 or self.window < 1:
            raise ConfigError(f"--ledger.breaker.actions {self.actions} / window {self.window}: expected both >= 1")


@dataclass(kw_only=True, slots=True)
class SnapshotsConfig:
    every: int = 0
    """Keep this rank's model and optimizer state in host memory every N steps (and at the
    process's first step), a ring of ``keep``, with the batches trained since the oldest
    (:mod:`titan_ledger.components.response.snapshots`).

    At an acting flag the proof found ``not_data``, the window from the oldest snapshot to
    the flagged step is re-run in this process once per fix (``[ledger.window]``) and once
    unchanged, and the fixes' effects are recorded in the proof; the state is put back and
    the configured action runs. A rollback whose target a snapshot covers restores it from
    host memory instead of loading a checkpoint. 0: off. Costs ``keep`` + 1 copies of the
    parameters and optimizer moments in host memory (docs/spike-response.md)."""

    keep: int = 2
    """How many snapshots the ring holds; the window proof starts from the oldest, so the
    window reaches back ``every`` x (``keep`` - 1) to ``every`` x ``keep`` steps."""

    stall_anchor: bool = True
    """A stall's window proof re-runs from the stall's onset, not from the ring's oldest snapshot.

    While a stall proof can still run, the ring also keeps (pins) the newest snapshot at
    or before the step where the stall rule's best window ended, and the batches since --
    one more copy of the state, released when the loss improves again (a later snapshot is
    pinned) or once the onset is more than (``patience`` + 2) x ``window`` steps of
    ``[ledger.stall]`` back. A stall builds over hundreds of steps: on the real set's logit
    stall (LR 0.2, two seeds) a window from the ring's oldest snapshot (72 steps) could not
    tell the fixes apart; from the onset (201 steps) the logit cap lowered the loss 4-8%,
    the most of every fix (docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ConfigError(f"--ledger.snapshots.every {self.every} / keep {self.keep}: expected every >= 0 "
                              f"(0: off), keep >= 1")


@dataclass(kw_only=True, slots=True)
class WindowConfig:
    causes: list[str] = field(default_factory=lambda: list(WINDOW_CAUSE))
    """The fixes the window proof tries, each a re-run of the window besides the unchanged one.

    ``lr`` (every step's learning rate x ``lr_factor``: the learning rate), ``adam`` (beta2
    ``beta2``, epsilon ``eps``: the optimizer state), ``eps`` (Adam's epsilon raised to
    ``eps_fix``: the optimizer state), ``logit_cap`` (the attention logits soft-capped at
    ``logit_cap``: logit growth) and ``zloss`` (z-loss at ``zloss``: the output logits). A
    fix that would change nothing here (the run already has it) is not run. Each removes
    the spike or not, at a cost (its loss over the window's last ``cost_steps`` steps
    against the unchanged run's)."""

    lr_factor: float = default("lr_factor")
    """The ``lr`` fix's scale on every step's learning rate in the window."""

    beta2: float = default("beta2")
    """The ``adam`` fix's beta2 over the window (the article's section 2.6: 0.95); a group
    whose beta2 is lower keeps its own."""

    eps: float = default("eps")
    """The ``adam`` fix's epsilon over the window; a group whose epsilon is larger keeps its
    own. A run already at ``beta2`` and ``eps`` does not run the fix (it would change nothing)."""

    eps_fix: float = default("eps_fix")
    """The ``eps`` fix: Adam's epsilon raised to this over the window (a group whose epsilon
    is larger keeps its own). 1e-6 removed the memorisation plateau's spikes on the tiny
    model (docs/benchmarks.md)."""

    logit_cap: float = default("logit_cap")
    """The ``logit_cap`` fix: every attention logit soft-capped at this (``cap x tanh(logit /
    cap)``, Gemma 2's) over the window."""

    zloss: float = default("zloss")
    """The ``zloss`` fix: the loss's z-loss weight over the window (PaLM's 1e-4)."""

    cost_steps: int = 5
    """A fix's cost is its mean loss over the window's last this many steps, against the
    unchanged re-run's."""

    control: float = 1.1
    """The window's control: one more re-run with every step's learning rate x this.

    A perturbation of the trajectory that is no fix (a larger LR removes no LR-driven
    spike). Where it removes the spike too, the spike hangs on the trajectory's details and
    the fixes that removed it prove nothing (measured on the memorisation plateau, issue
    67: every fix "removed" a spike there). 0: no control."""

    max_proofs: int = 2
    """Window proofs of spikes per process (each costs (len(causes) + 1) x the window's
    steps of forward/backward and updates); later ``not_data`` flags are recorded unproven."""

    max_stall_proofs: int = 1
    """Window proofs of stalls per process, a budget apart from ``max_proofs``: a run that
    spikes before it stalls would otherwise have spent every proof before the stall (the
    real set's logit stall did)."""

    def __post_init__(self) -> None:
        if self.max_proofs < 0 or self.max_stall_proofs < 0:
            raise ConfigError(f"--ledger.window.max_proofs {self.max_proofs} / max_stall_proofs "
                              f"{self.max_stall_proofs}: expected both >= 0")
        bad = [c for c in self.causes if c not in WINDOW_CAUSE]
        if bad:
            raise ConfigError(f"--ledger.window.causes {','.join(bad)}: expected some of {', '.join(WINDOW_CAUSE)}")
        if not (self.eps_fix > 0 and self.logit_cap > 0 and self.zloss > 0 and self.cost_steps >= 1):
            raise ConfigError(f"--ledger.window.eps_fix {self.eps_fix} / logit_cap {self.logit_cap} / zloss "
                              f"{self.zloss} / cost_steps {self.cost_steps}: expected each > 0 (cost_steps >= 1)")
        if self.control != 0 and self.control <= 1:
            raise ConfigError(f"--ledger.window.control {self.control}: expected a factor > 1 on the learning rate "
                              f"(a perturbation in the direction no LR fix takes), or 0 for no control")
        if not 0 < self.lr_factor < 1 or not 0 < self.beta2 < 1 or not self.eps > 0:
            raise ConfigError(f"--ledger.window.lr_factor {self.lr_factor} / beta2 {self.beta2} / eps {self.eps}: "
                              f"expected lr_factor and beta2 in (0, 1), eps > 0")


@dataclass(kw_only=True, slots=True)
class ResponseSections(Configurable.Config):
    """The response's eight sections, declared once: ``Recovery.Config`` is them, and the
    ledger's table (``Ledger.Config``) extends them, so that a user sets each as
    ``[ledger.<name>]`` (``--ledger.<name>.<field>``) and the response is built from the
    sections the user set (``Recovery.Config.of``)."""

    response: ResponseConfig = field(default_factory=lambda: ResponseConfig())
    """What the response may change (the policy) and what a flagged step does (the
    action or recovery ladder) (``[ledger.response]``)."""

    proof: ProofConfig = field(default_factory=lambda: ProofConfig())
    """The proof at the alarm: which flags, the note budget, the executions' tolerance
    (``[ledger.proof]``)."""

    adam_check: AdamCheckConfig = field(default_factory=lambda: AdamCheckConfig())
    """The proof's optimizer-state test (``[ledger.adam_check]``)."""

    conviction: ConvictionConfig = field(default_factory=lambda: ConvictionConfig())
    """What convicting data needs: the quarantine's bound, a stable run, the content
    look-back (``[ledger.conviction]``)."""

    rollback: RollbackConfig = field(default_factory=lambda: RollbackConfig())
    """In-process rollbacks: how far back, how many steps skipped, how many
    (``[ledger.rollback]``)."""

    breaker: BreakerConfig = field(default_factory=lambda: BreakerConfig())
    """The circuit breaker on automatic actions (``[ledger.breaker]``)."""

    snapshots: SnapshotsConfig = field(default_factory=lambda: SnapshotsConfig())
    """Host-memory snapshots: the ring a window proof re-runs from and a rollback
    restores (``[ledger.snapshots]``)."""

    window: WindowConfig = field(default_factory=lambda: WindowConfig())
    """The window proof's fixes and budget (``[ledger.window]``)."""
