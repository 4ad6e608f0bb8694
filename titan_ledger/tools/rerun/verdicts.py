"""The verdict: which cause the reruns' comparisons prove, with the evidence (pure)."""

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
    cause, proven, removed_by = None, False, None
    if same is not None:
        at, o = same.at_step or {}, same.original_at_step or {}
        if not same.present:
            cause, proven, removed_by = "hardware", True, "same"
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
        gone, kinds = [], []
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
                kinds.append(kind)
                what = ("step skipped; no spike in the steps after" if kind == "skip" else
                        f"only the named documents masked ({r.variant.split('=', 1)[-1]}), the rest of the "
                        f"batch trained; loss {at.get('loss')}, grad norm {at.get('grad_norm')}"
                        if kind == "quarantine" else
                        f"loss {at.get('loss')}, grad norm {at.get('grad_norm')}, flagged {r.flagged or 'none'}")
                evidence.append(f"{r.variant}: gone ({what}): {c}")
        if "quarantine" in kinds:  # likewise a quarantine (plan.quarantine_control)
            qc = next((r for r in results if r.kind == "qcontrol"), None)
            if qc is None or not qc.applicable or qc.present is None:
                why = ("no same-size control ran" if qc is None else
                       f"its control could not run ({qc.note or 'not applicable'})")
                evidence.append(f"quarantine: removed it, but {why}: masking any text of a step can move its "
                                f"update: the documents are not convicted")
                qc = None
            elif qc.present is False:
                evidence.append(f"{qc.variant}: gone as well (as many tokens of other documents masked): "
                                f"not these documents")
                qc = None
            else:
                evidence.append(f"{qc.variant}: still present (as many tokens of other documents masked): "
                                f"these documents, not the amount of text")
            if qc is None:
                i = kinds.index("quarantine")
                del gone[i], kinds[i]
        if "skip" in kinds:  # a skip convicts only against its same-size control (plan.skip_control)
            ctl = by.get("control") or next((r for r in results if r.kind == "control"), None)
            if ctl is None or not ctl.applicable or ctl.present is None:
                why = ("no same-size control ran" if ctl is None else
                       f"its control could not run ({ctl.note or 'not applicable'})")
                evidence.append(f"skip: removed it, but {why}: a skip removes its steps' updates (and, with the "
                                f"LR frozen over them, holds back every later step's LR), not only their data: "
                                f"the data is not convicted")
            elif ctl.present is False:
                evidence.append(f"{ctl.variant}: gone as well (as many other steps skipped): removing that many "
                                f"updates removed it, not this data: not bad_data")
            else:
                evidence.append(f"{ctl.variant}: still present (as many other steps skipped): the skipped steps' "
                                f"data removed it, not their number")
                ctl = "kept"
            if ctl != "kept":
                i = kinds.index("skip")
                del gone[i], kinds[i]
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
                kinds.append("swap")
            elif f == "rank" and sw.present:
                gone.append("hardware")
                kinds.append("swap")
        if gone:
            cause, removed_by = gone[0], kinds[0]
            proven = same is not None and same.present
            if same is None:
                evidence.append("same was not run: the spike's reproducibility is not shown")
        else:
            cause = "unproven"
    # ``shown``: same reproduced it and a counterfactual removed it (or same did not
    # reproduce it); how sure that makes the cause (issue 24): bad data is proven only by
    # the sharp counterfactual -- masking only the named documents (quarantine) removes
    # it; a skip of the whole step (or a swap that moves it with the batch) shows only
    # "something in this step's data". ``proven`` is certainty == "proven", nothing else.
    shown = proven
    out = {"step": step, "cause": cause, "evidence": evidence, "removed_by": removed_by}
    if shown and cause == "bad_data" and removed_by != "quarantine":
        out["certainty"] = "evidence"
        out["certainty_rule"] = (f"{removed_by} removed it: something in step {step}'s data, not which "
                                 f"documents (the quarantine variant, only the named documents masked, proves that)")
    elif shown:
        out["certainty"] = "proven"
        out["certainty_rule"] = ("same did not reproduce it from the same checkpoint and data" if removed_by == "same"
                                 else f"same reproduced it and {removed_by} removed it")
    out["proven"] = out.get("certainty") == "proven"
    if heuristic is not None:
        out["heuristic"] = heuristic
        out["heuristic_confirmed"] = shown and cause == heuristic
        if shown and cause != heuristic:
            out["heuristic_wrong"] = True
    return out


def _bit_equal_through(r: VariantResult) -> int | None:
    last = None
    for row in r.steps:
        if not row.get("bit_equal"):
            break
        last = row["step"]
    return last
