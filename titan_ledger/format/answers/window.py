"""The window proof's re-runs as fixes: each judged once, ranked once.

Design decision: the window proof (``components/response/window_proof.py``) records each
re-run's effect under its one judge (``verdict.window_effect``); this module turns the
record into :class:`~.records.Fix` rows -- each a change to this run, derived from the
run's settings and the window's own parameters -- and ranks them, so that every answer
reads the same ranking: the better effect first, then the loss over the window's last
steps (a fix stays in the run for the rest of it: of two that remove the spike, the one
that trained better is the one to keep), then the excess left.
"""

from __future__ import annotations

from typing import Any

from titan_ledger.format.answers.causes import WINDOW_CAUSE, Knobs, derive
from titan_ledger.format.answers.records import EFFECTS, Fix
from titan_ledger.format.answers.words import num


def _signal_detail(r: dict[str, Any], same: dict[str, Any] | None) -> str:
    if same is None:
        return ""
    if r.get("moved_to") is not None:
        return f"an earlier step of the window, {r['moved_to']}, flagged instead"
    return f"grad norm {num(same.get('grad_norm'))} -> {num(r.get('grad_norm'))}, loss {num(same.get('loss'))} -> " \
           f"{num(r.get('loss'))}"


def window_fixes(window: dict[str, Any], knobs: Knobs) -> tuple[list[Fix], dict[str, Any] | None]:
    """Every fix the window tried, with its effect under the window's one judge, best first
    (removed before lowered before not removed; then the loss over the window's last steps,
    lowest first; then the excess left), and the unchanged re-run (``same``)."""
    runs = window.get("runs") or []
    same = next((r for r in runs if r.get("variant") == "same"), None)
    stall = bool(window.get("stall"))
    out = []
    for r in runs:
        v = r.get("variant")
        if v in ("same", "control"):
            continue
        effect = r.get("effect")
        if effect is None:  # a record from before the one judge: its "normal" (a stall: the fixes list)
            fixed = {f["variant"] for f in window.get("fixes") or []}
            effect = ("lowered" if v in fixed else "not removed") if stall else \
                ("removed" if r.get("normal") else "not removed")
        ch = derive(v, knobs, window)
        none = (f"{v} (this ledger records none of the run's settings: it is from before the answers)"
                if knobs == Knobs() else f"{v} (no change to this run's settings makes it)")
        detail = (f"the window's last losses {num(r.get('cost'), 2)} against the unchanged re-run"
                  if stall and r.get("cost") is not None else _signal_detail(r, same))
        if not stall and r.get("cost") is not None:
            detail += f"; learning cost {num(r['cost'], 2)}"
        out.append(Fix(v, WINDOW_CAUSE.get(v, v), ch.flags if ch else (), ch.words if ch else none, effect, detail,
                       r.get("share"), r.get("cost"), ch.resumes if ch else True))
    order = {e: i for i, e in enumerate(EFFECTS)}
    out.sort(key=lambda f: (order.get(f.effect, 9), f.cost if f.cost is not None else 0.0,
                            f.share if f.share is not None else 1.0, f.variant))
    return out, same
