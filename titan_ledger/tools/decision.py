"""The design article's §2.7 decision tree on recorded rows: the pure half of ``diagnose``.

Design decision: the questions -- one table, :data:`QUESTIONS` (each an id, its text,
the function that answers it from the step's rows, the cause it names), which
``classify`` walks --, the LR-jump test the rerun's ``lr`` variant shares (``lr_jump``,
``lj_hit``), "is this step a spike at all" (``spike_check``, ``spike_steps``) are functions of
ledger rows, importing no other tool: :mod:`titan_ledger.tools.incident` (a step of a run
judged: the tree's reading beside the trainer's event, its proof, a rerun, the documents),
:mod:`titan_ledger.tools.diagnose`, :mod:`titan_ledger.tools.report` and
:mod:`titan_ledger.tools.rerun` build on them, and none of those is imported here. Importing it costs no torch: the spike rules (torch, torchtitan's Configurable)
are imported by the functions that run them offline (``_spikes``), so ``diagnose
--help`` and a read of recorded flags start in 0.15 s, not 3.3 s. The questions
themselves are listed in ``diagnose``'s docstring (its ``--help``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titan_ledger.components.detection import fingerprints as fp
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
