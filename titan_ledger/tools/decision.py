"""The design article's §2.7 decision tree on recorded rows: the pure half of ``diagnose``.

Design decision: the questions -- one table, :data:`QUESTIONS` (each an id, its text,
the function that answers it from the step's rows, the cause it names), which
``classify`` walks --, the LR-jump test the rerun's ``lr`` variant shares (``lr_jump``,
``lj_hit``), "is this step a spike at all" (``spike_check``, ``spike_steps``) and the
documents of a step ranked by how far they sit from its median (``document_scores``)
are functions of ledger rows and the
data ledger, importing no other tool but :mod:`titan_ledger.tools.postmortem` (as pure:
the recorded actions at a step): :mod:`titan_ledger.tools.diagnose` (its CLI,
printing and the ``--rerun`` glue), :mod:`titan_ledger.tools.report` and
:mod:`titan_ledger.tools.rerun` all build on them, and none of those is imported
here. Importing it costs no torch: the spike rules (torch, torchtitan's Configurable)
are imported by the functions that run them offline (``_spikes``), so ``diagnose
--help`` and a read of recorded flags start in 0.15 s, not 3.3 s. The questions
themselves are listed in ``diagnose``'s docstring (its ``--help``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING

from titan_ledger.components.detection import fingerprints as fp
from titan_ledger.errors import LedgerCorrupt, LedgerError
from titan_ledger.format.proofs import describe_window
from titan_ledger.format.reader import RunLedger

if TYPE_CHECKING:
    from titan_ledger.components.detection.spikes import SpikeDetector


def _spikes():
    """The spike rules (torch and torchtitan), imported when a decision needs them: a
    reader of JSONL (``diagnose --help``, ``report``, a ledger that recorded its flags)
    does not pay for torch. The device backend is chosen first, as trainer.py does:
    ``diagnose --rerun`` parses training configs in this process."""
    from titan_ledger.rehearsal import backend

    backend.ensure_installed()
    from titan_ledger.components.detection import spikes

    return spikes

CAUSES = ("divergence", "logit_growth", "lr", "bad_data", "optimizer_state", "bf16", "hardware", "output_logits",
          "transient")


@dataclass
class Thresholds:
    pre: int = 50  # steps before the spike that describe "normal"
    post: int = 10  # steps after it that say whether it recovered
    loss_jump: float = 0.10  # "recovered" = back within 10% of the pre-spike median loss
    logit_level: float = 100.0  # §2.4: bf16 danger from ~100
    logit_rising: float = 0.7  # fraction of pre-spike steps where max_logit rose
    param_accel: float = 1.5  # late/early param-norm growth-rate ratio
    grad_trend: float = 0.10  # grad norm rose >= 10% across the pre window
    rank_gap: float = 3.0  # (loss_max - loss) at the spike vs its pre-spike median
    lr_jump: float = 2.0  # LR at the spike >= 2x its pre-spike median
    rank_gap_rel: float = 0.05  # ... and at least 5% of the loss
    plateau: float = 0.7  # last 10 pre steps' grad norm < 0.7 x the earlier median
    fallback: float = 1.5  # next step's grad norm back under 1.5 x pre median
    zeros: float = 3.0  # num_zeros off its pre median by > 3 MADs (or x2)
    glitch: float = 4.0  # Q3/Q6: grad norm >= 4x its pre median (the spike rules' grad_jump)
    doc_extreme: float = 3.0  # Q3: a document >= 3x its usual distance from its rank's median
    start: int = 5000  # F*: the run's first trained steps read for the LR schedule and "early" levels
    bars: fp.Bars = field(default_factory=fp.Bars)  # F*: the fingerprints' bars (components/detection/fingerprints.py)


def _finite(xs):
    return [x for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]


def _slope(ys):
    n = len(ys)
    if n < 2:
        return 0.0
    mx = (n - 1) / 2
    my = sum(ys) / n
    den = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / den


EVIDENCE_RULES = ("rank_separation", "doc_high", "doc_low")


#: the decision tree's order after Q0 (divergence): each question and the cause it names
#: when it is the first answered yes (Q1 names bf16 in a known bf16 run); a divergence's
#: driver is named by the same order
CAUSE_ORDER = (("F1", "optimizer_state"), ("F2", "lr"), ("Q1", "logit_growth"), ("Q2", "lr"),
               ("F3", "output_logits"), ("Q3", "bad_data"), ("Q4", "optimizer_state"), ("Q5", "bf16"),
               ("Q6", "hardware"))


@dataclass(frozen=True, slots=True)
class _Spike:
    """What every question reads about the spike at ``step``: its row, its neighbours and
    their medians, the fingerprints, the run's precision and the trainer's evidence (one
    pass over the rows, then each question a function of this)."""

    step: int
    th: Thresholds
    at: dict
    pre: list[dict]  # the trained rows of the ``th.pre`` steps before
    post: list[dict]  # ... of the ``th.post`` steps after
    trained: list[dict]
    f: dict  # the fingerprints (fp.read)
    ev: dict  # the trainer's evidence at the step (its spike event)
    param_dtype: str | None
    bf16_run: bool
    deviations: list[str] | None  # the precision audit's failed checks

    def col(self, rows: list[dict], key: str) -> list[float]:
        return _finite([r.get(key) for r in rows])

    @property
    def loss(self) -> float:
        return self.at["loss"]

    @property
    def med_loss(self) -> float:
        xs = self.col(self.pre, "loss")
        return statistics.median(xs) if xs else float("nan")

    @property
    def med_gn(self) -> float:
        xs = self.col(self.pre, "grad_norm")
        return statistics.median(xs) if xs else float("nan")

    @property
    def logits(self) -> list[float]:
        return self.col(self.pre + [self.at], "max_logit")

    @property
    def next_grad_norm(self) -> float | None:
        return self.post[0]["grad_norm"] if self.post else None

    @property
    def falls_back(self) -> bool:
        nxt, med = self.next_grad_norm, self.med_gn
        return nxt is not None and math.isfinite(med) and nxt < self.th.fallback * med


def _q0_divergence(s: _Spike):
    post_loss = s.col(s.post, "loss")
    diverged = (not math.isfinite(s.loss)) or (len(post_loss) >= 3 and math.isfinite(s.med_loss)
                                               and min(post_loss) > s.med_loss * (1 + s.th.loss_jump))
    return diverged, dict(loss=s.loss, pre_median_loss=s.med_loss,
                          post_min_loss=min(post_loss) if post_loss else None, post_steps=len(post_loss))


def _f1_adam(s: _Spike):
    if s.f["adam"]["update_per_lr"] is None:  # F1 needs the update; F2 falls back on the param norm
        s.f["adam"]["needs"] = "--ledger.update_norm"
    return fp.adam_lagging(s.f, s.th.bars), s.f["adam"]


def _f2_lr(s: _Spike):
    return fp.lr_scale(s.f, s.th.bars), {**s.f["update"], **s.f["schedule"]}


def _f3_logz(s: _Spike):
    return fp.logz_drift(s.f, s.th.bars), s.f["logz"]


def _q1_logits(s: _Spike):
    logits = s.logits
    rises = sum(1 for a, b in zip(logits, logits[1:]) if b > a) / max(1, len(logits) - 1)
    last = logits[-1] if logits else None
    return (len(logits) >= 5 and rises >= s.th.logit_rising and last >= s.th.logit_level,
            dict(max_logit=last, rising_fraction=rises, max_logit_slope=_slope(logits)))


def _q2_lr(s: _Spike):
    th = s.th
    lj = lr_jump(s.trained, s.step, th.pre)
    pn, pre_gn = s.col(s.pre, "param_norm"), s.col(s.pre, "grad_norm")
    half = len(pn) // 2
    early, late = _slope(pn[:half]), _slope(pn[half:])
    accel = late / early if early > 0 else (math.inf if late > 0 else 0.0)
    gn_trend = (statistics.mean(pre_gn[-5:]) / statistics.mean(pre_gn[:5]) - 1) if len(pre_gn) >= 10 else 0.0
    return (lj_hit(lj, th.lr_jump) or (len(pn) >= 10 and accel >= th.param_accel and gn_trend >= th.grad_trend),
            dict(lr=s.at.get("lr"), pre_median_lr=lj["pre_median_lr"], lr_ratio=lj["lr_ratio"],
                 lr_step_jump=lj["step_ratio"], lr_jump_step=lj["jump_step"], param_norm_growth_early=early,
                 param_norm_growth_late=late, accel=accel, grad_norm_trend=gn_trend))


def _q3_data(s: _Spike):
    th, ev, at, loss = s.th, s.ev, s.at, s.loss
    gaps = _finite([r.get("loss_max", math.nan) - r["loss"] for r in s.pre])
    gap = (at.get("loss_max") or math.nan) - loss
    med_gap = statistics.median(gaps) if gaps else 0.0
    # per-rank and per-document evidence (the trainer's evidence rules at this step):
    # bad data is two-sided, and a low-loss rank pushes a CLEAN rank to loss_max
    # (the evidence rules are read in both tiers: a note is weaker evidence, not none)
    ev_rules = [r for r in (*ev.get("rules", []), *ev.get("notes", [])) if r in EVIDENCE_RULES]
    # a document this many times further from its rank's median than usual (the trainer's
    # doc statistics at the step over their history median), with a finite grad norm: a
    # document, not a flipped bit, moved the gradient (the zoo's held-out "=" run and a
    # late repeated token: 4.1x and 9.5x; clean steps here reach 4.1x too, so only with
    # a grad jump)
    doc_x = max((ev[y] / ev[m] for y, m in (("doc_high_y", "doc_y_median_high"), ("doc_low_y", "doc_y_median_low"))
                 if isinstance(ev.get(y), (int, float)) and isinstance(ev.get(m), (int, float)) and ev[m] > 0),
                default=None)
    gn_at, med_gn = at.get("grad_norm"), s.med_gn
    doc_jump = (doc_x is not None and doc_x >= th.doc_extreme and isinstance(gn_at, (int, float))
                and math.isfinite(gn_at) and math.isfinite(med_gn) and gn_at >= th.glitch * med_gn)
    return ((math.isfinite(gap) and gap > th.rank_gap * max(med_gap, 1e-12) and gap > th.rank_gap_rel * abs(loss))
            or bool(ev_rules) or doc_jump,
            dict(loss_max_rank=at.get("loss_max_rank"), rank_loss=at.get("loss_max"), avg_loss=loss, gap=gap,
                 pre_median_gap=med_gap, evidence_rules=ev_rules or None, suspect_dp_rank=ev.get("suspect_dp_rank"),
                 document_vs_usual=doc_x, finite_grad_jump=doc_jump))


def _q4_plateau(s: _Spike):
    pre_gn = s.col(s.pre, "grad_norm")
    recent, earlier = pre_gn[-10:], pre_gn[:-10]
    plateau = (statistics.mean(recent) / statistics.median(earlier)) if len(earlier) >= 5 else math.nan
    return (math.isfinite(plateau) and plateau < s.th.plateau,
            dict(plateau_ratio=plateau, earlier_median_grad_norm=statistics.median(earlier) if earlier else None))


def _q5_bf16(s: _Spike):
    zeros = s.col(s.pre, "num_zeros")
    z_at = s.at.get("num_zeros")
    z_med = statistics.median(zeros) if zeros else None
    mad = statistics.median([abs(z - z_med) for z in zeros]) if zeros else None
    z_off = (z_at is not None and z_med is not None
             and (abs(z_at - z_med) > s.th.zeros * max(mad, 1.0) or (z_med > 0 and not 0.5 <= z_at / z_med <= 2)))
    return (s.falls_back and z_off and s.bf16_run,
            dict(grad_norm=s.at["grad_norm"], next_grad_norm=s.next_grad_norm, pre_median_grad_norm=s.med_gn,
                 num_zeros=z_at, pre_median_num_zeros=z_med, param_dtype=s.param_dtype,
                 precision_deviations=s.deviations))


def _q6_hardware(s: _Spike):
    gn, med_gn, loss, med_loss = s.at.get("grad_norm"), s.med_gn, s.loss, s.med_loss
    jump = isinstance(gn, (int, float)) and (not math.isfinite(gn) or (
        math.isfinite(med_gn) and med_gn > 0 and gn >= s.th.glitch * med_gn))
    loss_unmoved = math.isfinite(loss) and math.isfinite(med_loss) and loss <= med_loss * (1 + s.th.loss_jump)
    return (jump and s.falls_back and loss_unmoved and not s.bf16_run,
            dict(grad_norm=gn, pre_median_grad_norm=med_gn, next_grad_norm=s.next_grad_norm, loss=loss,
                 pre_median_loss=med_loss, param_dtype=s.param_dtype))


@dataclass(frozen=True, slots=True)
class Question:
    """One question of the tree: its id, its text (a template over the fingerprints'
    ``bars``), the function that answers it (``(answer, numbers)``) and the cause it
    names when it is the first answered yes (Q0: the divergence, which the same order
    then explains)."""

    id: str
    text: str
    answer: Callable[[_Spike], tuple]
    cause: str


#: the tree, in the order it is asked and reported; :data:`CAUSE_ORDER` is the order
#: in which the answers name a cause
QUESTIONS = (
    Question("Q0", "Q0 divergence: loss non-finite or not back after the spike", _q0_divergence, "divergence"),
    Question("F1", "F1 optimizer_state: Adam's update per unit LR >= {bars.adam_amp:g}x its pre-spike median, after "
                   "gradients <= {bars.quiet:g}x the run's first steps' (the second moment lagging them)",
             _f1_adam, "optimizer_state"),
    Question("F2", "F2 lr: the update moves the parameters >= {bars.rel_update:.0%} of their norm a step (pre-spike "
                   "median; without --ledger.update_norm, the param norm itself >= {bars.rel_norm_change:.1%}): the "
                   "LR too large for the model's scale", _f2_lr, "lr"),
    Question("F3", "F3 output_logits: log Z's max before the spike >= {bars.logz_rise:g}x the run's first steps' and "
                   ">= {bars.logz_level:g}", _f3_logz, "output_logits"),
    Question("Q1", "Q1 logit_growth: max logit rising before the spike and >= level", _q1_logits, "logit_growth"),
    Question("Q2", "Q2 lr: the LR jumped (>= lr_jump x its pre-spike median), or param-norm growth "
                   "accelerating and grad norm creeping up", _q2_lr, "lr"),
    Question("Q3", "Q3 bad_data: one DP rank's loss far above the average, or its documents far "
                   "from the others' (evidence rules)", _q3_data, "bad_data"),
    Question("Q4", "Q4 optimizer_state: grad-norm plateau below normal before the spike", _q4_plateau,
             "optimizer_state"),
    Question("Q5", "Q5 bf16: one-step jump that falls back, num_zeros off its norm, in a bf16 run", _q5_bf16, "bf16"),
    Question("Q6", "Q6 hardware: a one-step grad-norm jump that falls back, the loss unmoved, in an fp32 run",
             _q6_hardware, "hardware"),
)


def classify(rows: list[dict], step: int, th: Thresholds | None = None,
             evidence: dict | None = None, param_dtype: str | None = None,
             precision: list[dict] | None = None, start: list[dict] | None = None) -> dict:
    """Walk the decision tree (:data:`QUESTIONS`) for the spike at ``step`` over signals ``rows``.

    ``start``: the run's first trained rows (up to ``th.start`` steps; default: those of
    ``rows``), for the fingerprints' "early" levels and the LR schedule's warm-up (F1-F3,
    :mod:`titan_ledger.components.detection.fingerprints`). The fingerprints are asked first: what the
    ledger records about Adam's update, the update's size and log Z names the cause more
    directly than the article's proxies (Q1-Q6), and the article's questions still name
    the mechanism (``mechanism``: an LR that drove the attention logits up).

    ``param_dtype``: the run's compute dtype from the signals header (``float32``,
    ``bfloat16``; None: unknown -- Q5 may then name bf16 and Q6 does not name
    hardware, while Q1 names bf16 only for a known bf16 run). ``precision``: the launch's
    precision audit (signals header): its compute dtype, measured on the live model,
    overrides ``param_dtype``, and its deviations (bf16 master weights, moments or
    gradient reduction, ...) are Q5's numbers."""
    rows_p = {r["check"]: r for r in precision or []}
    if "compute dtype" in rows_p:
        param_dtype = rows_p["compute dtype"]["found"]
    th = th or Thresholds()
    trained = [r for r in rows if not r.get("skipped") and r.get("loss") is not None]
    at = next((r for r in trained if r["step"] == step), None)
    if at is None:
        raise ValueError(f"step {step} is not a trained step of this ledger")
    pre = [r for r in trained if step - th.pre <= r["step"] < step]
    bars = th.bars
    s = _Spike(step=step, th=th, at=at, pre=pre, post=[r for r in trained if step < r["step"] <= step + th.post],
               trained=trained, f=fp.read(start if start is not None else [r for r in trained if r["step"] <= step],
                                          pre, at, bars),
               ev=evidence or {}, param_dtype=param_dtype, bf16_run=param_dtype not in ("float32", "float64"),
               deviations=[f"{r['check']}: {r['found']}" for r in precision or [] if r.get("ok") is False] or None)
    checks, answers = [], {}
    for q in QUESTIONS:
        yes, numbers = q.answer(s)
        answers[q.id] = bool(yes)
        checks.append({"question": q.text.format(bars=bars), "answer": bool(yes),
                       **{k: _round(v) for k, v in numbers.items()}})

    # the tree's order, one table: the first question answered yes names the cause; a
    # divergence (Q0) is the emergency, and the same order names what drove it
    first = next((q for q, _ in CAUSE_ORDER if answers[q]), None)
    underlying = dict(CAUSE_ORDER)[first] if first else None
    if answers["Q0"]:
        cause = "divergence"
    elif first == "Q1" and s.bf16_run and param_dtype is not None:  # growing logits in a known bf16 run
        cause = "bf16"
    else:
        cause = underlying or "transient"
    f, med_gn = s.f, s.med_gn
    out = {"step": step, "cause": cause, "checks": checks,
           "grad_norm_ratio": _round(at["grad_norm"] / med_gn) if med_gn else None, "fingerprints": f}
    # how sure: each fingerprint that answered yes, as its reading over its bar (the real set's
    # LR runs: F2 at 2.7-16x; the same model at LR 3e-3: 0.03x)
    a, u = f["adam"], f["update"]
    margins = {"F1": answers["F1"] and min(a["adam_amplification"] / bars.adam_amp,
                                           bars.quiet / max(a["quiet_gradients"], 1e-30)),
               "F2": answers["F2"] and (u["relative_update_pre_median"] / bars.rel_update
                                        if u["relative_update_pre_median"] is not None
                                        else u["param_norm_change_pre_median"] / bars.rel_norm_change),
               "F3": answers["F3"] and f["logz"]["logz_rise"] / bars.logz_rise}
    out["margins"] = {k: _round(v) for k, v in margins.items() if v}
    named = underlying if cause == "divergence" else cause
    if named == "lr" and answers["F2"] and answers["Q1"]:  # the LR drove the logits: QK-norm bounds them, not the spikes (measured)
        out["mechanism"] = "logit_growth"
    if named == "lr" and answers["F2"]:  # where the update grew too large: a rerun or rollback starts before it
        out["onset"] = fp.lr_onset(start if start is not None else trained, pre, step, bars)
    logits = s.logits
    prevent = fp.prevention(named, f, logits[-1] if logits else None, bars)
    if prevent is None and s.deviations:  # the precision audit failed: whatever the cause, that is a finding
        prevent = fp.prevention("bf16", f, bars=bars)
    if prevent is not None:
        out["prevention"] = prevent
    if cause == "divergence":
        out["underlying"] = underlying
    if cause == "bad_data" or (cause == "divergence" and underlying == "bad_data"):
        out["rank"] = s.ev.get("suspect_dp_rank", at.get("loss_max_rank"))
    return out


def lr_jump(rows: list[dict], step: int, pre: int = 50) -> dict:
    """The LR's recorded jump before ``step`` (pure; shared by Q2 and the rerun's ``lr``
    scale): the LR at ``step`` over the median LR of the ``pre`` trained steps before
    it (``lr_ratio``), and the largest step-to-step ratio in that window and at
    ``step`` (``step_ratio``, at ``jump_step``). Pairs starting at step 1 are left out:
    a linear warmup doubles the LR from step 1 to 2 (and sits at exactly 2x its own
    median), which is not a jump."""
    trained = [r for r in rows if not r.get("skipped") and isinstance(r.get("lr"), (int, float))]
    win = [r for r in trained if step - pre <= r["step"] <= step]
    at = next((r for r in win if r["step"] == step), None)
    lrs = [r["lr"] for r in win if r["step"] < step]
    med = statistics.median(lrs) if lrs else None
    out = {"pre_median_lr": med, "lr_ratio": None, "step_ratio": None, "jump_step": None}
    if at is not None and med:
        out["lr_ratio"] = at["lr"] / med
    pairs = [(a, b) for a, b in zip(win, win[1:]) if a["step"] >= 2 and a["lr"] > 0]
    if pairs:
        a, b = max(pairs, key=lambda p: p[1]["lr"] / p[0]["lr"])
        out["step_ratio"], out["jump_step"] = b["lr"] / a["lr"], b["step"]
    return out


def lj_hit(lj: dict, factor: float) -> bool:
    """An LR jump: one step-to-step rise >= ``factor`` and the LR at the spike still
    >= ``factor`` x its pre-spike median."""
    return (lj["step_ratio"] is not None and lj["step_ratio"] >= factor
            and lj["lr_ratio"] is not None and lj["lr_ratio"] >= factor)


def _round(v):
    return round(v, 6) if isinstance(v, float) and math.isfinite(v) else v


def rules_of(led: RunLedger):
    """The spike rules' settings of ``led``'s run as it recorded them (attribute access,
    like ``SpikeDetector.Config``): no torch; the defaults (importing the rules) only for
    a run that recorded none."""
    from types import SimpleNamespace

    rules = led.spike_rules()
    return SimpleNamespace(**rules) if rules else _spikes().SpikeDetector.Config()


def spike_check(rows: list[dict], step: int, flagged: bool, th: Thresholds | None = None,
                det: SpikeDetector.Config | None = None) -> dict:
    """Is ``step`` a spike at all? The spike rules' numbers at that step against the
    ``th.pre`` trained steps before it (``diagnose --step`` on an ordinary step says
    so before walking the tree). ``det``: the run's rules (:func:`rules_of`)."""
    th, det = th or Thresholds(), det or _spikes().SpikeDetector.Config()
    trained = [r for r in rows if not r.get("skipped") and r.get("loss") is not None]
    at = next(r for r in trained if r["step"] == step)
    pre = [r for r in trained if step - th.pre <= r["step"] < step]
    out: dict = {"flagged": flagged}
    fires = []
    for key in ("loss", "grad_norm"):
        xs = _finite([r.get(key) for r in pre])
        v = at.get(key)
        # the ratio rule compares the loss with its recent level (the last 2 x min_history steps)
        ref = xs[-2 * det.min_history:] if key == "loss" else xs
        med = statistics.median(ref) if ref else None
        out[f"{key}_vs_median"] = _round(v / med) if med and isinstance(v, (int, float)) else None
        sd = statistics.pstdev(xs) if len(xs) >= 2 else 0.0
        z = (v - statistics.mean(xs)) / sd if sd > 0 and isinstance(v, (int, float)) else None
        out[f"{key}_zscore"] = _round(z)
        if isinstance(v, (int, float)) and not math.isfinite(v):
            fires.append("non_finite")
        elif det.zscore > 0 and z is not None and z > det.zscore:
            fires.append(f"zscore_{key}")
    gr, lr = out["grad_norm_vs_median"], out["loss_vs_median"]
    if det.ratio > 0 and gr is not None and lr is not None and gr > det.ratio and lr > 1 + det.loss_jump:
        fires.append("ratio")
    out.update(rules_firing=fires, pre_steps=len(pre), ratio_needs=det.ratio,
               loss_jump_needs=1 + det.loss_jump, zscore_needs=det.zscore)
    out["is_spike"] = bool(flagged or fires)
    return out


def spike_steps(led: RunLedger) -> list[int]:
    """Spikes the trainer flagged (spikes.jsonl), else the default rules run offline."""
    steps = led.spike_steps()
    if steps:
        return steps
    spikes = _spikes()
    return [e["step"] for e in spikes.detect_offline(led.signal_rows(), spikes.SpikeDetector.Config())]


def document_scores(led: RunLedger, step: int) -> list[dict]:
    """The documents recorded at ``step`` (each rank's highest- and lowest-loss
    segments), one entry per distinct document, most extreme first.

    A document's loss is the token-weighted mean over its recorded segments; the
    reference is the median over the distinct documents, not over segments: a
    degenerate document cut into many of a step's rows can BE the segment median (the
    zoo's repeated token at step 46 sat at 0.99x it, and a normal document at 1.52x
    was named instead), but it is one document among the few the step holds. Each
    entry is the document's most extreme segment (row, span, rank) with ``loss`` (the
    document's), ``vs_median`` (over the median document), ``segments`` and
    ``tokens``; [] when the run recorded none."""
    try:
        docs, _ = led.data.doc_losses(step)
    except LedgerError:
        return []
    by: dict[tuple[str, int], list[dict]] = {}
    for d in docs:
        if d.get("loss") and d.get("tokens"):
            by.setdefault((d["source"], d["doc"]), []).append(d)
    if not by:
        return []
    loss = {k: sum(x["loss_sum"] for x in v) / sum(x["tokens"] for x in v) for k, v in by.items()}
    ref = statistics.median(loss.values())
    out = []
    for k, segs in by.items():
        far = max(segs, key=lambda x: abs(math.log(x["loss"] / ref)))
        ranks = {}
        for x in segs:
            ranks[x["dp_rank"]] = ranks.get(x["dp_rank"], 0) + x["tokens"]
        out.append(dict(far, loss=loss[k], segment_loss=far["loss"], vs_median=loss[k] / ref,
                        segments=len(segs), tokens=sum(x["tokens"] for x in segs),
                        dp_rank=max(ranks, key=lambda r: (ranks[r], -r))))
    out.sort(key=lambda d: -abs(math.log(d["vs_median"])))
    return out


CERTAINTIES = ("proven", "evidence", "guess")


def rank_phrase(res: dict) -> str:
    """`` (DP rank r)`` after a verdict's cause, `` (DP ranks 0, 1)`` when a proof convicted
    documents on several ranks; empty when no rank is named."""
    if len(res.get("ranks") or ()) > 1:
        return f" (DP ranks {', '.join(map(str, res['ranks']))})"
    return f" (DP rank {res['rank']})" if res.get("rank") is not None else ""
#: a document "stands out" against its step when its loss is >= this many times the
#: step's median document or <= 1 / this: exp of the trainer's doc_outlier_floor (a
#: log ratio of 0.7, i.e. 2x), the floor under which its document rules never fire --
#: or when the trainer's document statistic at the flag puts one DP rank's high or low
#: side >= ``Thresholds.doc_extreme`` (3x) further from that rank's median than usual, and
#: it is that rank's document furthest from the step's median document. The second route
#: is the spike zoo's planted repeated document: it filled most of its rank's rows, so it
#: *was* the rank's median (the statistic fired on the rank's other, normal documents,
#: 17.8x the usual distance above it) and sat at 0.71x the step's median; masking it alone
#: removed the spike
@cache
def _default_floor() -> float:
    return float(_spikes().SpikeDetector.Config().doc_outlier_floor)


def _doc_standout(floor: float | None = None) -> float:
    """``DOC_STANDOUT``: exp of the spike rules' ``doc_outlier_floor`` (their one owner): the
    run's own (``floor``, as its spikes.jsonl recorded it), else the default."""
    return math.exp(_default_floor() if floor is None else float(floor))


def _doc_criterion(floor: float | None = None) -> str:
    """``DOC_CRITERION``: the rule above in words (quarantine records carry it)."""
    x = _doc_standout(floor)
    return (f"document loss >= {x:.2g}x the step's median document or <= 1/{x:.2g} "
            f"of it (|log ratio| >= {math.log(x):g}, the spike rules' "
            f"doc_outlier_floor), or the document furthest from the step's median on a DP rank whose "
            f"documents the trainer's statistic put >= {Thresholds().doc_extreme:g}x their usual distance "
            f"from the rank's median")


def __getattr__(name: str):  # DOC_STANDOUT / DOC_CRITERION, computed on first use (PEP 562)
    if name == "DOC_STANDOUT":
        return _doc_standout()
    if name == "DOC_CRITERION":
        return _doc_criterion()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def judge(led: RunLedger, step: int, th: Thresholds | None = None, n_docs: int = 3) -> dict:
    """THE verdict on ``step``, for ``diagnose`` and ``report`` alike (one code path).

    The tree (:func:`classify`) walks the signals history as it stood when the step
    ran (``rows_as_of``: a step a rollback later undid is judged on what the trainer
    saw when it decided), with the trainer's own event for the step (its rules and
    evidence stats, ``spikes.jsonl``) and the compute dtype of the launch that
    trained it. Added: ``trainer`` (the flag: rules, action, suspect rank),
    ``actions`` / ``done`` (what was done and what followed,
    :func:`titan_ledger.tools.postmortem.actions_at`), ``rank_losses`` (each rank's
    own loss at the step, as it trained), ``injected`` (DP ranks whose batch an
    injection replaced), for a bad_data verdict the ``documents`` that stand out
    (:data:`DOC_CRITERION`; none for an injected batch or an unflagged step) and
    ``certainty`` (``proven`` / ``evidence`` / ``guess``) with ``certainty_rule``.
    A rerun summary (``<ledger>/rerun/step<T>.json``) that proves a cause makes it
    the verdict (the tree's answer kept as ``heuristic``)."""
    from titan_ledger.format import records
    from titan_ledger.tools.postmortem import actions_at

    path = led.folder / records.SIGNALS_FILE
    th = th or Thresholds()
    # the rows the tree reads (th.pre before, th.post after), as the step saw them, through
    # the offset index: O(log n) however long the run
    hist = led.history_at(step, th.pre, th.post)
    rows, current = hist if hist is not None else (None, True)
    win = next((r for r in led.signals_between(step, step)
                if r.get("skipped") and r["step"] <= step <= r.get("last_step", r["step"])), None)
    if win is not None and (rows is None or current):
        raise LedgerError(f"--step {step}: not a trained step: it is in the skipped window "
                          f"{win['step']}-{win.get('last_step', win['step'])} of {path} and no launch trained "
                          f"it; nothing trained there to diagnose")
    if rows is None:
        last = led.last_signal_step(windows=True) or 0
        raise LedgerError(f"--step {step}: not a recorded step of {path} (it covers steps 1-{last})")
    events = [e for e in led.spike_events() if int(e["step"]) == step]
    event = events[-1] if events else None
    dtype = led.param_dtype(step)
    # the run's first rows (the warm-up, the "early" levels): a bounded read from the top of
    # the file, th.start steps at most, however long the run
    start = [r for r in led.signals_between(1, min(step, th.start)) if not r.get("skipped")
             and r.get("loss") is not None and r["step"] <= step]
    try:
        res = classify(rows, step, th, evidence=event, param_dtype=dtype, precision=led.precision(step),
                       start=start)
    except ValueError as e:
        raise LedgerError(f"--step {step}: {path}: {e}") from None
    res["param_dtype"] = dtype
    res["rewound"] = not current  # a later rollback or resume superseded this step
    res["trainer"] = None if event is None else {
        k: event.get(k) for k in ("rules", "notes", "action", "suspect_dp_rank", "loss_max_rank",
                                  "grad_norm_median", "loss_median", "grad_jump_ratio", "grad_jump_bound", "separation_y",
                                  "separation_bound", "separation_rank")
        if event.get(k) is not None}
    note = next((e for e in reversed(led.note_events()) if int(e["step"]) == step), None)
    res["trainer_notes"] = note and note["notes"]  # a note-only step: recorded, never acted on
    res["trainer_notes_why"] = note and _why_noted(note)
    res["actions"] = actions_at(led, step)
    res["done"] = res["actions"]["summary"]
    res["rank_losses"] = {str(r): row.get("loss") for r, row in sorted(led.rank_rows_at(step).items())} or None
    try:
        injected = led.data.injected_at(step)
    except LedgerCorrupt:
        raise
    except LedgerError:
        injected = {}
    res["injected"] = {str(r): k for r, k in injected.items()} or None
    if injected:
        where = ", ".join(f"DP rank {r} ({k})" for r, k in sorted(injected.items()))
        res["documents_note"] = (f"batch replaced by an injection (--ledger.rehearsal.inject) on {where}: the "
                                 f"data ledger's documents there never trained; no documents to quarantine")
    bad = res["cause"] == "bad_data" or (res["cause"] == "divergence" and res.get("underlying") == "bad_data")
    if bad:
        if (event or {}).get("suspect_dp_rank") is None:
            # no evidence rule named a rank: the rank holding the document furthest
            # from the step's median (either way) is the evidence; loss_max_rank is
            # not: a rank training repeated text pushes the OTHER rank to loss_max
            by_doc = extreme_document_rank(led, step)
            if by_doc is not None and not injected:
                res["rank_from"] = "documents"
                res["rank"] = by_doc
        res["documents"], res["documents_note"] = _standout(led, step, res.get("rank"), event, injected, n_docs)
    res["certainty"], res["certainty_rule"] = _certainty(res, event, injected)
    # the tree's own reading, before any proof or rerun: a candidate for the answer, never its cause
    res["tree"] = {"cause": res["cause"], "certainty": res["certainty"], "rule": res["certainty_rule"]}
    _apply_proof(res, (event or {}).get("proof") or (note or {}).get("proof"))
    stall = next((e for e in reversed(led.response_events()) if e.get("stall") and int(e["step"]) == step), None)
    _apply_stall(res, stall, next((p for _, p in reversed(led.proofs()) if (p.get("stall") or {}).get("step") == step),
                                  None) if stall is not None else None)
    note_fragile(res)
    if res.get("proof", {}).get("verdict") == "bad_data":  # the convicted documents, with their losses
        scores = {(d["source"], d["doc"]): d for d in document_scores(led, step)}
        res["documents"] = [dict(scores.get((d["source"], d["doc"]), d), criterion=PROOF_CRITERION, proven=True)
                            for d in res["documents"]]
    _apply_rerun(led, step, res)
    res["answer"] = answer_of(led, step, res)
    return res


def answer_of(led: RunLedger, step: int, res: dict) -> dict | None:
    """THE answer to the incident at ``step`` (``format.answers``: the one the trainer
    recorded, else built by the same function from the recorded event), with the tree's
    reading as a candidate and a rerun's proof where no proof at the alarm established a
    cause; None when nothing flagged the step. Every view renders this."""
    from titan_ledger.format import answers

    a = led.answer(step, res.get("tree"))
    if a is None:
        return None
    rv = res.get("rerun_verdict") or {}
    if not a.cause and rv.get("cause") and (rv.get("proven") or res.get("certainty") == "evidence") \
            and not rv.get("contradicts_proof"):
        a = answers.with_rerun(a, rv["cause"], res.get("certainty_rule", ""), rv.get("proven", False),
                               led.answer_context())
    return a.to_json()


def _apply_stall(res: dict, event: dict | None, proof: dict | None = None) -> None:
    """A step the stall rule flagged (``components.detection.stall``): no spike, a finding.
    ``stalled`` needs the attention logits past its bar, so its cause is logit growth (the
    evidence: the loss's windows and the logits), with QK-norm's prevention; a ``diverging``
    loss keeps the tree's cause, with the stall beside it. The window proof the trainer ran
    at the next step (``proof``: its ``stall`` names this flag) proves the cause whose fix
    lowered the loss, the cheapest first."""
    if event is None:
        return
    from titan_ledger.components.detection.stall import describe_stall

    st = event["stall"]
    res["stall"] = st
    window = (proof or {}).get("window") or {}
    if window.get("cause"):
        res["stall_proof"] = proof
        if res.get("cause") != window["cause"]:
            res["heuristic"] = res.get("cause")
        res.update(cause=window["cause"], certainty="proven",
                   certainty_rule=f"proven in process: {describe_window(window)} ({describe_stall(event)})",
                   prevention=fp.prevention(window["cause"], res.get("fingerprints"), st.get("max_logit")))
        return
    if st["kind"] == "stalled":
        if res.get("cause") != "logit_growth":
            res["heuristic"] = res.get("cause")
        res.update(cause="logit_growth", certainty="evidence",
                   certainty_rule=f"evidence: the stall rule ({describe_stall(event)})",
                   prevention=fp.prevention("logit_growth", res.get("fingerprints"), st.get("max_logit")))
    else:
        res["certainty_rule"] = f"{res.get('certainty_rule', '')}; {describe_stall(event)}".lstrip("; ")


#: above this many DP ranks, per-rank values are summarised (the median, the spread, the worst
#: ranks) instead of listed: a DP-512 run's 512 losses on one line read as noise
RANKS_LISTED = 16


def rank_summary(values: dict[str, float | None], worst: int = 3) -> str:
    """Per-DP-rank values in words (pure): every rank up to :data:`RANKS_LISTED`, else the
    count, median, the 10th-90th percentile spread, the ``worst`` highest ranks and any
    rank without a finite value."""
    fin = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    bad = [k for k in values if k not in fin]
    if len(values) <= RANKS_LISTED:
        return ", ".join(f"rank {k} {v:.4f}" if k in fin else f"rank {k} {v}" for k, v in values.items())
    xs = sorted(fin.values())
    if not xs:
        return f"{len(values)} ranks, none finite"

    def q(p):
        return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]

    top = sorted(fin.items(), key=lambda kv: -kv[1])[:worst]
    return (f"{len(values)} ranks: median {statistics.median(xs):.4f}, 10-90% {q(0.1):.4f}-{q(0.9):.4f}, "
            f"highest " + ", ".join(f"rank {k} {v:.4f}" for k, v in top)
            + (f"; not finite: ranks {', '.join(bad[:8])}" + (" ..." if len(bad) > 8 else "") if bad else ""))


#: how the documents of a bad_data proof were chosen (diagnose, report)
PROOF_CRITERION = "convicted by the proof at the alarm: masking them brought the update back, a control did not"


def _apply_proof(res: dict, proof: dict | None) -> None:
    """The trainer's proof at the alarm (``proof`` of the step's event): ``hardware`` and
    ``bad_data`` are proven causes (no rerun needed; the documents are the convicted ones);
    ``not_data`` rules the data and a transient fault out, ``outlier`` says the data stood
    out and the update was normal with it (the heuristics' cause stays, as evidence)."""
    if not proof:
        return
    v = proof["verdict"]
    res["proof"] = dict(proof)  # the record as the trainer wrote it: every view renders the same one
    heuristic = res["cause"]
    if v == "hardware":
        ranks = ", ".join(map(str, proof.get("dp_ranks", [])))
        res.update(cause="hardware", certainty="proven",
                   certainty_rule=f"proven in step: the step re-executed on the same data and state did not "
                                  f"reproduce it (DP rank(s) {ranks} changed between executions)")
    elif v == "bad_data":
        sus = proof.get("suspect") or {}
        docs = proof.get("documents") or []
        if sus.get("dp_ranks"):  # group testing: the documents' segments lay on these DP ranks
            res["ranks"] = sus["dp_ranks"]
        quarantined = proof.get("applied") in ("masked", "control")
        res.update(cause="bad_data", certainty="proven", rank=sus.get("dp_rank"), rank_from="proof",
                   certainty_rule=("proven in step: masking the convicted data brought the update back to "
                                   "normal; masking as much other data did not"),
                   documents=[{"source": s, "doc": int(d), "dp_rank": sus.get("dp_rank")} for s, d in docs],
                   documents_note=f"convicted by the proof at the alarm ({len(docs)} document(s)), " + (
                       "quarantined by the trainer from the next step on" if quarantined else
                       f"not quarantined ({proof.get('held_back') or 'not applied'}): trained as they were"))
        window = proof.get("window") or {}
        if window.get("cause"):  # the data unmasked, a variant over the window removed the spike as well
            res["fragile"] = (f"proven in process: with the convicted data unmasked, {describe_window(window)}; "
                              f"the data triggered this step in a model its configuration made fragile")
            res["prevention"] = fp.prevention(window["cause"], res.get("fingerprints"))
    elif v in ("not_data", "optimizer_state"):
        if v == "optimizer_state":  # Adam first: the updates recomputed with v restored were that much smaller
            res.update(cause="optimizer_state", certainty="proven",
                       certainty_rule=f"proven in step (no extra forward/backward): {proof.get('why', '')}")
            res["prevention"] = fp.prevention("optimizer_state", res.get("fingerprints"))
        else:
            res["certainty_rule"] = (f"{res['certainty_rule']}; proven in step: reproducible, and not the "
                                     f"suspect's data ({proof.get('why', '')})")
        window = proof.get("window") or {}
        wcause = window.get("cause")
        if wcause and (v == "not_data" or wcause == v):  # the window re-ran from a host snapshot: its cause
            res.update(cause=wcause, certainty="proven",
                       certainty_rule=f"proven in process: {describe_window(window)}")
            if res.get("mechanism") and wcause != "lr":
                res.pop("mechanism")
            if wcause != heuristic:
                res["prevention"] = fp.prevention(wcause, res.get("fingerprints"))
        elif window.get("cause"):  # Adam's state measured in step; in the window another fix removed it
            res["certainty_rule"] += (f"; in the window Adam's own fix did not remove it, {window['cause']}'s did "
                                      f"(proven in process: {describe_window(window)})")
        elif v == "not_data" and heuristic in ("bad_data", "hardware", "transient"):
            res["certainty"] = "guess"
            res["certainty_rule"] += f"; the heuristics' {heuristic} is contradicted by the proof"
    else:  # outlier
        res["certainty_rule"] = (f"{res['certainty_rule']}; proven in step: the suspect data stood out and the "
                                 f"update was normal with it (an outlier, nothing done)")
    if res["cause"] != heuristic:
        res["heuristic"] = heuristic


def note_fragile(res: dict) -> None:
    """Data proven at a step where a configuration fingerprint (F1 Adam's state, F2 the LR's
    scale) also holds: both are findings. The documents triggered the update; the
    configuration made the model that fragile (the real set's LR 0.3 run, no bad data
    planted: documents convicted at steps 126 and 210 while every update moved the
    parameters 6% of their norm). The verdict stays the proof's; ``fragile`` says the rest,
    and ``prevention`` names the configuration's fix."""
    if res.get("mechanism") and res["cause"] not in ("lr", "divergence"):
        res.pop("mechanism")  # the LR's mechanism, and a proof named another cause
    if res["cause"] != "bad_data" or res.get("certainty") != "proven" or "fragile" in res:
        return  # (a window proof said it already, proven)
    hit = {c["question"].split(" ")[0]: c for c in res["checks"] if c["answer"]}
    cause = "optimizer_state" if "F1" in hit else "lr" if "F2" in hit else None
    if cause is None:
        return
    why = (f"Adam's update per unit LR {hit['F1'].get('adam_amplification')}x its pre-spike median" if cause ==
           "optimizer_state" else
           f"the update moved the parameters {hit['F2'].get('relative_update_pre_median', 0):.1%} of their norm a step")
    res["fragile"] = (f"the run's fingerprint says {cause} as well ({why}): the convicted data triggered this "
                      f"step in a model its configuration made fragile")
    res["prevention"] = fp.prevention(cause, res.get("fingerprints"))


def _standout(led: RunLedger, step: int, rank, event, injected: dict, n: int) -> tuple[list[dict], str]:
    """The documents a quarantine may name, and why (not) these: only on a step the
    trainer flagged, never for an injected batch, and only documents that stand out
    against their step (:data:`DOC_CRITERION`), the named rank's first."""
    if injected:
        where = ", ".join(f"DP rank {r} ({k})" for r, k in sorted(injected.items()))
        return [], (f"batch replaced by an injection (--ledger.rehearsal.inject) on {where}: the "
                    f"data ledger's documents there never trained; no documents to quarantine")
    if event is None:
        return [], ("the trainer did not flag this step (no acting rule): no documents are named and "
                    "no quarantine is proposed")
    scores = document_scores(led, step)
    if not scores:
        return [], "the run recorded no per-document losses at this step: no documents to name"
    floor = (led.spike_rules() or {}).get("doc_outlier_floor")  # the run's own rule (no torch)
    why: dict[tuple, str] = {}
    for d in scores:
        if d["vs_median"] >= _doc_standout(floor) or d["vs_median"] <= 1 / _doc_standout(floor):
            why[(d["source"], d["doc"])] = f"{d['vs_median']:.2f}x the step's median document"
    th = Thresholds()
    for side, y, m, rk in (("high", "doc_high_y", "doc_y_median_high", "doc_high_rank"),
                           ("low", "doc_low_y", "doc_y_median_low", "doc_low_rank")):
        yv, mv = event.get(y), event.get(m)
        if not (isinstance(yv, (int, float)) and isinstance(mv, (int, float)) and mv > 0 and yv / mv >= th.doc_extreme):
            continue
        cands = [d for d in scores if event.get(rk) is None or d["dp_rank"] == int(event[rk])]
        if not cands:
            continue
        # the rank's document furthest from the step's median: its own extreme document,
        # or -- when one degenerate document fills the rank and is its median -- that one
        pick = max(cands, key=lambda d: abs(math.log(d["vs_median"])))
        why.setdefault((pick["source"], pick["doc"]),
                       f"DP rank {pick['dp_rank']}'s document furthest from the step's median "
                       f"({pick['vs_median']:.2f}x); the rank's {side} side sat {yv / mv:.1f}x its usual "
                       f"distance from the rank's median (the trainer's statistic)")
    out = [d for d in scores if (d["source"], d["doc"]) in why]
    if not out:
        return [], f"no document stands out against the step ({_doc_criterion(floor)}): nothing to quarantine"
    mine = [d for d in out if rank is None or d["dp_rank"] == rank]
    chosen = (mine or out)[:n]
    return ([dict(d, criterion=_doc_criterion(floor), stands_out=why[(d["source"], d["doc"])]) for d in chosen],
            f"documents that stand out: {_doc_criterion(floor)}")


def _why_noted(note: dict) -> str | None:
    """Why a grad-norm rule's flag stayed a note, from the event's own statistics: the
    move was not past ``grad_novelty`` x the largest this run had shown (spikes.py)."""
    grad = {"zscore_grad_norm", "ratio", "grad_jump"} & set(note.get("notes", []))
    ratio, bound = note.get("grad_jump_ratio"), note.get("grad_jump_bound")
    if not grad or ratio is None or bound is None or ratio > bound:
        return None
    return (f"grad norm {ratio:.2f}x its recent median, under the {bound:.2f}x this run had already "
            f"come within (grad_novelty x its largest remembered move)")


def _certainty(res: dict, event: dict | None, injected: dict) -> tuple[str, str]:
    """How sure the tree's verdict is, and the rule that says so: ``evidence`` when
    the trainer flagged the step with a per-rank/per-document evidence rule and the
    recorded per-rank and per-document data name the same DP rank (bad data); else
    ``guess`` (heuristics on the recorded signals). ``proven`` only comes from a rerun
    (:func:`_apply_rerun`)."""
    cause = res["cause"]
    decided = next((c["question"].split(":")[0] for c in res["checks"] if c["answer"]), None)
    if decided and decided.split(" ")[0] in (res.get("margins") or {}):  # how far past its bar the fingerprint sat
        decided += f", {res['margins'][decided.split(' ')[0]]:.3g}x its bar"
    if event is None:
        noted = res.get("trainer_notes")
        return "guess", (f"heuristics only ({decided or 'no question answered yes'}); the trainer did not "
                         f"flag this step (no acting rule)"
                         + (f"; it recorded a note ({', '.join(noted)}), which never acts" if noted else ""))
    # an acting rule flagged the step; the per-rank/per-document evidence rules count in
    # either tier (a note agreeing with an acting flag is evidence)
    rules = [r for r in (*event.get("rules", []), *event.get("notes", [])) if r in EVIDENCE_RULES]
    bad = cause == "bad_data" or res.get("underlying") == "bad_data"
    if bad and rules:
        named = event.get("suspect_dp_rank")
        docs = res.get("documents") or []
        doc_rank = docs[0]["dp_rank"] if docs else None
        said = f"the trainer's {', '.join(rules)} named DP rank {named}"
        if named is not None and named in injected:
            return "evidence", (f"{said}, the rank whose batch the data ledger records as replaced by an "
                                f"injection ({injected[named]})")
        if named is not None and doc_rank == named:
            d = docs[0]
            return "evidence", (f"{said}, and the recorded per-document losses agree: {d['source']} doc "
                                f"{d['doc']} on that rank at {d['vs_median']:.2f}x the step's median document")
        return "guess", (f"{said}, but the recorded per-document data do not agree"
                         + (f" (the document that stands out is on DP rank {doc_rank})" if doc_rank is not None
                            else " (no document stands out)"))
    return "guess", (f"heuristics only ({decided or 'no question answered yes'}); the trainer flagged the step "
                     f"({', '.join(event.get('rules', []))}) but no evidence rule and per-rank/per-document data "
                     f"agree on a cause")


def rerun_contradicts(proof_verdict: str, rerun_cause: str | None) -> bool:
    """Whether a rerun's cause contradicts the in-step proof's verdict (pure): a proof that
    convicted data or hardware and a rerun that names anything else; a proof that found
    the step reproducible with its suspect data harmless (``not_data``, ``outlier``) and a
    rerun that names data or hardware. A rerun naming a cause that is not the data
    (LR, logits, ...) after a ``not_data`` proof says which -- no contradiction."""
    if proof_verdict in ("bad_data", "hardware"):
        return rerun_cause != proof_verdict
    return rerun_cause in ("bad_data", "hardware")


def _apply_rerun(led: RunLedger, step: int, res: dict) -> None:
    """A rerun's verdict on ``step`` (``<ledger>/rerun/step<T>.json``) decides when it
    proved something: ``proven`` (same reproduced it and a counterfactual removed it,
    or same did not reproduce it: hardware); bad data is proven only by the
    ``quarantine`` variant (only the named documents masked) -- a ``skip`` (or a
    ``swap``) that removes it shows only "something in this step's data" (evidence).
    A rerun that contradicts the step's in-step proof (:func:`rerun_contradicts`) does not
    override it: the verdict keeps the proof's cause and says what the rerun claimed."""
    import json

    from titan_ledger.format import records

    f = records.rerun_summary_file(led.folder, step)
    try:
        summary = json.loads(f.read_text())
    except (OSError, ValueError):
        return
    vd = summary.get("verdict") or {}
    if not vd.get("proven") and vd.get("certainty") != "evidence":
        if vd.get("cause"):
            res["rerun_verdict"] = {"cause": vd.get("cause"), "proven": False, "file": str(f)}
        return
    heuristic = res["cause"]
    cause, certainty = vd.get("cause"), vd.get("certainty") or "proven"
    by = vd.get("removed_by")
    if cause == "bad_data" and by != "quarantine":
        certainty = "evidence"
    if cause == "hardware":
        rule = "a rerun from the checkpoint (same data, same state) did not reproduce it"
    elif cause == "bad_data" and certainty == "evidence":
        rule = (f"a rerun reproduced it and {by or 'skip'} removed it: something in this step's data "
                f"(not which documents: the quarantine variant names them)")
    else:
        rule = f"a rerun reproduced it and the {by or 'counterfactual'} variant removed it"
    proven = (res.get("proof") or {}).get("verdict")
    if proven is not None and rerun_contradicts(proven, cause):
        # the in-step proof re-executed the step itself, its masks against a control; a rerun
        # that skips steps removes their updates (at their LR), not only their data
        res["rerun_verdict"] = {"cause": cause, "proven": False, "removed_by": by, "file": str(f),
                                "contradicts_proof": proven}
        res["certainty_rule"] += (f"; a rerun from the checkpoint says {cause} ({rule}), contradicting the "
                                  f"in-step proof's {proven}: the proof stands (it executed the step again "
                                  f"itself, data masked against a control)")
        return
    if certainty == "evidence" and res.get("certainty") == "evidence" and heuristic == cause:
        rule = res["certainty_rule"] + "; " + rule
    res.update(cause=cause, certainty=certainty, certainty_rule=rule,
               rerun_verdict={"cause": cause, "proven": certainty == "proven", "removed_by": by, "file": str(f)})
    if heuristic != cause:
        res["heuristic"] = heuristic


def extreme_document_rank(led: RunLedger, step: int) -> int | None:
    """The DP rank holding (most tokens of) the document furthest from the step's
    median document, either way; None when the run recorded no document losses."""
    scores = document_scores(led, step)
    return scores[0]["dp_rank"] if scores else None
