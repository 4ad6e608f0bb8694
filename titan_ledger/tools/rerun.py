"""``replay rerun``: re-execute the steps before a spike from a checkpoint, under counterfactual variants.

The design article's self-test: replay the batch at the same consumed-samples
position -- bad data reproduces, a bf16 or hardware glitch does not. A rerun
loads checkpoint C (default: the last complete one at or before T-1), trains
C+1 ... T+N again with the recorded data (the data position is in the
checkpoint; the sample ids are checked against the original's data ledger) in
its own folder ``<dump>/rerun/<variant>/`` (the checkpoint step-C is a symlink
to the original's, so the run's own ledgers and checkpoints are never touched),
and compares every step with the original ledger: each signal's relative
difference, and whether it is bit-equal. The verdict and each variant's numbers
at T are kept in ``<dump>/<ledger>/rerun/step<T>.json`` (one JSON line; the
incident page of ``titan_ledger.report`` shows it).

Variants (``--variant``, repeatable; a counterfactual changes one thing):

  same        nothing (reproducibility)
  skip        step T's data consumed without training (``--ledger.skip.steps T``); from
              ``diagnose --rerun``, every step of the window whose rows hold the
              documents the verdict named (a planted document spans several steps)
  lr=X        the learning rate scaled by X over the window (the checkpoint restores
              the optimizer's param-group LR and torchtitan rebuilds the scheduler's
              base LR from the config, so a plain ``--optimizer.lr`` would only act
              from the second step; ``--ledger.rehearsal.rerun lr_scale=X`` scales both right
              after the load; the rows' ``lr`` shows it)
  eps=X       Adam epsilon (the checkpoint restores the param groups' eps, so it is
              overridden after the load the same way: ``--ledger.rehearsal.rerun eps=X``)
  beta2=X     Adam beta2 from the load on, each parameter's bias-corrected second
              moment kept (``--ledger.rehearsal.rerun beta2=X``): does v lagging the gradients
              make the spike? "not applicable" when the run's beta2 is <= X
  clip=X      ``--training.max_norm X``
  logit_cap=X every attention score soft-capped at X (``X * tanh(s / X)``, Gemma 2's
              softcap) over the window (``--ledger.rehearsal.rerun logit_cap=X``): does the
              spike need the attention logits to reach their level?
  swap        step T's batches rotated across DP ranks (``--ledger.rehearsal.inject T:0:swap``:
              DP rank r trains on rank (r+1) % dp's batch): does the anomaly (the
              spike event's suspect DP rank, else ``loss_max_rank``) follow the data
              to rank r-1 (bad_data) or stay on its rank (a rank-local fault)?
  fp32        ``--training.mixed_precision_param float32`` where the run computed in
              bf16 (FSDP2's param dtype; also on the CPU backend); "not applicable"
              for fp32 runs (no launch)

The rerun keeps ``--training.steps`` (the LR schedule depends on it) and stops after
T+N with ``--ledger.rehearsal.rerun stop=T+N``; it writes no checkpoint of its own
(``--checkpoint.interval`` is set past the end). ``--ledger.rehearsal.inject`` data kinds
(repeat/random: they *are* the run's data) are kept; ``bitflip`` (a hardware
fault, :mod:`titan_ledger.faults`) is dropped, so it is not reproduced.

"Spike present at T" in a rerun: its signals at T equal the original's (bit-equal
or within ``REL_TOL``: the original's numbers are the spike, whether or not a rule
flagged T), or its trainer flagged T (spikes.jsonl), or its grad norm at T is
within ``GRAD_TOL`` (10%) of the original's and at least ``MIN_RATIO`` (2x) the
original's median grad norm over the 50 trained steps before T, or (a loss spike
without a grad-norm one, as the loss climbing after an LR jump) the original's loss
at T is >= 5% over its pre-spike median and the rerun keeps half that excess
(``loss_like``). Under ``skip`` step T does not train; the spike counts as present
there when any later step of the window is flagged or meets the grad or loss test.

Verdict: not reproduced under ``same`` -> ``hardware`` (non-determinism or a
hardware fault: the rerun saw the same data from the same state); reproduced
under ``same`` -> deterministic, and the first counterfactual that removes it names
the cause: ``skip`` -> bad_data, ``lr`` -> lr, ``fp32`` -> bf16, ``beta2`` / ``eps``
-> optimizer_state, ``logit_cap`` -> logit_growth, ``clip`` -> clip. None removes it ->
``unproven``. A step T that is no spike in the original (not flagged, and neither the
grad nor the loss test holds for its own numbers) -> ``unproven`` with ``not_a_spike``:
a counterfactual cannot remove what is not there (``skip`` would look like a cure).

``diagnose --rerun`` first runs the variants its heuristic verdict calls for
(:data:`PLAN_FOR`); when the spike reproduces under ``same`` and none of them
removes it, it escalates through the other counterfactuals (:data:`ESCALATION`,
most specific first, ``lr`` last because a lower LR damps almost any spike) until
one removes it or the step budget is spent: a wrong heuristic costs reruns, not
the verdict.

Determinism: on CPU with gloo the debug run is bit-deterministic (two ``same``
reruns and a ``same`` rerun against the original give bit-equal signals at every
step; ``tests/e2e/test_rerun_e2e.py``). On GPU, pass torchtitan's
``--debug.deterministic`` to the original run (and so to the rerun); without it,
cuBLAS/NCCL reductions differ in the last bits and signals are compared with the
relative tolerance ``REL_TOL`` (1e-3): a step is "equal within tolerance" when
every signal's relative difference is at most that.

Examples::

    python -m titan_ledger.replay rerun --dump-folder /tmp/a --step 8 --variant same --variant skip \\
        -- --job.config_file train_configs/debug_cpu.toml --training.steps 12 --checkpoint.enable \\
        --checkpoint.interval 4 --ledger.spike.window 8 --ledger.rehearsal.inject 8:1:repeat
    python -m titan_ledger.replay rerun --dump-folder /tmp/a --step 8 --from 4 --after 2 \\
        --variant lr=0.5 --variant eps=1e-6 --json -- <the original run's training flags>
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from titan_ledger.errors import TitanLedgerError

#: signals compared step by step
KEYS = ("loss", "loss_max", "loss_max_rank", "grad_norm", "grad_norm_clipped", "num_zeros",
        "param_norm", "max_logit", "lr", "consumed_samples")
GRAD_TOL = 0.10  # rerun grad norm at T within 10% of the original's ...
MIN_RATIO = 2.0  # ... and >= 2x the original's pre-spike median: the spike is present
REL_TOL = 1e-3  # "equal within tolerance" for non-deterministic (GPU) runs
LOSS_EXCESS = 0.05  # a loss >= 5% over its pre-spike median is a loss spike (the rules' loss_jump) ...
LOSS_KEPT = 0.5  # ... present in a rerun that keeps at least half of that excess
PRE = 50  # trained steps before T that describe "normal"
#: a counterfactual that removes the spike -> the cause it proves (priority order)
CAUSE_OF = {"skip": "bad_data", "lr": "lr", "fp32": "bf16", "beta2": "optimizer_state",
            "eps": "optimizer_state", "logit_cap": "logit_growth", "clip": "clip"}
CAUSES = ("hardware", *CAUSE_OF.values(), "unproven")
#: diagnose's heuristic verdict -> the variants that test it
PLAN_FOR = {"bad_data": ["same", "skip"], "lr": ["same", "lr"],
            "optimizer_state": ["same", "beta2", "eps=1e-6"], "bf16": ["same", "fp32"],
            "logit_growth": ["same", "fp32", "logit_cap"], "divergence": ["same", "skip"],
            "hardware": ["same"], "transient": ["same"], "unknown": ["same"]}
#: after an unproven plan: the other counterfactuals, most specific first ("lr",
#: "beta2" and "logit_cap" without a value take theirs from the ledger and the run's
#: config: :func:`ledger_values`)
ESCALATION = ("skip", "fp32", "beta2", "eps=1e-6", "logit_cap", "lr")
HUGE_INTERVAL = 1_000_000_000


class RerunError(TitanLedgerError):
    """A rerun that cannot be planned, run or compared (one line, exit 2)."""


# --------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    kind: str  # same | skip | swap | lr | eps | clip | logit_cap | fp32
    value: float | None = None
    #: skip: the steps to skip (empty: the spike step alone)
    steps: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        if self.kind == "skip" and self.steps:
            return f"skip={_ranges(list(self.steps))}"
        return self.kind if self.value is None else f"{self.kind}={self.value:g}"

    def slug(self, step: int) -> str:
        if self.kind == "skip":
            return "skip" + (_ranges(list(self.steps)).replace(",", "_") if self.steps else str(step))
        return self.name.replace("=", "_")

    def skip_list(self, step: int) -> list[int]:
        return sorted(self.steps) if self.steps else [step]


#: kinds whose value ``diagnose --rerun`` may take from the ledger (:func:`ledger_values`)
_VALUE_FROM_LEDGER = ("lr", "logit_cap", "beta2")


def parse_variant(spec: str, allow_open: bool = False) -> Variant:
    """``same``, ``skip``, ``skip=28-29``, ``lr=0.5``, ...; with ``allow_open``, ``lr``
    and ``logit_cap`` without a value (filled in by :func:`ledger_values`)."""
    kind, eq, val = spec.strip().partition("=")
    if kind in ("same", "skip", "fp32", "swap") and not eq:
        return Variant(kind)
    if kind == "skip" and eq:
        from titan_ledger.data.layout import parse_skip_steps
        from titan_ledger.errors import TitanLedgerError as _E

        try:
            windows = parse_skip_steps(val)
        except _E:
            windows = []
        if windows:
            return Variant("skip", steps=tuple(s for a, b in windows for s in range(a, b + 1)))
    if allow_open and kind in _VALUE_FROM_LEDGER and not eq:
        return Variant(kind)
    if kind in ("lr", "eps", "clip", "logit_cap", "beta2") and eq:
        try:
            v = float(val)
        except ValueError:
            v = math.nan
        if math.isfinite(v) and v > 0 and not (kind == "beta2" and v >= 1):
            return Variant(kind, v)
    raise RerunError(f"--variant {spec!r}: one of same, skip, skip=A-B, swap, lr=X, eps=X, beta2=X (< 1), "
                     f"clip=X, logit_cap=X, fp32 (X > 0)")


def ledger_values(v: Variant, rows: list[dict], step: int, config=None) -> Variant:
    """Fill in an open ``lr`` / ``logit_cap`` / ``beta2`` variant from the original's
    signals and config (pure).

    ``lr``: after an LR jump (``diagnose.lr_jump``: one step-to-step rise >= 2x and
    the LR at the spike >= 2x its median over the ``PRE`` steps before), the scale that
    undoes it (median / LR at T); otherwise 0.5.
    ``logit_cap``: half the max attention logit at the spike, only when that logit is
    >= diagnose's danger level (100); below it there is no growth to cap and a cap
    at half an ordinary logit would remove almost any spike (value 0: not applicable).
    ``beta2``: 0.95 for a run above it, else the run's (1 - beta2) doubled (0.9 for
    torchtitan's default 0.95): v following the gradients twice as fast."""
    if v.value is not None or v.kind not in _VALUE_FROM_LEDGER:
        return v
    at = next((r for r in rows if r["step"] == step), {})
    if v.kind == "lr":
        from titan_ledger.tools.diagnose import Thresholds, lj_hit, lr_jump

        lj = lr_jump(rows, step, PRE)
        if lj_hit(lj, Thresholds().lr_jump):
            return Variant("lr", float(f"{1 / lj['lr_ratio']:.3g}"))
        return Variant("lr", 0.5)
    if v.kind == "beta2":
        b2 = _beta2_of(config) if config is not None else 0.95
        return Variant("beta2", 0.95 if b2 > 0.95 else float(f"{1 - 2 * (1 - b2):.4g}"))
    from titan_ledger.tools.diagnose import Thresholds

    ml = _num(at.get("max_logit"))
    if ml is None or not math.isfinite(ml) or ml < Thresholds().logit_level:
        return Variant("logit_cap", 0.0)  # no logit growth to cap: not applicable (variant_args)
    return Variant("logit_cap", float(f"{0.5 * ml:.3g}"))


def variant_args(v: Variant, step: int, config) -> tuple[list[str], dict[str, float]] | None:
    """Extra training flags and ``--ledger.rehearsal.rerun`` overrides of a variant; None when it
    does not apply to this run (fp32 on an fp32 or CPU run)."""
    if v.kind == "same":
        return [], {}
    if v.kind == "skip":
        windows = [*config.ledger.skip.steps, *(str(s) for s in v.skip_list(step))]
        return ["--ledger.skip.steps", ",".join(windows)], {}
    if v.kind == "swap":
        kept = [p for p in (config.ledger.rehearsal.inject or "").split(",") if p.strip() and not p.strip().endswith(":bitflip")]
        return ["--ledger.rehearsal.inject", ",".join([*kept, f"{step}:0:swap"])], {}
    if v.kind == "lr":
        return [], {"lr_scale": v.value}
    if v.kind == "eps":
        return [], {"eps": v.value}
    if v.kind == "logit_cap":
        if not v.value:
            return None  # ledger_values: the max logit at T is below the danger level
        return [], {"logit_cap": v.value}
    if v.kind == "beta2":
        if v.value >= 1 or v.value >= _beta2_of(config):
            return None  # the run's beta2 is already this low: nothing to change
        return [], {"beta2": v.value}
    if v.kind == "clip":
        return ["--training.max_norm", f"{v.value:g}"], {}
    if v.kind == "fp32":
        if config.training.mixed_precision_param == "float32":
            return None
        return ["--training.mixed_precision_param", "float32"], {}
    raise AssertionError(v)


def _beta2_of(config) -> float:
    """The first param group's Adam beta2 (torchtitan 0.3.0: optimizer_kwargs["betas"])."""
    try:
        return float(config.optimizer.param_groups[0].optimizer_kwargs.get("betas", (0.9, 0.999))[1])
    except (AttributeError, IndexError, TypeError):
        return 1.0


# --------------------------------------------------------------------------- planning
@dataclass
class Plan:
    dump: Path
    step: int
    load_step: int
    stop: int
    variants: list[Variant]
    checkpoint_folder: str = "checkpoint"
    ledger_folder: str = "ledger"

    @property
    def steps_per_variant(self) -> int:
        return self.stop - self.load_step

    def folder(self, v: Variant) -> Path:
        return self.dump / "rerun" / v.slug(self.step)

    def budget_line(self, n_launch: int | None = None) -> str:
        n = len(self.variants) if n_launch is None else n_launch
        return (f"rerun budget: {n} variant(s) x {self.steps_per_variant} steps = "
                f"{n * self.steps_per_variant} training steps (checkpoint step-{self.load_step} -> "
                f"step {self.stop}; spike at step {self.step})")


def make_plan(dump, step: int, variants: list[Variant], *, load_step: int | None = None, after: int = 1,
              checkpoints: list[int], trained: list[int], last_step: int,
              checkpoint_folder: str = "checkpoint", ledger_folder: str = "ledger") -> Plan:
    """Pure: pick the checkpoint and the window. ``checkpoints``: complete checkpoint
    steps of the original; ``trained``: its trained steps; ``last_step``: its last
    recorded step."""
    if after < 0:
        raise RerunError(f"--after {after}: give 0 or more steps after the spike")
    if step not in set(trained):
        raise RerunError(f"--step {step}: not a trained step of the run (it trained steps "
                         f"{_ranges(trained)})")
    if load_step is None:
        usable = [c for c in checkpoints if c <= step - 1]
        if not usable:
            raise RerunError(f"--step {step}: no complete checkpoint at or before step {step - 1} "
                             f"(checkpoints: {checkpoints or 'none'}); the original run needs "
                             f"--checkpoint.enable with an --checkpoint.interval below the spike")
        load_step = usable[-1]
    elif load_step not in checkpoints:
        raise RerunError(f"--from {load_step}: not a complete checkpoint of the run (checkpoints: "
                         f"{checkpoints or 'none'})")
    elif load_step >= step:
        raise RerunError(f"--from {load_step}: the checkpoint must be before the spike step {step}")
    stop = min(step + after, last_step)
    if not variants:
        variants = [Variant("same")]
    seen = []
    for v in variants:
        if v not in seen:
            seen.append(v)
    return Plan(Path(dump), step, load_step, stop, seen, checkpoint_folder, ledger_folder)


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    out, a = [], steps[0]
    prev = a
    for s in steps[1:] + [None]:
        if s is None or s != prev + 1:
            out.append(f"{a}" if a == prev else f"{a}-{prev}")
            if s is not None:
                a = s
        if s is not None:
            prev = s
    return ",".join(out)


def strip_train_args(train_args: list[str], drop_inject: bool = False) -> list[str]:
    """The original's flags minus what the rerun sets itself: the dump folder, the
    checkpoint step to load, and ``bitflip`` injections (a fault is not data)."""
    from titan_ledger.config.toml_frontend import alias_cli

    train_args = alias_cli(train_args)  # the flat [ledger] flags of earlier releases, renamed
    out, i = [], 0
    drop = {"--job.dump_folder", "--dump_folder", "--checkpoint.load_step", "--ledger.rehearsal.rerun"}
    while i < len(train_args):
        a = train_args[i]
        key, eq, val = a.partition("=")
        if key in drop:
            i += 1 if eq else 2
            continue
        if key == "--ledger.rehearsal.inject":
            spec = val if eq else (train_args[i + 1] if i + 1 < len(train_args) else "")
            i += 1 if eq else 2
            kept = [p for p in spec.split(",") if p.strip() and not p.strip().endswith(":bitflip")]
            if kept and not drop_inject:
                out += ["--ledger.rehearsal.inject", ",".join(kept)]
            continue
        out.append(a)
        i += 1
    return out


# --------------------------------------------------------------------------- comparing
def _num(x) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def rel_diff(a, b) -> float | None:
    fa, fb = _num(a), _num(b)
    if fa is None or fb is None:
        return None
    if fa == fb or (math.isnan(fa) and math.isnan(fb)):
        return 0.0
    if not (math.isfinite(fa) and math.isfinite(fb)):
        return math.inf
    return abs(fa - fb) / max(abs(fa), abs(fb), 1e-30)


def _bits_equal(a, b) -> bool:
    fa, fb = _num(a), _num(b)
    if fa is None or fb is None:
        return a == b
    return fa == fb or (math.isnan(fa) and math.isnan(fb))


def compare_rows(orig: dict[int, dict], rerun: dict[int, dict], first: int, last: int,
                 keys=KEYS) -> list[dict]:
    """Per step in [first, last]: each signal's relative difference, bit-equality."""
    out = []
    for s in range(first, last + 1):
        o, r = orig.get(s), rerun.get(s)
        row: dict[str, Any] = {"step": s}
        if o is None or r is None:
            row.update(missing="original" if o is None else "rerun", bit_equal=False)
            out.append(row)
            continue
        if o.get("skipped") or r.get("skipped"):
            row.update(skipped={"original": bool(o.get("skipped")), "rerun": bool(r.get("skipped"))},
                       bit_equal=bool(o.get("skipped")) == bool(r.get("skipped")))
            out.append(row)
            continue
        diffs = {k: rel_diff(o.get(k), r.get(k)) for k in keys if k in o or k in r}
        row["rel_diff"] = diffs
        row["max_rel_diff"] = max((d for d in diffs.values() if d is not None), default=0.0)
        row["bit_equal"] = all(_bits_equal(o.get(k), r.get(k)) for k in keys if k in o or k in r)
        out.append(row)
    return out


def pre_median(orig_rows: list[dict], step: int, key: str = "grad_norm") -> float | None:
    xs = [x for x in (_num(r.get(key)) for r in orig_rows
                      if not r.get("skipped") and step - PRE <= r["step"] < step) if x is not None
          and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def _pair(orig_at: dict, row: dict | None, key: str) -> tuple[float, float] | None:
    """(original, rerun) values of ``key`` at T; None when the rerun did not train T."""
    if row is None or row.get("skipped"):
        return None
    o, r = _num(orig_at.get(key)), _num(row.get(key))
    return None if o is None or r is None else (o, r)


def spike_like(orig_at: dict, row: dict | None, med: float | None) -> bool:
    """The tolerance test: grad norm within GRAD_TOL of the original spike's and
    >= MIN_RATIO x the pre-spike median."""
    pair = _pair(orig_at, row, "grad_norm")
    if pair is None:
        return False
    go, gr = pair
    if not math.isfinite(go):
        return not math.isfinite(gr)
    if not math.isfinite(gr):
        return False
    close = abs(gr - go) <= GRAD_TOL * abs(go)
    big = med is None or gr >= MIN_RATIO * med
    return close and big


def same_numbers(step_row: dict) -> bool:
    """A :func:`compare_rows` row whose signals equal the original's (bit-equal, or all
    within REL_TOL): whatever the original's numbers at that step were, the rerun has them."""
    d = step_row.get("max_rel_diff")
    return bool(step_row.get("bit_equal")) or (d is not None and d <= REL_TOL)


def loss_like(orig_at: dict, row: dict | None, med_loss: float | None) -> bool:
    """The loss test, for a spike the grad norm does not show (the loss climbing for
    steps after an LR jump, grad norm under 2x): the original's loss at T is >=
    (1 + LOSS_EXCESS) x its pre-spike median, and the rerun's keeps >= LOSS_KEPT of
    that excess. A non-finite original loss needs a non-finite rerun loss."""
    pair = _pair(orig_at, row, "loss")
    if pair is None or med_loss is None or not math.isfinite(med_loss) or med_loss <= 0:
        return False
    lo, lr_ = pair
    if not math.isfinite(lo):
        return not math.isfinite(lr_)
    excess = lo - med_loss
    if excess < LOSS_EXCESS * med_loss:
        return False
    return not math.isfinite(lr_) or lr_ - med_loss >= LOSS_KEPT * excess


@dataclass
class VariantResult:
    variant: str
    kind: str
    folder: str | None
    applicable: bool = True
    reused: bool = False
    seconds: float | None = None
    present: bool | None = None
    original_spike: bool | None = None  # is T a spike in the original at all (flagged, grad or loss test)
    flagged: list[int] = field(default_factory=list)
    at_step: dict | None = None
    original_at_step: dict | None = None
    bit_equal_steps: list[int] = field(default_factory=list)
    first_difference: int | None = None
    max_rel_diff: float | None = None
    within_tolerance: bool | None = None
    data_equal: bool | None = None
    data_mismatch: dict | None = None
    lr_ratio_at_step: float | None = None
    swap: dict | None = None  # swap: the anomaly's DP rank before/after, "follows": data | rank
    steps: list[dict] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _signals_at(row: dict | None) -> dict | None:
    if row is None:
        return None
    if row.get("skipped"):
        return {"skipped": True}
    loss, lmax = _num(row.get("loss")), _num(row.get("loss_max"))
    return {"loss": row.get("loss"), "grad_norm": row.get("grad_norm"), "max_logit": row.get("max_logit"),
            "loss_spread": (lmax - loss) if loss is not None and lmax is not None else None,
            "loss_max_rank": row.get("loss_max_rank"), "lr": row.get("lr"),
            "spike": bool(row.get("spike"))}


def compare(original, rerun_led, plan: Plan, v: Variant, folder: Path | None = None) -> VariantResult:
    """Compare a finished rerun (``RunLedger``) with the original over the plan's window."""
    from titan_ledger.tools.replay import step_ids

    res = VariantResult(v.name, v.kind, str(folder) if folder else None)
    ho, hr = original.data.header(), rerun_led.data.header()
    for key in ("fingerprint", "global_batch", "seq_len"):
        if ho.get(key) != hr.get(key):
            raise RerunError(f"the rerun's data {key} {hr.get(key)!r} differs from the original's "
                             f"{ho.get(key)!r} ({original.folder}): give the original run's training "
                             f"flags (the rerun is in {rerun_led.dump_folder})")
    orig_rows = original.signal_rows()
    o_by = {r["step"]: r for r in orig_rows}
    r_by: dict[int, dict] = {}
    for r in rerun_led.signal_rows():
        for s in range(r["step"], r.get("last_step", r["step"]) + 1):
            r_by[s] = r
    first, last = plan.load_step + 1, plan.stop
    o1, r1 = o_by.get(first), r_by.get(first)
    if v.kind != "lr" and o1 and r1 and not o1.get("skipped") and not r1.get("skipped"):
        # flags that change the LR schedule (--training.steps, --optimizer.lr, warmup) show
        # in the first step's LR; the checkpoint restored the schedule's position
        for key in ("lr", "consumed_samples"):
            if not _bits_equal(o1.get(key), r1.get(key)):
                raise RerunError(f"the {v.name} rerun's {key} at step {first} is {r1.get(key)}, the "
                                 f"original's {o1.get(key)}: give the original run's training flags "
                                 f"(the rerun is in {rerun_led.dump_folder})")
    res.steps = compare_rows(o_by, r_by, first, last)
    for row in res.steps:
        if row.get("bit_equal"):
            res.bit_equal_steps.append(row["step"])
        elif res.first_difference is None:
            res.first_difference = row["step"]
    diffs = [row["max_rel_diff"] for row in res.steps if "max_rel_diff" in row]
    res.max_rel_diff = max(diffs) if diffs else None
    res.within_tolerance = res.max_rel_diff is not None and res.max_rel_diff <= REL_TOL
    # the data: the same sample ids per step and DP rank (a skipped step consumed them)
    a, b = step_ids(original.data), step_ids(rerun_led.data)
    res.data_equal = True
    for s in range(first, last + 1):
        ka, kb = a.get(s), b.get(s)
        norm = lambda k: {r: tuple(x for x in ids if x != "skipped") for r, ids in (k or {}).items()}  # noqa: E731
        if norm(ka) != norm(kb):
            res.data_equal = False
            res.data_mismatch = {"step": s, "original": {str(r): list(x) for r, x in norm(ka).items()},
                                 "rerun": {str(r): list(x) for r, x in norm(kb).items()}}
            break
    T = plan.step
    o_at = o_by.get(T)
    res.original_at_step = _signals_at(o_at)
    res.at_step = _signals_at(r_by.get(T))
    med, med_loss = pre_median(orig_rows, T), pre_median(orig_rows, T, "loss")
    res.flagged = sorted(s for s in rerun_led.spike_steps() if first <= s <= last)
    o_t = o_at or {}
    res.original_spike = (T in original.spike_steps() or spike_like(o_t, o_t, med)
                          or loss_like(o_t, o_t, med_loss))
    like = lambda s: spike_like(o_t, r_by.get(s), med) or loss_like(o_t, r_by.get(s), med_loss)  # noqa: E731
    at_t = next((row for row in res.steps if row["step"] == T), {})
    if v.kind == "skip":
        trained_after = [s for s in range(T, last + 1) if r_by.get(s) and not r_by[s].get("skipped")]
        if not trained_after:  # nothing trained after the skip: "gone" would prove nothing
            res.present = None
            res.note = f"no step from {T} to {last} trained after the skip: inconclusive"
        else:
            res.present = any(s >= T for s in res.flagged) or any(like(s) for s in trained_after)
    else:
        # the original's own numbers at T are its spike, whatever the rules made of them:
        # a rerun that reproduces them (bit-equal or within REL_TOL) has the spike
        res.present = same_numbers(at_t) or T in res.flagged or like(T)
    if v.kind == "swap":  # does the anomaly follow the data to rank r-1, or stay on its rank?
        dp = int(ho.get("dp_size") or 0) or len(original.data.ranks())
        ev_o = next((e for e in original.spike_events() if e["step"] == T), {})
        ev_r = next((e for e in rerun_led.spike_events() if e["step"] == T), {})
        k = ev_o.get("suspect_dp_rank", (o_at or {}).get("loss_max_rank"))
        k2 = ev_r.get("suspect_dp_rank", (r_by.get(T) or {}).get("loss_max_rank"))
        res.swap = {"original_rank": k, "rerun_rank": k2, "data_moved_to": None if k is None else (k - 1) % dp}
        if k is not None and k2 is not None and dp > 1:
            res.swap["follows"] = "data" if k2 == (k - 1) % dp else ("rank" if k2 == k else None)
    lr_o, lr_r = _num((o_at or {}).get("lr")), _num((r_by.get(T) or {}).get("lr"))
    if lr_o and lr_r is not None:
        res.lr_ratio_at_step = lr_r / lr_o
    return res


# --------------------------------------------------------------------------- verdict
def verdict(results: list[VariantResult], step: int, heuristic: str | None = None) -> dict:
    """Which cause the reruns prove, with the evidence (pure)."""
    by = {r.kind: r for r in results if r.applicable and r.present is not None}
    same = by.get("same")
    evidence: list[str] = []
    if any(r.original_spike is False for r in results):
        # a counterfactual "removes" a spike only if there was one: at a quiet step every
        # variant would look like a cure (skip first: "bad_data, proven")
        o = next((r.original_at_step for r in results if r.original_at_step), None) or {}
        evidence.append(f"step {step} is not a spike in the original run: not flagged, grad norm "
                        f"{o.get('grad_norm')} under {MIN_RATIO:g}x its pre-spike median, loss {o.get('loss')} "
                        f"under {1 + LOSS_EXCESS:g}x its median: there is nothing for a counterfactual to remove")
        out = {"step": step, "cause": "unproven", "proven": False, "evidence": evidence, "not_a_spike": True}
        if heuristic is not None:
            out.update(heuristic=heuristic, heuristic_confirmed=False)
        return out
    for r in results:
        if not r.applicable:
            evidence.append(f"{r.variant}: not applicable ({r.note})")
    cause, proven = None, False
    if same is not None:
        at, o = same.at_step or {}, same.original_at_step or {}
        if not same.present:
            cause, proven = "hardware", True
            evidence.append(
                f"same: NOT reproduced at step {step}: grad norm {at.get('grad_norm')} vs the original's "
                f"{o.get('grad_norm')}; the rerun saw the same data from the same checkpoint"
                + (f" and was bit-equal through step {_bit_equal_through(same)}" if same.bit_equal_steps else "")
                + ": non-determinism or a hardware fault")
        else:
            evidence.append(f"same: reproduced at step {step} (grad norm {at.get('grad_norm')} vs "
                            f"{o.get('grad_norm')}"
                            + (", bit-equal" if step in same.bit_equal_steps else
                               f", max relative difference {_fmt(same.max_rel_diff)}") + "): deterministic")
    if cause is None:
        gone = []
        for kind, c in CAUSE_OF.items():
            r = by.get(kind)
            if r is None:
                continue
            at = r.at_step or {}
            if r.present:
                evidence.append(f"{r.variant}: still present (loss {at.get('loss')}, grad norm "
                                f"{at.get('grad_norm')}, flagged {r.flagged or 'none'}): not {c}")
            else:
                gone.append(c)
                what = ("step skipped; no spike in the steps after" if kind == "skip" else
                        f"loss {at.get('loss')}, grad norm {at.get('grad_norm')}, flagged {r.flagged or 'none'}")
                evidence.append(f"{r.variant}: gone ({what}): {c}")
        sw = by.get("swap")
        if sw is not None and sw.swap:
            f = sw.swap.get("follows")
            evidence.append(f"swap: the anomaly (DP rank {sw.swap.get('original_rank')}) "
                            + ("followed the data to DP rank " + str(sw.swap.get("rerun_rank")) + ": bad_data"
                               if f == "data" else "stayed on DP rank " + str(sw.swap.get("rerun_rank"))
                               + ": a rank-local fault (hardware)" if f == "rank"
                               else f"went to DP rank {sw.swap.get('rerun_rank')}: inconclusive"))
            if f == "data" and "bad_data" not in gone:
                gone.append("bad_data")
            elif f == "rank" and sw.present:
                gone.append("hardware")
        if gone:
            cause = gone[0]
            proven = same is not None and same.present
            if same is None:
                evidence.append("same was not run: the spike's reproducibility is not shown")
        else:
            cause = "unproven"
    out = {"step": step, "cause": cause, "proven": proven, "evidence": evidence}
    if heuristic is not None:
        out["heuristic"] = heuristic
        out["heuristic_confirmed"] = proven and cause == heuristic
        if proven and cause != heuristic:
            out["heuristic_wrong"] = True
    return out


def _bit_equal_through(r: VariantResult) -> int | None:
    last = None
    for row in r.steps:
        if not row.get("bit_equal"):
            break
        last = row["step"]
    return last


# --------------------------------------------------------------------------- running
def _link_checkpoint(plan: Plan, folder: Path) -> None:
    src = (plan.dump / plan.checkpoint_folder / f"step-{plan.load_step}").resolve()
    dst = folder / plan.checkpoint_folder / f"step-{plan.load_step}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(src, target_is_directory=True)


def _reusable(folder: Path, record: dict) -> bool:
    f = folder / "rerun.json"
    if not f.exists():
        return False
    try:
        old = json.loads(f.read_text())
    except ValueError:
        return False
    same = all(old.get(k) == record[k] for k in ("variant", "load_step", "train_args", "overrides", "nproc"))
    return same and old.get("returncode") == 0 and old.get("stop", 0) >= record["stop"]


def run_variant(plan: Plan, v: Variant, base_args: list[str], config, nproc: int, *, fresh: bool = False,
                env=None, log=print) -> VariantResult:
    """Train one variant (or reuse an earlier identical rerun) and compare it."""
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools.launch import validate
    from titan_ledger.tools.replay import run_training

    va = variant_args(v, plan.step, config)
    folder = plan.folder(v)
    if va is None:
        if v.kind == "fp32":
            note = "the run trains in float32 already (--training.mixed_precision_param float32)"
        elif v.kind == "beta2":
            note = f"the run's Adam beta2 is already <= {v.value:g}"
        elif v.kind == "logit_cap":
            note = "the max logit at the spike is below the danger level (100): no growth to cap"
        else:
            note = "not applicable to this run"
        return VariantResult(v.name, v.kind, None, applicable=False, note=note)
    extra, over = va
    if "--ledger.rehearsal.inject" in extra:  # the variant's own --ledger.rehearsal.inject replaces the original's
        base_args = strip_train_args(base_args, drop_inject=True)
    fixed = [*base_args, *extra, "--checkpoint.enable", "--checkpoint.load_step", str(plan.load_step),
             "--checkpoint.interval", str(HUGE_INTERVAL)]
    over_s = ",".join(f"{k}={val:g}" for k, val in over.items())
    args = [*fixed, "--ledger.rehearsal.rerun", ",".join(x for x in (f"stop={plan.stop}", over_s) if x)]
    # an earlier rerun of the same variant from the same checkpoint that trained at
    # least as far is the same computation (deterministic runs): reused
    record = {"variant": v.name, "load_step": plan.load_step, "stop": plan.stop, "train_args": fixed,
              "overrides": over_s, "nproc": nproc}
    reused = not fresh and _reusable(folder, record)
    seconds = None
    if not reused:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        _link_checkpoint(plan, folder)
        validate([*args, "--job.dump_folder", str(folder)], nproc)
        logf = folder / "rerun.log"
        log(f"rerun {v.name}: training steps {plan.load_step + 1}-{plan.stop} in {folder} (log: {logf})")
        t0 = time.monotonic()
        out = run_training(nproc, folder, args, logf, env=env)
        seconds = round(time.monotonic() - t0, 1)
        (folder / "rerun.json").write_text(json.dumps({**record, "returncode": out["returncode"],
                                                       "seconds": seconds}))
        if out["returncode"] != 0:
            tail = _last_error(logf)
            raise RerunError(f"the {v.name} rerun failed (exit {out['returncode']}){': ' + tail if tail else ''}; "
                             f"log: {logf}")
    else:
        log(f"rerun {v.name}: reusing {folder} (same checkpoint, flags and window)")
    res = compare(RunLedger(plan.dump, plan.ledger_folder), RunLedger(folder, plan.ledger_folder), plan, v, folder)
    res.reused, res.seconds = reused, seconds
    if v.kind == "lr" and res.lr_ratio_at_step is not None and abs(res.lr_ratio_at_step - v.value) > 1e-6:
        raise RerunError(f"the {v.name} rerun trained step {plan.step} with lr "
                         f"{(res.at_step or {}).get('lr')} ({res.lr_ratio_at_step:g}x the original's, "
                         f"not {v.value:g}x); log: {folder / 'rerun.log'}")
    return res


def _last_error(log: Path) -> str:
    """The line that says why a rerun failed: titan_ledger's own error line, else the
    last exception line of a traceback."""
    import re

    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for pat in (r"titan_ledger[.\w]*: error: .*", r"\b\w+(Error|Exception): .*"):
        for line in reversed(lines):
            m = re.search(pat, line)
            if m:
                return m.group(0).strip()[:300]
    return ""


def prepare(dump, step: int, variants: list[str] | list[Variant], train_args: list[str], *,
            load_step: int | None = None, after: int = 1, nproc: int = 2,
            ledger_folder: str = "ledger") -> tuple[Plan, Any, list[str], int]:
    """Check the original run's flags and plan: (plan, config, rerun base flags, launches)."""
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools.launch import validate

    dump = Path(dump)
    led = RunLedger(dump, ledger_folder)
    # the original run's flags: parsed as the ranks would, and checked against the
    # dump folder's recorded layout (seq_len, global batch) before anything trains
    config = validate([*train_args, "--job.dump_folder", str(dump)], nproc)
    rows = led.signal_rows()
    trained = [r["step"] for r in rows if not r.get("skipped") and r.get("loss") is not None]
    last = max((r.get("last_step", r["step"]) for r in rows), default=0)
    vs = [x if isinstance(x, Variant) else parse_variant(x) for x in variants]
    plan = make_plan(dump, step, vs, load_step=load_step, after=after,
                     checkpoints=checkpoints_of(dump, config.checkpoint.folder), trained=trained,
                     last_step=last, checkpoint_folder=config.checkpoint.folder,
                     ledger_folder=ledger_folder)
    world = led.signals.segments[-1].header.get("world_size") if led.signals.segments else None
    if world is not None and int(world) != nproc:
        raise RerunError(f"--nproc {nproc}: the run trained on {world} processes ({led.folder}); a rerun "
                         f"must see the same DP layout: pass --nproc {world}")
    hdr = led.data.header()  # seq_len is not refused by the dump-folder check when checkpoints exist
    if hdr.get("seq_len") is not None and hdr.get("seq_len") != config.training.seq_len:
        raise RerunError(f"{dump}: the run trained with seq_len {hdr.get('seq_len')}, these flags give "
                         f"--training.seq_len {config.training.seq_len}: give the original run's flags")
    n_launch = sum(variant_args(v, step, config) is not None for v in plan.variants)
    return plan, config, strip_train_args(train_args), n_launch


def rerun(dump, step: int, variants: list[str] | list[Variant], train_args: list[str], *,
          load_step: int | None = None, after: int = 1, nproc: int = 2, ledger_folder: str = "ledger",
          fresh: bool = False, heuristic: str | None = None, log=print, prepared=None,
          escalate: list[Variant] | None = None, max_steps: int | None = None) -> dict:
    """Plan, run every variant, compare, judge. Returns the JSON-able report.

    ``escalate``: variants to try one at a time, in order, when the plan's verdict is
    ``unproven`` (reproduced under ``same``, removed by none), until one removes the
    spike or ``max_steps`` training steps in all would be exceeded."""
    plan, config, base, n_launch = prepared or prepare(
        dump, step, variants, train_args, load_step=load_step, after=after, nproc=nproc,
        ledger_folder=ledger_folder)
    if prepared is None:  # for_diagnosis printed every spike's budget before running any
        log(plan.budget_line(n_launch))
    results = [run_variant(plan, v, base, config, nproc, fresh=fresh, log=log) for v in plan.variants]
    spent = n_launch * plan.steps_per_variant
    vd = verdict(results, step, heuristic)
    escalated = []
    for v in escalate or []:
        if vd["cause"] != "unproven" or vd.get("not_a_spike"):
            break
        if any(r.kind == v.kind for r in results) or variant_args(v, step, config) is None:
            continue
        if max_steps is not None and spent + plan.steps_per_variant > max_steps:
            log(f"rerun: escalation stops before {v.name}: it would exceed {max_steps} training steps")
            break
        log(f"rerun: {', '.join(r.variant for r in results)} left the spike at step {step} unexplained; "
            f"escalating to {v.name}")
        results.append(run_variant(plan, v, base, config, nproc, fresh=fresh, log=log))
        spent += plan.steps_per_variant
        escalated.append(v.name)
        vd = verdict(results, step, heuristic)
    if escalated:
        vd["escalated"] = escalated
    rep = {"dump_folder": str(plan.dump), "step": step, "load_step": plan.load_step, "stop": plan.stop,
           "budget_steps": spent, "variants": [r.to_json() for r in results], "verdict": vd}
    write_summary(plan.dump / plan.ledger_folder, rep)
    return rep


def write_summary(ledger_dir: Path, rep: dict) -> Path:
    """``<ledger>/rerun/step<T>.json``: one line, the verdict and each variant's row at T
    (what ``titan_ledger.report``'s incident page shows); written whole (tmp + rename)."""
    keep = ("variant", "applicable", "present", "original_spike", "at_step", "original_at_step", "flagged",
            "bit_equal_steps", "first_difference", "max_rel_diff", "data_equal", "lr_ratio_at_step", "swap",
            "folder", "note")
    summary = {"step": rep["step"], "load_step": rep["load_step"], "stop": rep["stop"],
               "verdict": rep["verdict"], "variants": [{k: v.get(k) for k in keep} for v in rep["variants"]]}
    folder = Path(ledger_dir) / "rerun"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step{rep['step']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary) + "\n")
    os.replace(tmp, path)
    return path


def for_diagnosis(dump, results: list[dict], train_args: list[str], *, nproc: int = 2, after: int = 1,
                  max_steps: int = 200, ledger_folder: str = "ledger", fresh: bool = False,
                  log=print, escalate: bool = True) -> None:
    """``diagnose --rerun``: for each diagnosed spike, run the variants its heuristic
    verdict calls for (:data:`PLAN_FOR`) within a training-step budget printed
    first, escalate through :data:`ESCALATION` when they leave it unexplained, and
    attach the report (``res["rerun"]``) with the proven cause."""
    from titan_ledger.format.reader import RunLedger

    if not train_args:
        raise RerunError("--rerun needs the original run's training flags after `--` (at least "
                         "--job.config_file X.toml), as python -m titan_ledger.replay rerun does")
    from titan_ledger.tools.diagnose import document_scores

    led = RunLedger(dump, ledger_folder)
    jobs = []
    for res in results:
        step = res["step"]
        p0 = prepare(dump, step, ["same"], train_args, after=after, nproc=nproc, ledger_folder=ledger_folder)
        plan0, config = p0[0], p0[1]
        # skip widens over the most extreme document only (the verdict's first; for any
        # other heuristic, the step's most extreme recorded one, for the escalation)
        docs = (res.get("documents") or document_scores(led, step))[:1]
        resolve = lambda spec: resolve_variant(spec, led, step, plan0.load_step, config, docs)  # noqa: E731
        variants = [resolve(v) for v in PLAN_FOR.get(res["cause"], ["same"])]
        na = [v for v in variants if variant_args(v, step, config) is None]
        if na:  # fp32 on an fp32 run: dropped; when nothing but `same` is left, test the data
            variants = [v for v in variants if v not in na]
            alone = all(v.kind == "same" for v in variants) and res["cause"] not in ("hardware", "transient")
            log(f"  step {step}: {', '.join(v.name for v in na)} not applicable to this run"
                + ("; testing skip instead" if alone else ""))
            if alone:
                variants.append(resolve("skip"))
        esc = [resolve(v) for v in ESCALATION] if escalate else []
        # the window reaches `after` steps past the last skipped one: a skip that ends the
        # window would remove the spike by leaving nothing trained after it
        last_skip = max((x for v in [*variants, *esc] if v.kind == "skip" for x in v.skip_list(step)),
                        default=step)
        p = prepare(dump, step, variants, train_args, after=after + (last_skip - step), nproc=nproc,
                    ledger_folder=ledger_folder)
        jobs.append((res, p, esc))
    total = sum(p[0].steps_per_variant * p[3] for _, p, _ in jobs)
    log(f"rerun budget: {total} training steps in all over {len(jobs)} spike(s), more only to escalate "
        f"(--rerun-max-steps {max_steps})")
    for res, p, esc in jobs:
        log(f"  step {res['step']}: heuristic {res['cause']} -> variants "
            f"{', '.join(v.name for v in p[0].variants)}: {p[0].budget_line(p[3])}")
    if total > max_steps:
        raise RerunError(f"--rerun: the reruns need {total} training steps, more than "
                         f"--rerun-max-steps {max_steps}; raise it or pick one spike with --step")
    # escalation may spend what the later spikes' planned reruns leave of max_steps
    planned = [p[0].steps_per_variant * p[3] for _, p, _ in jobs]
    left = max_steps
    for i, (res, p, esc) in enumerate(jobs):
        res["rerun"] = rerun(dump, res["step"], [], train_args, nproc=nproc, fresh=fresh,
                             heuristic=res["cause"], log=log, prepared=p, escalate=esc,
                             max_steps=left - sum(planned[i + 1:]))
        left -= res["rerun"]["budget_steps"]


def resolve_variant(spec: str, led, step: int, load_step: int, config=None,
                    documents: list[dict] | None = None, reach: int = 10) -> Variant:
    """A :data:`PLAN_FOR` / :data:`ESCALATION` entry made concrete for one spike: open
    ``lr`` / ``beta2`` / ``logit_cap`` values from the ledger and config
    (:func:`ledger_values`); ``skip`` widened to the steps from ``load_step + 1`` to
    ``step + reach`` whose rows hold one of ``documents`` (a planted document is cut
    into rows that span several steps; not when ``--ledger.rehearsal.inject`` replaced the step's
    tokens, whose tags then name documents that did not train). The caller extends the
    rerun window past the last skipped step, so that trained steps follow it."""
    v = ledger_values(parse_variant(spec, allow_open=True), led.signal_rows(), step, config)
    if v.kind != "skip" or not documents:
        return v
    if any((led.data.row(r, step) or {}).get("injected") for r in led.data.ranks_at(step)):
        return v  # --ledger.rehearsal.inject replaced the step's tokens: its tags are not what trained
    named = {(d["source"], d["doc"]) for d in documents}
    steps = {step}
    for s in range(load_step + 1, min(step + reach, led.data.last_step) + 1):
        for r in led.data.ranks_at(s):
            sd = led.data.at(s, r)
            if sd and not sd.skipped and any((t.source, seg.doc) in named for t in sd.tags
                                             for seg in t.segments):
                steps.add(s)
    return Variant("skip", steps=tuple(sorted(steps))) if steps != {step} else v


def checkpoints_of(dump: Path, folder: str) -> list[int]:
    from titan_ledger.format.reader import checkpoints

    return checkpoints(dump, folder)


# --------------------------------------------------------------------------- printing
def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def print_report(rep: dict) -> None:
    print(f"spike at step {rep['step']}: reruns from checkpoint step-{rep['load_step']} to step "
          f"{rep['stop']} ({rep['budget_steps']} training steps)")
    hdr = ("variant", "spike@T", "loss", "grad_norm", "max_logit", "spread", "lr", "bit-equal",
           "max rel diff", "data")
    table = [hdr]
    o = next((v["original_at_step"] for v in rep["variants"] if v.get("original_at_step")), None)
    if o:
        spike = next((v.get("original_spike") for v in rep["variants"] if v.get("original_spike") is not None), True)
        table.append(("original", _fmt(spike), *(_fmt(o.get(k)) for k in ("loss", "grad_norm", "max_logit",
                                                                      "loss_spread", "lr")), "", "", ""))
    for v in rep["variants"]:
        if not v["applicable"]:
            table.append((v["variant"], "n/a", "not applicable", "", "", "", "", "", "", ""))
            continue
        at = v["at_step"] or {}
        if at.get("skipped"):
            cells = ("skipped", "", "", "", "")
        else:
            cells = tuple(_fmt(at.get(k)) for k in ("loss", "grad_norm", "max_logit", "loss_spread", "lr"))
        steps = [s["step"] for s in v["steps"]]
        be = "all" if steps and v["bit_equal_steps"] == steps else (
            f"{_ranges(v['bit_equal_steps'])}" if v["bit_equal_steps"] else "none")
        table.append((v["variant"], _fmt(v["present"]), *cells, be, _fmt(v["max_rel_diff"]),
                      "equal" if v["data_equal"] else f"DIFFERS at {v['data_mismatch']['step']}"))
    widths = [max(len(str(r[i])) for r in table) for i in range(len(hdr))]
    for r in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    vd = rep["verdict"]
    print(f"verdict: {vd['cause']}{' (proven)' if vd['proven'] else ' (not proven)'}")
    for e in vd["evidence"]:
        print(f"  - {e}")
    if "heuristic" in vd:
        if vd.get("heuristic_confirmed"):
            print(f"  the heuristic verdict ({vd['heuristic']}) is confirmed")
        elif vd.get("heuristic_wrong"):
            print(f"  the heuristic verdict ({vd['heuristic']}) was WRONG: the reruns prove {vd['cause']}")
        else:
            print(f"  the heuristic verdict ({vd['heuristic']}) is neither confirmed nor refuted")
