"""The answer said: three lines, the detail, a headline, flat columns, the console's block.

Design decision: every view renders the one record (:class:`~.records.Answer`) through
these functions -- the trainer's console and the W&B alert, ``diagnose``, the incident
page, TensorBoard's text, ``export``'s columns -- so an incident reads the same everywhere
and no view derives a cause or a fix of its own. The decision tree's reading, which is not
part of the answer, may be shown beside it (``reading``: its candidate fixes, from
:func:`~.build.tree_candidates`) where the answer has no fix; it is listed as untested,
never as the answer's.
"""

from __future__ import annotations

import math
from typing import Any

from titan_ledger.format.answers.records import ESTABLISHED, Answer, Fix
from titan_ledger.format.answers.words import num, times


def candidates_of(a: Answer, reading: tuple[Fix, ...] | list[Fix] = ()) -> tuple[Fix, ...]:
    """The candidates a view lists: the answer's, then the tree's reading (only where the
    answer has no fix and names no data or hardware)."""
    if a.fix is not None or a.cause in ("hardware", "bad_data") or not reading:
        return a.candidates
    return (*a.candidates, *reading)


def _fix_line(a: Answer, candidates: tuple[Fix, ...]) -> str:
    if a.fix is not None:
        why = "; ".join(x for x in (a.fix.detail, a.not_proven if a.fix.effect == "not measured" else None) if x)
        return f"fix: {a.fix.change}: {a.fix.effect}" + (f" ({why})" if why else "")
    if candidates:
        return ("fix: none measured" + (f" ({a.not_proven})" if a.not_proven else "")
                + "; candidate (untested): " + "; ".join(c.change for c in candidates[:3]))
    if a.quarantine:
        return f"fix: quarantine the convicted document(s) {', '.join(a.documents[:4])} (the command below)"
    if a.cause == "bad_data" and not a.documents:
        return ("fix: the data of this step, documents not yet named (replay rerun --variant quarantine names "
                "them; a rollback that skips the step avoids it)")
    if a.cause == "bad_data":
        return "fix: the convicted data was quarantined by the trainer"
    if a.cause == "hardware":
        return "fix: none in the configuration: a fault, not a setting (if it recurs on the ranks named, replace them)"
    if a.established == "in_step" and not a.cause:
        return "fix: none needed (the update was normal with the data that stood out)"
    return "fix: none measured" + (f" ({a.not_proven})" if a.not_proven else "")


def head_line(a: Answer) -> str:
    """The first line: what, where, the cause and how it was established."""
    return f"{a.title} at step {a.step}: {a.cause_text}" + (
        "" if a.established in ("none", "unseparated") else f" -- {ESTABLISHED[a.established]}")


def lines(a: Answer, reading: tuple[Fix, ...] | list[Fix] = ()) -> list[str]:
    """The answer in three short lines: what and why, the fix, what was done."""
    done = f"done: {a.did}" + (f"; acting would have {a.acting}" if a.acting else "")
    return [head_line(a), f"  {_fix_line(a, candidates_of(a, reading))}", f"  {done}"]


def run_it(a: Answer) -> str | None:
    """The line that gives the fix's command (None: the answer has none)."""
    return f"  run it ({a.start}, into a new folder): {a.command}" if a.command else None


def detail(a: Answer, reading: tuple[Fix, ...] | list[Fix] = ()) -> list[str]:
    """What follows the three lines: how, every fix tried, the command, why not proven."""
    out = [f"  how: {a.how}"] if a.how else []
    if a.not_proven and a.not_proven not in lines(a, reading)[1]:  # (said on the fix line already)
        out.append(f"  not proven: {a.not_proven}")
    if a.fixes:
        where = f" (the window from step {a.window_from})" if a.window_from is not None else ""
        out.append(f"  fixes tried{where}, best first: " + "; ".join(
            f"{f.change or f.variant} {f.effect}" + (f" ({f.detail})" if f.detail else "") for f in a.fixes))
    if a.separates is False:
        out.append("  the window alone does not separate the causes: more than one mechanism's fix removed it "
                   "(ranked above by effect)" + ("; the in-step measurement names the cause"
                                                if a.established == "in_step+window" else ""))
    if a.command:
        out.append(run_it(a))
    elif a.fix is not None and a.fix.flags:
        out.append("  no command: the run records no launch (train with python -m titan_ledger.train)")
    elif candidates_of(a, reading):
        out.append("  no command: a candidate is untested for this incident (diagnose --rerun proves a cause "
                   "from a checkpoint)")
    return out


def headline(a: Answer) -> str:
    """One line (a W&B alert's title, a table cell)."""
    return f"{a.title} at step {a.step}: {a.cause_text}"


def signals_line(ev: dict[str, Any]) -> str:
    """The signals that flagged the step, in words (its event's statistics)."""
    rank = (f"suspect DP rank {ev['suspect_dp_rank']}" if "suspect_dp_rank" in ev else
            f"highest-loss DP rank {ev.get('loss_max_rank')}")
    g, med = ev.get("grad_norm"), ev.get("grad_norm_median")
    ratio = (f" = {times(g / med)} its median"
             if isinstance(g, float) and isinstance(med, float) and med and math.isfinite(g) else "")
    return (f"loss {num(ev.get('loss'))} (recent median {num(ev.get('loss_recent', ev.get('loss_median')))}), "
            f"grad norm {num(ev.get('grad_norm'))}{ratio}; rules {', '.join(ev.get('rules', []))}; {rank}")


def console(a: Answer, ev: dict[str, Any] | None) -> str:
    """An incident on the console (the trainer's warning): the three lines, the signals
    that flagged it, and the command that applies the fix."""
    out = lines(a)
    if ev is not None:
        out.append(f"  signals: {signals_line(ev)}")
    if a.command:
        out.append(run_it(a))
    return "\n".join(out)


def columns(a: Answer) -> dict[str, Any]:
    """The answer flattened (``export``'s ``answer_*`` columns, the dashboards' texts)."""
    return {"answer_title": a.title, "answer_cause": a.cause or None, "answer_driver": a.driver,
            "answer_cause_text": a.cause_text, "answer_established": a.established,
            "answer_separates": a.separates, "answer_fix": a.fix.change if a.fix else None,
            "answer_fix_effect": a.fix.effect if a.fix else None,
            "answer_fix_flags": list(a.fix.flags) if a.fix else None,
            "answer_candidates": [c.change for c in a.candidates],
            "answer_command": a.command, "answer_start": a.start, "answer_not_proven": a.not_proven,
            "answer_did": a.did, "answer_acting": a.acting}


# --------------------------------------------------------------------------- a run's episodes
def episode_parts(ep) -> dict[str, Any]:
    """An episode's words, part by part (every view of an episode assembles these, none words
    its own): ``span``, ``title``, ``cause``, ``how`` (how it was established), ``why`` (the
    readings behind it), ``fix_label`` and ``fix`` (the fix line's two halves), ``incidents``
    (shown, and how many), ``notes``, ``start`` and ``command``."""
    from titan_ledger.format.answers.episodes import ESTABLISHED_EPISODE

    label, _, fix = episode_fix_line(ep).partition(": ")
    shown = ", ".join(map(str, ep.incidents[:INCIDENTS_SHOWN])) + (" ..." if len(ep.incidents) > INCIDENTS_SHOWN
                                                                   else "")
    return {"span": f"steps {ep.onset}-{ep.last}" if ep.last != ep.onset else f"step {ep.onset}",
            "title": ep.title, "cause": ep.cause_text,
            "how": "" if ep.established == "none" or ep.kind == "shift" else ESTABLISHED_EPISODE[ep.established],
            "why": ep.how, "fix_label": label, "fix": fix,
            "incidents": f"{len(ep.incidents)} (steps {shown})" if ep.incidents else "", "notes": list(ep.notes[:3]),
            "start": ep.start, "command": ep.command}


#: the incidents an episode's lines list by step (the rest: "...")
INCIDENTS_SHOWN = 12


def episode_head(ep) -> str:
    """An episode's first line: its steps, what happened, its cause and how it was established."""
    p = episode_parts(ep)
    return f"{p['span']}: {p['title']}: {p['cause']}" + (f" -- {p['how']}" if p["how"] else "")


def episode_fix_line(ep) -> str:
    if ep.kind == "shift":
        return "fix: none needed (a change of data, not a fault: the loss rose with the new data)"
    if ep.fix is not None:
        return f"fix: {ep.fix.change}: {ep.fix.effect}" + (f" ({ep.fix.detail})" if ep.fix.detail else "")
    if ep.cause == "hardware":
        return "fix: none in the configuration: a fault, not a setting"
    if ep.cause == "bad_data":
        return "fix: the convicted data (see the incident)"
    if ep.proof is not None:  # proven once: what it tried, none of which fixed it
        first, last = ep.proof.horizon
        return (f"fix: none of the {len(ep.proof.variants)} fix(es) tried over steps {first}-{last} fixed it ("
                + "; ".join(f"{v.get('change')}: {v.get('effect')}" for v in ep.proof.variants) + ")")
    if ep.candidates:
        return ("fix: none proven; candidates (untested): " + "; ".join(c.change for c in ep.candidates[:4])
                + " -- diagnose RUN --rerun proves them over the episode's horizon")
    return ("fix: none measured (diagnose RUN --rerun tries the LR's cut over the episode's horizon; "
            "diagnose RUN --step N --rerun reruns one incident's step from a checkpoint)")


def episode_lines(ep, detail: bool = True) -> list[str]:
    """An episode in a few lines: what and why, the fix, the incidents it explains, the command."""
    p = episode_parts(ep)
    out = [episode_head(ep), f"  {p['fix_label']}: {p['fix']}"]
    if detail and p["why"]:
        out.append(f"  how: {p['why']}")
    if p["incidents"]:
        out.append(f"  incidents: {p['incidents']}")
    out += [f"  note: {n}" for n in p["notes"]]
    if p["command"]:
        out.append(f"  run it ({p['start']}, into a new folder): {p['command']}")
    return out


def episodes_block(eps: list, detail: bool = True) -> list[str]:
    """Every episode of a run, first thing a view says of it."""
    if not eps:
        return ["episodes: none (no incident, and the model's health never left its regime)"]
    out = [f"episodes: {len(eps)}"]
    for i, ep in enumerate(eps, 1):
        lines = episode_lines(ep, detail)
        out += [f"episode {i}, {lines[0]}", *lines[1:]]
    return out


#: an episode's flat columns and their kinds (``export``'s episodes table, the W&B table)
EPISODE_COLUMNS = {"onset": "int", "last": "int", "kind": "str", "title": "str", "cause": "str", "cause_text": "str",
                   "driver": "str", "established": "str", "incidents": "list", "fix": "str", "fix_flags": "list",
                   "candidates": "list", "command": "str", "start": "str"}


def episode_columns(ep) -> dict[str, Any]:
    """An episode flattened, :data:`EPISODE_COLUMNS` in order."""
    out = {"onset": ep.onset, "last": ep.last, "kind": ep.kind, "title": ep.title, "cause": ep.cause or None,
           "cause_text": ep.cause_text, "driver": ep.driver, "established": ep.established,
           "incidents": list(ep.incidents), "fix": ep.fix.change if ep.fix else None,
           "fix_flags": list(ep.fix.flags) if ep.fix else None, "candidates": [c.change for c in ep.candidates],
           "command": ep.command, "start": ep.start}
    return {k: out[k] for k in EPISODE_COLUMNS}
