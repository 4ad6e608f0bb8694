"""A finished rerun against the original, over the plan's window: each signal's
relative difference and bit-equality per step, the same sample ids, and whether the
spike is present at T (the grad-norm test, the loss test, the same numbers)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from titan_ledger.tools.rerun.plan import Plan
from titan_ledger.tools.rerun.variants import PRE, RerunError, Variant, _num

#: signals compared step by step
KEYS = ("loss", "loss_max", "loss_max_rank", "grad_norm", "grad_norm_clipped", "num_zeros",
        "param_norm", "max_logit", "lr", "consumed_samples")
GRAD_TOL = 0.10  # rerun grad norm at T within 10% of the original's ...
MIN_RATIO = 2.0  # ... and >= 2x the original's pre-spike median: the spike is present
REL_TOL = 1e-3  # "equal within tolerance" for non-deterministic (GPU) runs
LOSS_EXCESS = 0.05  # a loss >= 5% over its pre-spike median is a loss spike (the rules' loss_jump) ...
LOSS_KEPT = 0.5  # ... present in a rerun that keeps at least half of that excess


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
    from titan_ledger.format.data_reader import step_ids

    res = VariantResult(v.name, v.kind, str(folder) if folder else None)
    ho, hr = original.data.header(), rerun_led.data.header()
    for key in ("fingerprint", "global_batch", "seq_len"):
        if ho.get(key) != hr.get(key):
            raise RerunError(f"the rerun's data {key} {hr.get(key)!r} differs from the original's "
                             f"{ho.get(key)!r} ({original.folder}): give the original run's training "
                             f"flags (the rerun is in {rerun_led.dump_folder})")
    # a step a rollback undid: the original as it stood when the step ran
    orig_rows = original.rows_as_of(plan.step) or original.signal_rows()
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
    if v.kind in ("skip", "control"):  # the control is judged exactly as the skip it controls
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
