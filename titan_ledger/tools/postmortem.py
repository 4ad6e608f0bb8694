"""What the trainer did about a step: the postmortem of automatic actions (pure reads).

Design decision: one place answers "was step T flagged, what did the trainer decide,
and what became of it" from the run's own records -- the spike event (its rules
and evidence stats, ``spikes.jsonl``), the recovery ladder's decision, an
in-process rewind (``rewind_to``, ``skip_window``), the signals row as it stood
when the step ran (``update_skipped``) and the current history (the window that
now holds the step, the steps trained after it). ``diagnose``, ``report``
(through :func:`titan_ledger.tools.incident.judge`), ``lookup``, ``rollback`` and
``replay rerun`` print the same sentence. Imports only the format layer, so the
light tools (lookup, rollback) do not load the decision tree.
"""

from __future__ import annotations

import math
from typing import Any

from titan_ledger.format.reader import RunLedger

AFTER = 5  # trained steps after the action whose outcome is summarized


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v, digits: int = 4) -> str:
    f = _num(v)
    return "n/a" if f is None else (f"{f:.{digits}g}" if math.isfinite(f) else str(f))


def _span(a: int, b: int) -> str:
    return f"{a}" if a == b else f"{a}\u2013{b}"


def actions_at(led: RunLedger, step: int) -> dict[str, Any]:
    """The recorded facts about ``step``: ``flagged`` (the trainer's event, last of
    any launch), ``rules``, ``ladder`` (its decision), ``action`` (what was done:
    ``skip_update``, ``rollback``, ``rollback_lr:X``, ``stop``, ``none``; None when
    not flagged), ``update_skipped``, ``rewind`` (``{"from", "to", "skip_window"}``:
    the rollback that undid this step, its own or a later spike's), ``now``
    (``trained`` / ``skipped`` with ``window`` / ``absent``: the current history),
    ``after`` (the outcome of the steps trained after the action) and ``summary``
    (one sentence)."""
    # the step's own rows, read through the offset index (O(log n), however long the run)
    hist = led.history_at(step, 0, 0)
    then, current = hist if hist is not None else ([], True)
    at = next((r for r in then if r["step"] == step and not r.get("skipped")), None)
    events = [e for e in led.spike_events() if int(e["step"]) == step]
    ev = events[-1] if events else None
    ladder = [e for e in led.ladder_actions() if int(e["step"]) == step]
    rewinds = led.rewinds()
    own = [r for r in rewinds if int(r["step"]) == step]
    undone = own[-1] if own else next((r for r in rewinds if int(r["rewind_to"]) < step <= int(r["step"])
                                       and at is not None and not current), None)
    now_row = next(iter(led.signals_between(step, step)), None)
    out: dict[str, Any] = {
        "step": step, "flagged": ev is not None, "rules": list(ev.get("rules", [])) if ev else [],
        "suspect_dp_rank": (ev or {}).get("suspect_dp_rank"),
        "ladder": ladder[-1] if ladder else None,
        "update_skipped": bool(at and at.get("update_skipped")),
        "trained": at is not None,
        "proof": (ev or {}).get("proof"),  # the proof at the alarm, when one ran
    }
    action = None
    if ladder:
        action = ladder[-1].get("action")
    elif ev is not None:
        action = ev.get("action")
    if ev is None and not ladder:
        action = None
    out["action"] = action
    if undone is not None:
        w = undone.get("skip_window") or [None, None]
        out["rewind"] = {"from": int(undone["step"]), "to": int(undone["rewind_to"]),
                         "skip_window": [int(w[0]), int(w[1])] if None not in w else None}
    else:
        out["rewind"] = None
    if now_row is None:
        out["now"] = "absent"
    elif now_row.get("skipped"):
        out["now"] = "skipped"
        out["window"] = [now_row["step"], now_row.get("last_step", now_row["step"])]
    else:
        out["now"] = "trained"
    out["superseded"] = at is not None and not current
    out["after"] = _after(led, step, out, ev)
    out["summary"] = describe(out)
    return out


def _after(led: RunLedger, step: int, facts: dict, ev: dict | None) -> dict | None:
    """The steps the current history trained after the action (a rollback: after its
    skipped window; an update skip: after the step), with the first one's numbers
    against the trainer's window medians at the flag."""
    if facts["rewind"] and facts["rewind"]["skip_window"]:
        start = facts["rewind"]["skip_window"][1] + 1
    elif facts["update_skipped"] or facts["action"] not in (None, "none"):
        start = step + 1
    else:
        return None
    rows = [r for r in led.signals_between(start, start + AFTER - 1) if start <= r["step"] < start + AFTER
            and not r.get("skipped") and r.get("loss") is not None]
    if not rows:
        return {"first": start, "steps": [], "note": f"no step trained after {start - 1} (the run ended)"}
    flagged = sorted({int(e["step"]) for e in led.spike_events()
                      if rows[0]["step"] <= int(e["step"]) <= rows[-1]["step"] and int(e["step"]) != step})
    first = rows[0]
    med_g, med_l = (ev or {}).get("grad_norm_median"), (ev or {}).get("loss_median")
    g, lo = _num(first.get("grad_norm")), _num(first.get("loss"))
    return {"first": first["step"], "steps": [r["step"] for r in rows], "flagged": flagged,
            "grad_norm": g, "loss": lo,
            "grad_norm_vs_median": g / med_g if g is not None and _num(med_g) else None,
            "loss_vs_median": lo / med_l if lo is not None and _num(med_l) else None}


def describe(f: dict) -> str:
    """One sentence: flagged by what, what was done, what followed."""
    parts = []
    if f["flagged"]:
        lad = f.get("ladder")
        how = (f" (recovery ladder rung {lad.get('rung')}, attempt {lad.get('attempt')})"
               if lad and lad.get("attempt") is not None else "")
        parts.append(f"flagged by the trainer ({', '.join(f['rules']) or 'rules not recorded'}); "
                     f"action {f['action']}{how}")
    else:
        parts.append("not flagged by the trainer")
    if f.get("proof"):  # the proof's verdict and what it applied; its full account is the answer's
        p = f["proof"]
        parts.append(f"proven in step: {p.get('verdict')}" + (
            f", applied {p['applied']}" if p.get("applied") not in (None, "original") else "")
                     + (f" (would have applied {p['would_apply']}; held back: {p['held_back']})"
                        if p.get("held_back") else ""))
    act = str(f.get("action") or "").split("*")[0]  # a ladder rung's name: action[:lr][*attempts]
    rw = f.get("rewind")
    if f["update_skipped"] and not rw:
        parts.append("its update was not applied (params, optimizer moments and step count unchanged)")
    if rw:
        w = rw["skip_window"]
        own = rw["from"] == f["step"]
        parts.append(("its update was not applied; " if own and f["update_skipped"] else "")
                     + (f"rolled back to checkpoint step-{rw['to']}" if own else
                        f"undone by the rollback from step {rw['from']} to checkpoint step-{rw['to']}")
                     + (f", skipped {_span(*w)}" if w else ""))
        if act.startswith("rollback_lr:"):
            parts.append(f"LR scaled by {act.split(':', 1)[1]} from then on")
    elif act in ("stop", "exhausted"):
        parts.append("the recovery ladder stopped the run here")
    elif act == "none" and f["flagged"]:
        parts.append("nothing done (the update was applied)")
    if f["now"] == "skipped" and not rw:
        w = f.get("window") or [f["step"], f["step"]]
        parts.append(f"a later launch skipped it (window {_span(*w)}: --ledger.skip.steps or --ledger.skip.auto)")
    elif f.get("superseded") and not rw:
        parts.append("a later launch resumed from an earlier checkpoint and trained it again")
    a = f.get("after")
    if a:
        if not a["steps"]:
            parts.append(a["note"])
        else:
            fl = a["flagged"]
            rel = ""
            if a.get("grad_norm_vs_median") is not None:
                rel = (f" ({a['grad_norm_vs_median']:.2f}x the trainer's window median"
                       + (f"; loss {_fmt(a['loss'])}, {a['loss_vs_median']:.2f}x" if a.get("loss_vs_median") else "")
                       + ")")
            verb = "retrained as" if rw else "trained on as"
            parts.append(f"{verb} steps {_span(a['steps'][0], a['steps'][-1])}: "
                         + (f"flagged again at {', '.join(map(str, fl))}" if fl else "none flagged")
                         + f"; grad norm {_fmt(a['grad_norm'])} at step {a['first']}{rel}")
    return "; ".join(parts)

