"""``python -m titan_ledger.report RUN -o page.html``: the run's page -- its episodes first, then
its incidents.

Design decision: a user opening a run that went wrong wants its answer before its detail: how
many episodes, each one's cause, how that was established and the command that fixes it, in
the first screen (1280 x 900), then every incident with its own answer and the episode it
belongs to; an incident's own page (``report RUN --step N``) holds its detail. Everything on
the page is the records' words (:mod:`titan_ledger.format.answers.render`): one answer in
every view. Self-contained HTML, no scripts, no external resources.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from titan_ledger.format import records
from titan_ledger.format.answers import render
from titan_ledger.format.answers.episodes import episode_of
from titan_ledger.format.answers.of_run import RunAnswers
from titan_ledger.format.reader import RunLedger

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:20px auto;max-width:1180px;color:#222}
h1{font-size:20px;margin:4px 0 8px}h2{font-size:16px;border-bottom:1px solid #ccc;margin-top:22px}
.ep{padding:6px 12px;background:#fff4e5;border:1px solid #f0b060;margin:6px 0}.ep p{margin:3px 0}
.ep .cause{font-size:16px;font-weight:bold}.ep pre{white-space:pre-wrap;word-break:break-all;margin:3px 0;
font-size:11px;background:#f6f6f6;padding:4px}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top;
font-size:12px}th{background:#f4f4f4}code{background:#f6f6f6;padding:1px 3px;font-size:12px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def episode_box(i: int, ep) -> str:
    """One episode, in the words every view uses (``render.episode_parts``): the cause in large
    type, how it was established, the fix, the command, the incidents and notes."""
    p = render.episode_parts(ep)
    parts = [f"<p>Episode {i}, {_e(p['span'])}: {_e(p['title'])}</p>", f"<p class='cause'>{_e(p['cause'])}</p>",
             f"<p><b>How:</b> {_e(p['how'] or 'not established')}" + (f": {_e(p['why'])}" if p["why"] else "") + "</p>",
             f"<p><b>{_e(p['fix_label'].capitalize())}:</b> {_e(p['fix'])}</p>"]
    if p["command"]:
        parts.append(f"<p><b>Run it</b> ({_e(p['start'])}, into a new folder):</p><pre>{_e(p['command'])}</pre>")
    if p["incidents"]:
        parts.append(f"<p>Incidents: {_e(p['incidents'])}</p>")
    parts += [f"<p>Note: {_e(n)}</p>" for n in p["notes"]]
    return "<div class='ep'>" + "".join(parts) + "</div>"


def page(dump, ledger_folder: str = records.LEDGER_FOLDER) -> tuple[str, dict[str, Any]]:
    """The run page's HTML and what it holds."""
    ra = RunAnswers(RunLedger(dump, ledger_folder))
    eps = ra.episodes()
    answers = [a for a in (ra.answer(s) for s in ra.steps()) if a is not None]
    head = (f"<h1>Run {_e(dump)}: {len(eps)} episode(s), {len(answers)} incident(s)</h1>"
            + ("".join(episode_box(i, ep) for i, ep in enumerate(eps, 1)) if eps else
               "<p>No episode: no incident, and the model's health never left its regime.</p>"))
    rows = []
    for a in answers:
        ep = episode_of(eps, a.step)
        k = eps.index(ep) + 1 if ep is not None else None
        rows.append("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in (
            a.step, a.title, a.cause_text, a.established, a.fix.change if a.fix else "-",
            f"episode {k}" if k else "-")) + "</tr>")
    table = ("<h2>Incidents (each one's own answer; report RUN --step N for its page)</h2><table><tr><th>step</th>"
             "<th>what</th><th>its own answer</th><th>established</th><th>its fix</th><th>episode</th></tr>"
             + "".join(rows) + "</table>") if rows else ""
    body = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>titan_ledger run: {_e(dump)}"
            f"</title><style>{CSS}</style></head><body>{head}{table}</body></html>")
    return body, {"episodes": [e.to_json() for e in eps], "incidents": [a.step for a in answers]}


def write(dump, out: Path, ledger_folder: str = records.LEDGER_FOLDER) -> dict[str, Any]:
    text, info = page(dump, ledger_folder)
    Path(out).write_text(text, encoding="utf-8")
    return {**info, "out": str(out), "bytes": len(text)}
