"""The verdict: which cause the reruns' comparisons prove, with the evidence (pure).

Design decision: :func:`verdict` is the steps in the order they are asked, each a
function that appends its evidence lines: was the step a spike at all
(:func:`_not_a_spike`), did ``same`` reproduce it (:func:`_same`), which
counterfactuals removed it (:func:`_removed`), each data counterfactual against its
same-size control (:func:`_against_quarantine_control`, :func:`_against_skip_control`)
and a swap's direction (:func:`_swap`), then how sure that makes the cause
(:func:`_certainty`).
"""

from __future__ import annotations

from titan_ledger.tools.rerun.comparison import LOSS_EXCESS, MIN_RATIO, VariantResult
from titan_ledger.tools.rerun.report import _fmt
from titan_ledger.tools.rerun.variants import CAUSE_OF


def verdict(results: list[VariantResult], step: int, heuristic: str | None = None) -> dict:
    """Which cause the reruns prove, with the evidence (pure)."""
    by = {r.kind: r for r in results if r.applicable and r.present is not None}
    same = by.get("same")
    evidence: list[str] = []
    if any(r.original_spike is False for r in results):
        out = _not_a_spike(results, step, evidence)
    else:
        evidence += [f"{r.variant}: not applicable ({r.note})" for r in results if not r.applicable]
        cause, proven, removed_by = _same(same, step, evidence)
        if cause is None:
            gone, kinds = _removed(by, evidence)
            if "quarantine" in kinds:  # likewise a quarantine (plan.quarantine_control)
                _against_quarantine_control(results, gone, kinds, evidence)
            if "skip" in kinds:  # a skip convicts only against its same-size control (plan.skip_control)
                _against_skip_control(results, by, gone, kinds, evidence)
            _swap(by.get("swap"), gone, kinds, evidence)
            if gone:
                cause, removed_by = gone[0], kinds[0]
                proven = same is not None and same.present
                if same is None:
                    evidence.append("same was not run: the spike's reproducibility is not shown")
            else:
                cause = "unproven"
        out = {"step": step, "cause": cause, "evidence": evidence, "removed_by": removed_by}
        _certainty(out, proven, step)
    if heuristic is not None:
        shown = out["proven"] or out.get("certainty") == "evidence"
        out["heuristic"] = heuristic
        out["heuristic_confirmed"] = shown and out["cause"] == heuristic
        if shown and out["cause"] != heuristic:
            out["heuristic_wrong"] = True
    return out


def _not_a_spike(results: list[VariantResult], step: int, evidence: list[str]) -> dict:
    """A counterfactual "removes" a spike only if there was one: at a quiet step every
    variant would look like a cure (skip first: "bad_data, proven")."""
    o = next((r.original_at_step for r in results if r.original_at_step), None) or {}
    evidence.append(f"step {step} is not a spike in the original run: not flagged, grad norm "
                    f"{o.get('grad_norm')} under {MIN_RATIO:g}x its pre-spike median, loss {o.get('loss')} "
                    f"under {1 + LOSS_EXCESS:g}x its median: there is nothing for a counterfactual to remove")
    return {"step": step, "cause": "unproven", "proven": False, "evidence": evidence, "not_a_spike": True}


def _same(same: VariantResult | None, step: int, evidence: list[str]) -> tuple[str | None, bool, str | None]:
    """``same`` (the step again from the same checkpoint and data): not reproduced is
    ``hardware``, proven; reproduced, the counterfactuals decide."""
    if same is None:
        return None, False, None
    at, o = same.at_step or {}, same.original_at_step or {}
    if not same.present:
        evidence.append(
            f"same: NOT reproduced at step {step}: grad norm {at.get('grad_norm')} vs the original's "
            f"{o.get('grad_norm')}; the rerun saw the same data from the same checkpoint"
            + (f" and was bit-equal through step {_bit_equal_through(same)}" if same.bit_equal_steps else "")
            + ": non-determinism or a hardware fault")
        return "hardware", True, "same"
    evidence.append(f"same: reproduced at step {step} (grad norm {at.get('grad_norm')} vs "
                    f"{o.get('grad_norm')}"
                    + (", bit-equal" if step in same.bit_equal_steps else
                       f", max relative difference {_fmt(same.max_rel_diff)}") + "): deterministic")
    return None, False, None


def _removed(by: dict[str, VariantResult], evidence: list[str]) -> tuple[list[str], list[str]]:
    """The causes whose counterfactual removed the spike, in :data:`CAUSE_OF`'s order, and
    the variant kinds that did."""
    gone, kinds = [], []
    for kind, c in CAUSE_OF.items():
        r = by.get(kind)
        if r is None:
            continue
        at = r.at_step or {}
        if r.present:
            evidence.append(f"{r.variant}: still present (loss {at.get('loss')}, grad norm "
                            f"{at.get('grad_norm')}, flagged {r.flagged or 'none'}): not {c}")
            continue
        gone.append(c)
        kinds.append(kind)
        what = ("step skipped; no spike in the steps after" if kind == "skip" else
                f"only the named documents masked ({r.variant.split('=', 1)[-1]}), the rest of the "
                f"batch trained; loss {at.get('loss')}, grad norm {at.get('grad_norm')}"
                if kind == "quarantine" else
                f"loss {at.get('loss')}, grad norm {at.get('grad_norm')}, flagged {r.flagged or 'none'}")
        evidence.append(f"{r.variant}: gone ({what}): {c}")
    return gone, kinds


def _drop(kind: str, gone: list[str], kinds: list[str]) -> None:
    i = kinds.index(kind)
    del gone[i], kinds[i]


def _against_control(kind: str, ctl: VariantResult | None, gone: list[str], kinds: list[str], evidence: list[str],
                     *, same: str, unconvicted: str, not_this: str, this: str) -> None:
    """A data counterfactual (``kind``) convicts only if its same-size control (``same``:
    what it removes instead) leaves the spike; otherwise ``kind`` is taken off the causes."""
    if ctl is None or not ctl.applicable or ctl.present is None:
        why = ("no same-size control ran" if ctl is None else
               f"its control could not run ({ctl.note or 'not applicable'})")
        evidence.append(f"{kind}: removed it, but {why}: {unconvicted}")
        _drop(kind, gone, kinds)
    elif ctl.present is False:
        evidence.append(f"{ctl.variant}: gone as well ({same}): {not_this}")
        _drop(kind, gone, kinds)
    else:
        evidence.append(f"{ctl.variant}: still present ({same}): {this}")


def _against_quarantine_control(results: list[VariantResult], gone: list[str], kinds: list[str],
                                evidence: list[str]) -> None:
    """Masking the named documents convicts them only if masking as many tokens of other
    documents (the control) leaves the spike."""
    _against_control("quarantine", next((r for r in results if r.kind == "qcontrol"), None), gone, kinds, evidence,
                     same="as many tokens of other documents masked",
                     unconvicted="masking any text of a step can move its update: the documents are not convicted",
                     not_this="not these documents", this="these documents, not the amount of text")


def _against_skip_control(results: list[VariantResult], by: dict[str, VariantResult], gone: list[str],
                          kinds: list[str], evidence: list[str]) -> None:
    """A skip convicts the step's data only if skipping as many other steps (the control)
    leaves the spike."""
    _against_control("skip", by.get("control") or next((r for r in results if r.kind == "control"), None),
                     gone, kinds, evidence, same="as many other steps skipped",
                     unconvicted="a skip removes its steps' updates (and, with the LR frozen over them, holds back "
                                 "every later step's LR), not only their data: the data is not convicted",
                     not_this="removing that many updates removed it, not this data: not bad_data",
                     this="the skipped steps' data removed it, not their number")


def _swap(sw: VariantResult | None, gone: list[str], kinds: list[str], evidence: list[str]) -> None:
    """The DP ranks' batches rotated: the anomaly following the data is ``bad_data``,
    staying on its rank a rank-local fault."""
    if sw is None or not sw.swap:
        return
    f = sw.swap.get("follows")
    evidence.append(f"swap: the anomaly (DP rank {sw.swap.get('original_rank')}) "
                    + ("followed the data to DP rank " + str(sw.swap.get("rerun_rank")) + ": bad_data"
                       if f == "data" else "stayed on DP rank " + str(sw.swap.get("rerun_rank"))
                       + ": a rank-local fault (hardware)" if f == "rank"
                       else f"went to DP rank {sw.swap.get('rerun_rank')}: inconclusive"))
    if f == "data" and "bad_data" not in gone:
        gone.append("bad_data")
        kinds.append("swap")
    elif f == "rank" and sw.present:
        gone.append("hardware")
        kinds.append("swap")


def _certainty(out: dict, shown: bool, step: int) -> None:
    """How sure ``shown`` (same reproduced it and a counterfactual removed it, or same did
    not reproduce it) makes the cause (issue 24): bad data is proven only by the sharp
    counterfactual -- masking only the named documents (quarantine) removes it; a skip of
    the whole step (or a swap that moves it with the batch) shows only "something in this
    step's data". ``proven`` is certainty == "proven", nothing else."""
    cause, removed_by = out["cause"], out["removed_by"]
    if shown and cause == "bad_data" and removed_by != "quarantine":
        out["certainty"] = "evidence"
        out["certainty_rule"] = (f"{removed_by} removed it: something in step {step}'s data, not which "
                                 f"documents (the quarantine variant, only the named documents masked, proves that)")
    elif shown:
        out["certainty"] = "proven"
        out["certainty_rule"] = ("same did not reproduce it from the same checkpoint and data" if removed_by == "same"
                                 else f"same reproduced it and {removed_by} removed it")
    out["proven"] = out.get("certainty") == "proven"


def _bit_equal_through(r: VariantResult) -> int | None:
    last = None
    for row in r.steps:
        if not row.get("bit_equal"):
            break
        last = row["step"]
    return last
