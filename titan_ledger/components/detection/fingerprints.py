"""The fingerprints a cause that is not the data leaves before its spike, read from ledger rows (pure).

Design decision: the design article's tree (§2.7) asks about the max attention logit,
the param norm's growth and a grad-norm plateau; the ledger now records more than
that, and each addition answers one of its questions more directly (issue 51):

* **Adam's state**: Adam's update per unit LR, ``update_norm / lr``, is scale-free while
  its second moment tracks the gradient (m / sqrt(v) stays O(1) per element, whatever the
  gradient's size). It jumps only when v lags the gradient -- after a stretch of small
  gradients (the article's §2.6). So: that ratio at the spike over its pre-spike median
  (``adam_amplification``), and the pre-spike grad norm against the run's first steps
  (``quiet_gradients``: how far v can have shrunk).
* **The LR**: where the spike sits in the schedule (``lr_schedule``: still warming up, or
  how many steps after the LR reached its peak, in warm-up lengths), and the update's
  size against the parameters (``relative_update``, update norm / param norm).
* **Output logits**: log Z's max (``logz``) against the run's first steps, and whether it
  rose before the spike.
* **Precision**: the launch's precision audit (failed checks), read by the caller.

Each reading is a dict of plain numbers (None where the run did not record the signal),
so ``diagnose --json`` shows what the tree read. :func:`prevention` names the change that
would have prevented a cause, from the same readings ("warm-up >= N", "QK-norm or QK-clip
at T", "beta2 0.95", "fp32 master weights", "z-loss 1e-4"): the article's chapter 3, with
the flag that sets it. The bars live in :class:`Bars` (the tree's ``Thresholds`` holds
one); they were set on the real set of ``bench/zoo.py`` and a second seed of it
(docs/benchmarks.md, "Naming the cause when it is not the data").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from titan_ledger.format.answers.health import Bars as HealthBars

HEALTH = HealthBars()  # the LR's fingerprint's bars are the model's health's (one owner)


@dataclass(frozen=True)
class Bars:
    adam_amp: float = 5.0  # Adam's update per unit LR at the spike >= 5x its pre-spike median
    quiet: float = 0.1  # ... after the grad norm sat <= 0.1x the run's first steps' (v shrank)
    early: int = 20  # the run's first trained steps: "early" for log Z and the grad norm
    logz_rise: float = 2.0  # log Z's max before the spike >= 2x its early level ...
    logz_level: float = 20.0  # ... and >= 20 (exp(20): the output logits far from calibrated)
    rel_update: float = HEALTH.rel_update  # LR: the update moves the parameters >= 1% of their norm a step (pre-spike median)
    # ... or, without --ledger.update_norm, the param norm itself moves >= 0.2% a step: a lower
    # bound of the update's size (|d||w||| <= ||dw||; the real set's LR runs: 0.27-4.5%, 0.1-0.56x
    # their relative update; LR 3e-3: 0.029%, which is weight decay's lr x wd)
    rel_norm_change: float = HEALTH.rel_norm_change  # (one owner: format.answers.health.Bars)


def _fin(xs):
    return [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def _median(xs):
    xs = _fin(xs)
    return statistics.median(xs) if xs else None


def _r(v):
    return round(v, 6) if isinstance(v, float) and math.isfinite(v) else v


def lr_schedule(start: list[dict], pre: list[dict], at: dict) -> dict:
    """Where ``at`` sits in the LR schedule: ``warming_up`` (the LR still rising into the
    step), ``peak_lr`` and ``peak_step`` (the first step at the largest LR the run had
    reached by then), ``warmup_steps`` (that step: the warm-up's length when the LR peaked
    in it), ``after_peak`` (steps since), ``after_peak_warmups`` (in warm-up lengths) and
    ``lr_vs_peak``. ``start``: the run's first trained rows (up to the step); ``pre``: the
    rows just before it."""
    rows = [r for r in (*start, *pre, at) if isinstance(r.get("lr"), (int, float))]
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    out = {"warming_up": None, "peak_lr": None, "peak_step": None, "warmup_steps": None, "after_peak": None,
           "after_peak_warmups": None, "lr_vs_peak": None}
    if not rows or not isinstance(at.get("lr"), (int, float)):
        return out
    peak = max(r["lr"] for r in rows)
    peak_step = next(r["step"] for r in rows if r["lr"] >= peak * (1 - 1e-9))
    prev = [r for r in rows if r["step"] < at["step"]]
    warming = bool(prev) and at["lr"] > prev[-1]["lr"] * (1 + 1e-9)
    out.update(peak_lr=peak, peak_step=peak_step, lr_vs_peak=_r(at["lr"] / peak) if peak > 0 else None,
               warming_up=warming)
    # a warm-up is the rise from the first step: its length is known only from rows that run
    # without a gap from the first step to the peak (not when the first rows are missing, or
    # ``start`` stopped before the peak, or the LR still rises at the step)
    upto = [r["step"] for r in rows if r["step"] <= peak_step]
    gapless = all(b - a == 1 for a, b in zip(upto, upto[1:]))
    if rows[0]["step"] <= 2 and peak_step > rows[0]["step"] and not warming and gapless:
        out["warmup_steps"] = peak_step
        out["after_peak"] = at["step"] - peak_step
        out["after_peak_warmups"] = _r((at["step"] - peak_step) / peak_step)
    return out


def adam(start: list[dict], pre: list[dict], at: dict, bars: Bars) -> dict:
    """Adam's update per unit LR at the step against its pre-spike median
    (``adam_amplification``), and the pre-spike grad norm against the run's first steps'
    (``quiet_gradients``: small means v had shrunk). None where the run recorded no
    ``update_norm`` (``--ledger.update_norm``)."""
    def per_lr(r):
        u, lr = r.get("update_norm"), r.get("lr")
        return u / lr if isinstance(u, (int, float)) and isinstance(lr, (int, float)) and lr > 0 else None

    here = per_lr(at)
    med = _median([per_lr(r) for r in pre])
    early_gn = _median([r.get("grad_norm") for r in start[:bars.early]])
    pre_gn = _median([r.get("grad_norm") for r in pre])
    return {"update_per_lr": _r(here), "update_per_lr_pre_median": _r(med),
            "adam_amplification": _r(here / med) if here is not None and med else None,
            "grad_norm_early_median": _r(early_gn), "grad_norm_pre_median": _r(pre_gn),
            "quiet_gradients": _r(pre_gn / early_gn) if pre_gn is not None and early_gn else None}


def logz(start: list[dict], pre: list[dict], at: dict, bars: Bars) -> dict:
    """log Z's max (the output logits' log partition function) at the run's start, before
    the spike (median and max) and at it; ``rise`` = pre-spike max over the early median."""
    early = _median([r.get("logz_max") for r in start[:bars.early]])
    before = _fin([r.get("logz_max") for r in pre])
    top = max(before) if before else None
    return {"logz_early_median": _r(early), "logz_pre_max": _r(top), "logz_at": _r(at.get("logz_max")),
            "logz_rise": _r(top / early) if top is not None and early else None}


def relative_update(pre: list[dict], at: dict) -> dict:
    """The update's size against the parameters (update norm / param norm) at the step
    and its pre-spike median: how far one step moves the model; and, read whether or not
    the run recorded ``update_norm``, the param norm's own change a step (its pre-spike
    median; a lower bound of the relative update)."""
    def rel(r):
        u, p = r.get("update_norm"), r.get("param_norm")
        return u / p if isinstance(u, (int, float)) and isinstance(p, (int, float)) and p > 0 else None

    pn = [(r["step"], r.get("param_norm")) for r in pre]
    moves = [abs(b - a) / a for (s, a), (t, b) in zip(pn, pn[1:])
             if t == s + 1 and isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0]
    return {"relative_update": _r(rel(at)), "relative_update_pre_median": _r(_median([rel(r) for r in pre])),
            "param_norm_change_pre_median": _r(_median(moves))}


def read(start: list[dict], pre: list[dict], at: dict, bars: Bars | None = None) -> dict:
    """Every reading at once (pure): ``schedule``, ``adam``, ``logz``, ``update``."""
    bars = bars or Bars()
    return {"schedule": lr_schedule(start, pre, at), "adam": adam(start, pre, at, bars),
            "logz": logz(start, pre, at, bars), "update": relative_update(pre, at)}


def adam_lagging(f: dict, bars: Bars) -> bool:
    """Adam's update amplified at the step after quiet gradients (v lagging the gradient)."""
    a = f["adam"]
    return (a["adam_amplification"] is not None and a["adam_amplification"] >= bars.adam_amp
            and a["quiet_gradients"] is not None and a["quiet_gradients"] <= bars.quiet)


def lr_scale(f: dict, bars: Bars) -> bool:
    """The LR too large for the model's scale: the pre-spike median update is >= ``rel_update``
    of the parameter norm a step (the real set's LR runs: 4-16%; the same model at LR 3e-3:
    0.03%), else -- no ``update_norm`` recorded -- the param norm's own change a step
    >= ``rel_norm_change``. Measured in the weights, so it holds after the warm-up as well
    as in it."""
    u, moved = f["update"]["relative_update_pre_median"], f["update"]["param_norm_change_pre_median"]
    if u is not None:
        return u >= bars.rel_update
    return moved is not None and moved >= bars.rel_norm_change  # no update_norm recorded: the lower bound


def lr_onset(start: list[dict], pre: list[dict], step: int, bars: Bars) -> int | None:
    """Where the LR's fingerprint began (pure): the first step of the unbroken stretch of
    trained steps before ``step`` whose update moved the parameters >= ``rel_update`` of
    their norm (without ``update_norm``: whose param norm moved >= ``rel_norm_change``).
    None when that stretch reaches back past the rows read (``start`` and ``pre`` not
    contiguous: it began earlier) or there is none. A rerun or a rollback that should
    remove the cause starts from a checkpoint before it (the real set's LR runs: step 1,
    the first warm-up step already moved the weights 2.1-7%)."""
    rows = sorted({r["step"]: r for r in (*start, *pre) if r["step"] < step}.values(), key=lambda r: r["step"])

    def big(a: dict, b: dict | None) -> bool | None:
        u, p = a.get("update_norm"), a.get("param_norm")
        if isinstance(u, (int, float)) and isinstance(p, (int, float)) and p > 0:
            return u / p >= bars.rel_update
        if b is None or not isinstance(p, (int, float)) or not isinstance(b.get("param_norm"), (int, float)) \
                or b["param_norm"] <= 0:
            return None
        return abs(p - b["param_norm"]) / b["param_norm"] >= bars.rel_norm_change

    onset = None
    for i in range(len(rows) - 1, -1, -1):
        r, before = rows[i], rows[i - 1] if i > 0 else None
        if before is not None and before["step"] != r["step"] - 1:
            before = None
        hit = big(r, before)
        if not hit:
            break
        onset = r["step"]
        if i > 0 and rows[i - 1]["step"] != r["step"] - 1:
            return None  # a gap: the stretch began before the rows read
    return onset


def logz_drift(f: dict, bars: Bars) -> bool:
    z = f["logz"]
    return (z["logz_rise"] is not None and z["logz_rise"] >= bars.logz_rise
            and z["logz_pre_max"] is not None and z["logz_pre_max"] >= bars.logz_level)


def prevention(cause: str, f: dict | None, max_logit: float | None = None, bars: Bars | None = None) -> dict | None:
    """The change that would have prevented ``cause`` (pure): ``text`` (what, and why this
    value) and ``flags`` (the training flags that set it: a user appends them to the run's
    command; ``bench/separability.py`` runs them). None: nothing in the configuration to
    change (bad data is quarantined, hardware replaced, a transient waited out).

    The LR's value is computed, not a rule of thumb: Adam's update is proportional to the
    LR (scale-free in the gradient), so the LR that brings the pre-spike update to
    ``rel_update`` of the param norm is the run's LR x ``rel_update`` / its relative update.
    A longer warm-up alone did not prevent the real set's LR runs (warm-up 500 at LR 0.3 and
    1.0: non-finite at steps 152 and 387); a lower LR did."""
    f, bars = f or {}, bars or Bars()
    s = f.get("schedule") or {}
    u = (f.get("update") or {}).get("relative_update_pre_median")
    if cause == "lr":
        peak = s.get("peak_lr")
        if peak and u:
            lr = float(f"{peak * bars.rel_update / u:.2g}")
            if lr < peak:
                now = (f"the LR was {peak:.3g} and still warming up" if s.get("warming_up") else f"now {peak:.3g}")
                where = f" ({now}: the update moved the parameters {u:.1%} of their norm a step before the spike)"
                warm = (f"; the spike came {s['after_peak']} step(s) after the warm-up's {s['warmup_steps']}"
                        if s.get("after_peak") is not None and s.get("warmup_steps") else "")
                return {"text": f"peak LR <= {lr:g}, which keeps the update under {bars.rel_update:.0%} of the param "
                                f"norm a step{where}{warm}", "flags": ["--optimizer.lr", f"{lr:g}"]}
        return {"text": "a lower peak LR (--optimizer.lr)" + (
                    "; with --ledger.update_norm recorded, diagnose computes the value" if u is None else ""),
                "flags": []}
    if cause == "logit_growth":
        t = 100.0 if max_logit is None or max_logit > 1000 else max(10.0, round(max_logit / 4, -1))
        return {"text": f"QK-norm (--model.qk_norm), or QK-clip at {t:g} (--qk_clip.enable --qk_clip.threshold {t:g}); "
                        f"roll back to before the logits began to rise", "flags": ["--model.qk_norm"]}
    if cause == "optimizer_state":
        return {"text": "beta2 0.95 and eps 1e-8: the second moment then follows the gradient within ~20 steps "
                        "(or roll back ~100 steps and skip 200-500 batches)",
                "flags": ["--optimizer.betas", "0.9", "0.95", "--optimizer.eps", "1e-8"]}
    if cause == "bf16":
        return {"text": "fp32 master weights and Adam moments (FSDP's mixed_precision_param bfloat16 computes in "
                        "bf16 and keeps the shards in fp32)", "flags": ["--training.dtype", "float32"]}
    if cause == "output_logits":
        return {"text": "z-loss 1e-4 (PaLM), or weight decay on the output layer",
                "flags": ["--loss.z_loss_weight", "1e-4"]}
    return None
