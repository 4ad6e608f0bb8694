"""The answer's words that are not the cause's: numbers for a reader, what an incident was
(its title), and what the run did about it.

Design decision: one place turns recorded values into the words every view prints -- the
console, ``diagnose``, the page, the dashboards and ``export`` all show the same number the
same way (3 significant digits, ``53x``) -- so that the answer reads the same wherever it is
read. What a held-back verdict would have done is said in the proof's own words
(:func:`titan_ledger.format.proofs.held_back_words`).
"""

from __future__ import annotations

import math
from typing import Any

from titan_ledger.format.answers.records import Context
from titan_ledger.format.proofs import ProofRecord, held_back_words


def num(v: Any, digits: int = 3) -> str:
    """A number rounded for a reader (3 significant digits, thousands grouped, no 1e+03)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e6:
        r = float(f"{v:.{digits}g}")
        return f"{r:,.0f}" if abs(r) >= 1000 else f"{r:g}"
    return f"{v:.{digits - 1}e}"


def times(v: Any) -> str:
    """A ratio in words: ``4.1x``, ``53x``, ``2,080x``."""
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return f"{v}x"
    return f"{v:.2g}x" if v < 10 else f"{round(v):,}x"


#: the rules that single out a DP rank or a document (a flag of data, not of the whole model)
EVIDENCE_RULES = frozenset({"rank_separation", "doc_high", "doc_low", "rank_loss"})
#: the titles of an incident whose loss rose (a flag, the stall rule's climb)
LOSS_SPIKE, LOSS_CLIMBING = "loss spike", "loss climbing back (stall rule)"


def title_of(kind: str, event: dict[str, Any] | None, ctx: Context) -> str:
    """What the incident was, from the rules that fired and the loss's direction: a flag on
    a falling loss is a grad-norm jump, not a loss spike."""
    ev = event or {}
    if kind == "stall":
        st = ev.get("stall") or {}
        return LOSS_CLIMBING if st.get("kind") == "diverging" else "stall"
    rules = set(ev.get("rules") or ())
    # the rules' own reference: the recent median (``loss_recent``; older events: the window's)
    loss, med = ev.get("loss"), ev.get("loss_recent", ev.get("loss_median"))
    if "non_finite" in rules or (isinstance(loss, float) and not math.isfinite(loss)):
        return "non-finite loss or grad norm"
    up = isinstance(loss, (int, float)) and isinstance(med, (int, float)) and loss > (1 + ctx.loss_jump) * med
    down = isinstance(loss, (int, float)) and isinstance(med, (int, float)) and loss < (1 - ctx.loss_jump) * med
    grad = rules & {"zscore_grad_norm", "ratio", "grad_jump", "grad_move"}
    if ev.get("promoted_by_proof"):
        return "a note its proof convicted"
    if up or "zscore_loss" in rules:
        return LOSS_SPIKE
    if grad:
        return "grad-norm jump" + (" (the loss fell)" if down else " (the loss unmoved)")
    if rules & EVIDENCE_RULES:
        return "data outlier"
    return "flagged step"


#: what an applied (or held-back) update was, in words
_APPLIED = {"same": "applied the recomputed update", "original": "applied the first update",
            "none": "applied no update", "masked": "trained without the convicted data and quarantined it",
            "control": "trained without the convicted data and quarantined it"}


def did(proof: ProofRecord | None, event: dict[str, Any] | None) -> tuple[str, str | None]:
    """What the run did about the step, and what acting would have done (held back: the
    policy ``observe`` or a bound)."""
    ev = event or {}
    action = ev.get("action")
    configured = (f"; then the configured action ({action})" if action not in (None, "none")
                  and not str(action).startswith("proof") else "")
    if proof is None:
        return (f"the configured action ({action})" if action not in (None, "none") else
                "nothing (the update was applied)"), None
    applied, wants, held = proof.applied, proof.would_apply, proof.held_back
    # a deferred decision (the next step's data was the control): when, so a reader knows the update waited
    late = f" (decided at step {proof.decided_at}, the update held until then)" if proof.decided_at is not None else ""
    if held is not None and wants:
        return (f"nothing (the update was applied{late}; held back by {held_back_words(held, brief=True)})"
                + configured, _APPLIED.get(wants, str(wants)))
    if applied in (None, "original"):
        return f"nothing (the update was applied{late})" + configured, None
    return _APPLIED.get(applied, str(applied)) + late, None
