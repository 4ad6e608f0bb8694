"""``python -m titan_ledger.report``: a one-page incident report per loss spike.

Design decision: one self-contained HTML file per spike (no scripts, no external
resources; images are PNGs inlined as base64), built only from what the run left on
disk, read through :class:`titan_ledger.format.reader.RunLedger`: the signals around the
spike (the ``plot`` panels, rolled-back rows faint), each rank's own loss
(``rank<r>.jsonl``), the diagnosis (``decision.classify``, every question with its
numbers), the documents of the worst DP rank at the spike (the data ledger, with
per-document losses when the run recorded them), rerun results
(``<ledger>/rerun/``, when present), and the rollback plan (``rollback.plan``) with
the commands that apply it. A section whose input is missing says so instead of
failing the page.

Examples::

    python -m titan_ledger.report outputs/debug_cpu -o incident.html
    python -m titan_ledger.report outputs/debug_cpu --step 137000 -o incident.html --around 200
"""

from __future__ import annotations

import base64
import html
import io
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from titan_ledger.errors import ConfigError, LedgerCorrupt, LedgerError, TitanLedgerError
from titan_ledger.format import records
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools.cli import ToolParser, add_dump_folder, parse_args, run_tool

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid #ccc;margin-top:28px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;
vertical-align:top;font-size:13px}th{background:#f4f4f4}.yes{color:#b00;font-weight:bold}
.verdict{font-size:18px;padding:8px 12px;background:#fff4e5;border:1px solid #f0b060;display:inline-block}
.answer{padding:8px 14px;background:#fff4e5;border:1px solid #f0b060;margin:8px 0}
.answer p{margin:4px 0}.answer .cause{font-size:18px;font-weight:bold}.answer pre{white-space:pre-wrap;margin:4px 0}
code,pre{background:#f6f6f6;padding:2px 4px;font-size:12px}pre{padding:8px;overflow-x:auto}
img{max-width:100%;border:1px solid #eee}.none{color:#777;font-style:italic}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _num(v: Any) -> str:
    if v is None:
        return "n/a"  # (a page never shows a bare None)
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    return _e(v)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode()


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{b64}">'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else _num(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _facts(rows: list[list[Any]]) -> str:
    """A two-column table of facts: each row's name as its header cell, no empty header row."""
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v if isinstance(v, _Raw) else _num(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


class _Raw(str):
    """Already-escaped HTML for a table cell."""


# --------------------------------------------------------------------------- sections


def signals_section(led: RunLedger, step: int, around: int) -> tuple[str, dict]:
    """The signals panels around the spike (the PNG 1100 px wide, the page's width: shown at
    its own size in a window that wide) and ``plot``'s info (its ``layout`` included)."""
    from titan_ledger.tools.plot import plot

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "signals.png"
        info = plot(led.dump_folder, out, led.folder.name, from_step=max(1, step - around),
                    to_step=step + around, width_px=1100)
        b64 = base64.b64encode(out.read_bytes()).decode()
    return (f"<h2>Signals around step {step}</h2>" + _img(b64, f"signals around step {step}") +
            f"<p>Steps {max(1, step - around)}-{_last_step(led, step, around)}: "
            f"{info['rows']} trained steps, "
            f"{info['rolled_back_rows']} rolled-back rows (faint), {info['skipped_windows']} skipped "
            f"windows (grey), clip threshold max_norm {info['max_norm']}.</p>"), info


def _last_step(led: RunLedger, step: int, around: int) -> int:
    """The last recorded step up to ``step + around`` (a skipped window counts to its end; a
    superseded segment's rows too), at least ``step``: the window's rows, not the history."""

    f = led.signals_index
    rows = [r for seg in f.segments for r in f.rows_between(seg, step, step + around)]
    return max([step, *(min(step + around, int(r.get("last_step") or r["step"])) for r in rows)])


def ranks_section(led: RunLedger, step: int, around: int) -> str:
    per = led.rank_rows_between(step - around, step + around)
    if not per:
        return "<h2>Per-rank losses</h2><p class='none'>none recorded (no " + _e(records.RANK_GLOB) + ")</p>"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from titan_ledger.tools.incident import RANKS_LISTED, rank_summary

    fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
    series = {r: [x for x in rows if abs(x["step"] - step) <= around and x.get("loss") is not None
                  and math.isfinite(x["loss"])] for r, rows in sorted(per.items())}
    series = {r: sel for r, sel in series.items() if sel}
    if len(series) <= RANKS_LISTED:
        for r, sel in series.items():
            ax.plot([x["step"] for x in sel], [x["loss"] for x in sel], marker=".", lw=0.8, label=f"rank {r}")
    else:  # DP 512: the median, the 10-90% band and the ranks worst at the step, not 512 lines
        by_step: dict[int, list[float]] = {}
        for sel in series.values():
            for x in sel:
                by_step.setdefault(x["step"], []).append(x["loss"])
        steps = sorted(by_step)
        qs = [sorted(by_step[s]) for s in steps]

        def q(xs, p):
            return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]

        ax.fill_between(steps, [q(x, 0.1) for x in qs], [q(x, 0.9) for x in qs], alpha=0.25,
                        label=f"10-90% of {len(series)} ranks")
        ax.plot(steps, [q(x, 0.5) for x in qs], lw=1.0, label="median rank")
        at_step = {r: next((x["loss"] for x in sel if x["step"] == step), -math.inf) for r, sel in series.items()}
        for r in sorted(at_step, key=lambda k: -at_step[k])[:3]:
            sel = series[r]
            ax.plot([x["step"] for x in sel], [x["loss"] for x in sel], marker=".", lw=0.8, label=f"rank {r}")
    ax.axvline(step, color="red", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("local loss (nats/token)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0,
              frameon=False)  # right of the data, as on the signals panels: never over a line
    b64 = _png(fig)
    plt.close(fig)
    # the step as it trained: a rolled-back step's rows are in a superseded segment
    hits = led.rank_rows_at(step)
    current = {r for r, rows in per.items() if any(x["step"] == step and not x.get("skipped") for x in rows)}
    at = [[r, hits[r].get("loss"), hits[r].get("tokens")] for r in sorted(hits)]
    if len(at) > RANKS_LISTED:  # in words: count, median, spread, the worst ranks
        table = (f"<p>Each loss-owning rank's own average loss ({_e(records.RANK_GLOB)}) at step {step}: "
                 f"{_e(rank_summary({str(r): hits[r].get('loss') for r in sorted(hits)}))}.</p>")
    elif not at:
        table = f"<p class='none'>no rank file holds a trained row of step {step}</p>"
    else:
        when = "" if set(hits) <= current else \
            " (as it trained before a rollback or resume superseded it: the run trained on without that step)"
        table = (f"<p>Each loss-owning rank's own average loss ({_e(records.RANK_GLOB)}), at step {step}"
                 f"{when}:</p>" + _table(["rank", "loss", "tokens"], at))
    return "<h2>Per-rank losses</h2>" + _img(b64, "per-rank losses") + table


def diagnosis_section(led: RunLedger, step: int) -> tuple[str, dict | None]:
    """The verdict of :func:`titan_ledger.tools.incident.judge` -- the one diagnose
    prints: cause, certainty and its rule, the trainer's flag, what was done, the
    per-rank losses as the step trained, every question with its numbers."""
    from titan_ledger.tools.incident import judge, rank_phrase, rank_summary

    try:
        res = judge(led, step)
    except TitanLedgerError as e:
        return f"<h2>The decision tree's reading</h2><p class='none'>no diagnosis: {_e(e)}</p>", None
    except Exception as e:
        return (f"<h2>The decision tree's reading</h2><p class='none'>no diagnosis: {_e(type(e).__name__)}: "
                f"{_e(e)}</p>", None)
    extra = rank_phrase(res)
    extra += f" (underlying: {res['underlying']})" if res.get("underlying") else ""
    extra += f" (mechanism: {res['mechanism']})" if res.get("mechanism") else ""
    extra += f" (the tree said {res['heuristic']})" if res.get("heuristic") else ""
    rewound = " This step was later rolled back (the history as it stood then is used)." \
        if res.get("rewound") else ""
    t = res.get("trainer")
    flag = (f"rules {', '.join(t.get('rules', []))}"
            + (f"; notes {', '.join(t['notes'])}" if t.get("notes") else "")
            + f"; on_spike {t.get('action')}"
            + (f"; suspect DP rank {t['suspect_dp_rank']}" if t.get("suspect_dp_rank") is not None else "")
            if t else "not flagged" + (f" (a note: {', '.join(res['trainer_notes'])}; recorded, never acted on)"
                                       if res.get("trainer_notes") else ""))
    losses = rank_summary(res["rank_losses"]) if res.get("rank_losses") else "none recorded"
    tree = res.get("tree") or {"cause": res["cause"], "certainty": res["certainty"], "rule": res["certainty_rule"]}
    out = [f"<h2>The decision tree's reading</h2><p>Heuristics over the recorded signals (a candidate, never the "
           f"answer above): <b>{_e(tree['cause'])}{_e(extra)}</b> &mdash; {_e(tree['certainty'])}; grad norm "
           f"{_num(res.get('grad_norm_ratio'))}&times; the pre-spike median.{rewound}</p>",
           _facts([["its rule", tree.get("rule")], ["trainer", flag], ["recorded actions", res["done"]],
                   ["per-rank losses at the step", losses],
                   *([["onset", f"the fingerprint began at step {res['onset']}"]] if res.get("onset") else [])])]
    rows_t = []
    for c in res["checks"]:
        # each value escaped once (_num), the joined cell as it is: evidence_rules=['doc_high']
        # reads as written, not double-escaped
        nums = ", ".join(f"{_e(k)}={_num(v)}" for k, v in c.items() if k not in ("question", "answer"))
        ans = _Raw("<span class='yes'>YES</span>" if c["answer"] else "no")
        rows_t.append([ans, c["question"], _Raw(nums)])
    out.append(_table(["answer", "question", "numbers"], rows_t))
    return "".join(out), res


def answer_section(res: dict | None, step: int) -> tuple[str, str]:
    """The page's first box: the incident's answer (``format.answers``, the record every view
    renders) -- the cause and how it was established, the fix with its command, what was
    done and what acting would have done, why it was not proven -- and the page's title."""
    from titan_ledger.format.answers import ESTABLISHED, Answer, Fix, render

    a = Answer.of(res["answer"]) if res and res.get("answer") else None
    reading = [Fix.of(f) for f in (res or {}).get("reading") or []]  # the tree's candidates, beside the answer
    if a is None:
        return (f"<div class='answer'><p class='cause'>Step {step}: not an incident</p><p>The trainer did not flag "
                f"this step; the tree's reading is below.</p></div>"), f"step {step} (not flagged)"
    parts = [f"<p class='cause'>{_e(a.cause_text)}</p>",
             f"<p><b>How:</b> {_e(ESTABLISHED[a.established])}" + (f": {_e(a.how)}" if a.how else "") + "</p>"]
    if a.fix is not None:
        parts.append(f"<p><b>Fix:</b> <code>{_e(a.fix.change)}</code>: {_e(a.fix.effect)}"
                     + (f" ({_e(a.fix.detail)})" if a.fix.detail else "") + "</p>")
    elif render.candidates_of(a, reading):
        parts.append("<p><b>Fix:</b> none measured; candidate (untested): " + "; ".join(
            f"<code>{_e(c.change)}</code> ({_e(c.detail)})" for c in render.candidates_of(a, reading)[:3]) + "</p>")
    else:
        parts.append(f"<p><b>Fix:</b> {_e(render.lines(a)[1].strip().removeprefix('fix: '))}</p>")
    if a.command:
        parts.append(f"<p><b>Run it</b> ({_e(a.start)}, into a new folder):</p><pre>{_e(a.command)}</pre>")
    parts.append(f"<p><b>Done:</b> {_e(a.did)}" + (f"; acting would have {_e(a.acting)}" if a.acting else "")
                 + "</p>")
    if a.not_proven:
        parts.append(f"<p><b>Not proven:</b> {_e(a.not_proven)}</p>")
    if a.fixes:
        parts.append("<p><b>Fixes tried</b>" + (f" (the window from step {a.window_from})" if a.window_from is not None
                                                 else "") + ": " + "; ".join(
            f"<code>{_e(f.change or f.variant)}</code> {_e(f.effect)}" for f in a.fixes) + "</p>")
    return "<div class='answer'>" + "".join(parts) + "</div>", f"{a.title} at step {step}"


def _row_losses(raw: dict) -> dict[tuple[int, int], tuple[float, int]]:
    """(row, segment) -> (loss sum, tokens) from a data row's per-document losses."""
    out = {}
    dl = raw.get("doc_loss") or {}
    for key in ("top", "bottom"):
        for ent in dl.get(key, []) or []:
            if len(ent) >= 4:
                out[(int(ent[0]), int(ent[1]))] = (float(ent[2]), int(ent[3]))
    return out


def proof_section(led: RunLedger, step: int) -> str:
    """The proof at the alarm, as it ran, rendered from the typed record
    (:class:`titan_ledger.format.proofs.Proof`, as the Diagnosis box and the console are):
    the cause it proves and how, the in-step verdict and why, what was applied (and what
    would have been), then every run as one table -- the step's executions and the window's
    re-runs from the host snapshot (variant, loss, grad norm, update normal, removed the
    spike, seconds, loss cost) -- each DP rank's share in words, the suspect and its
    control, and the group testing's rounds (``--ledger.proof.bisect``)."""
    from titan_ledger.format.proofs import Proof, held_back_words

    head = "<h2>Proof at the alarm</h2>"
    record = led.proof_at(step)
    if record is None:
        return head + "<p class='none'>no proof recorded at this step (--ledger.proof.scope, prove_at)</p>"
    p = Proof.of(record)
    facts = [["in-step verdict", f"{p.verdict}: {p.why}"], ["applied", p.applied]]
    if p.held_back is not None:
        facts.append(["would have applied", f"{p.would_apply} (held back by {held_back_words(p.held_back)})"])
    facts.append(["in one line", p.line()])
    for key in ("decided_at", "update_recomputed", "ranks", "dp_ranks", "documents"):
        if record.get(key) is not None:
            facts.append([key.replace("_", " "), record[key]])
    for key in ("suspect", "control"):
        if record.get(key):
            facts.append([key, ", ".join(f"{k}={v}" for k, v in record[key].items())])
    if record.get("noise"):
        facts.append(["noise floor", f"{record['noise'].get('floor')} (factor {record['noise'].get('factor')})"])
    window = record.get("window") or {}
    where = {"step": "the step", "window": f"window from step {p.window_from}"}
    runs = [[where[r.kind], r.variant, r.loss, r.grad_norm, _yes_no(r.normal), r.removed or "",
             r.seconds if r.seconds is not None else "", "" if r.cost is None or r.variant == "same" else f"{r.cost:+.4g}",
             _yes_no(r.bit_equal), r.ranks_in_words()] for r in p.runs]
    out = head + _facts(facts) + _table(
        ["run", "variant", "loss", "grad norm", "update normal", "effect (the one judge)", "seconds", "loss cost",
         "bit-equal", "per DP rank"], runs)
    if window.get("runs"):
        out += (f"<p>The window re-ran steps {p.window_from + 1}-{p.window_from + window['steps']} from the host "
                f"snapshot of step {p.window_from} ({window['steps']} steps, "
                f"{_num(window.get('seconds'))} s in all) once per variant; loss cost: the loss over its last steps "
                f"against the unchanged re-run's.</p>")
    elif window:
        out += f"<p>Window proof not run: {_e(window.get('why', ''))}</p>"
    rounds = record.get("bisection") or []
    if rounds:
        def docs(x):
            return f"{len(x)}: " + ", ".join(f"{s}:{d}" for s, d in x[:6]) + (" ..." if len(x) > 6 else "")

        out += "<p>Group testing, round by round (each half masked on every rank that holds it):</p>" + _table(
            ["round", "masked", "update normal", "control", "update normal"],
            [[i + 1, docs(r["masked"]), r["masked_normal"], docs(r["control"]), r["control_normal"]]
             for i, r in enumerate(rounds)])
    return out


def _yes_no(v: bool | None) -> str:
    return "" if v is None else "yes" if v else "no"


def documents_section(led: RunLedger, step: int, worst: int | None) -> str:
    head = "<h2>Documents of the worst DP rank</h2>"
    try:
        data = led.data
    except LedgerCorrupt:
        raise  # a section may say its input is missing, never read around a corrupt one
    except LedgerError as e:
        return head + f"<p class='none'>no data ledger: {_e(e)}</p>"
    rank = worst if worst is not None and worst in data.files else None
    if rank is None:
        return head + "<p class='none'>the worst DP rank is unknown at this step</p>"
    # the row the rank trained the step with (a rolled-back step: the superseded segment's)
    raw = data.trained_row(rank, step) or data.row(rank, step)
    if raw is None:
        return head + f"<p class='none'>DP rank {rank} has no data row for step {step}</p>"
    if "rows" not in raw and "samples" in raw and "last_step" not in raw:
        # a derived row (indexed corpus, data schema 2): rebuilt from the corpus, digest checked
        try:
            raw = {**raw, "rows": [t.to_json() for t in data.derived_tags(step, rank, raw)]}
        except LedgerError as e:
            return head + f"<p class='none'>{_e(e)}</p>"
    losses = _row_losses(raw)
    rows = []
    for i, t in enumerate(raw.get("rows", [])):
        sid, source, segs = t[0], t[1], t[2]
        for j, seg in enumerate(segs):
            doc, start, end = seg[0], seg[1], seg[2]
            ls = losses.get((i, j))
            if ls is None and isinstance(seg, dict):
                ls = (seg.get("loss"), seg.get("tokens"))
            loss = ls[0] / ls[1] if ls and ls[1] else None
            rows.append([sid, source, doc, f"[{start}:{end})", loss, ls[1] if ls else None])
    if isinstance(raw.get("loss"), (int, float)):
        rows.append(["(row average)", "", "", "", raw["loss"], raw.get("tokens")])
    rows.sort(key=lambda r: -(r[4] if isinstance(r[4], float) and math.isfinite(r[4]) else -math.inf))
    note = ("per-document losses recorded (top/bottom documents of this rank; mean loss = loss sum / tokens)"
            if losses else "no per-document losses in this run's data ledger")
    dl = raw.get("doc_loss") or {}
    median = f"; median document loss on this rank {_num(dl.get('median'))}" if "median" in dl else ""
    inj = f"; <b>injected batch ({_e(raw['injected'])})</b>" if raw.get("injected") else ""
    return (head + f"<p>DP rank {rank} at step {step}: {len(raw.get('rows', []))} rows; {note}{median}{inj}. "
            f"Text: <code>{_e(_python(led))} -m titan_ledger.lookup {_e(led.dump_folder)} --step {step} "
            f"--rank {rank} --text</code></p>" +
            _table(["sample id", "source", "document", "tokens span", "mean loss", "loss tokens"], rows))


def _python(led: RunLedger) -> str:
    """The interpreter of the run's last launch (its header), as a command names it."""
    from titan_ledger.errors import python_command

    launches = led.launches()
    return python_command(launches[-1].get("python") if launches else None)


def rerun_section(led: RunLedger, step: int) -> str:
    folder = led.folder / records.RERUN_FOLDER
    head = "<h2>Rerun results</h2>"
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    if not files:
        cmd = f"{_python(led)} -m titan_ledger.diagnose {led.dump_folder} --step {step} --rerun"
        before = [c for c in led.checkpoints() if c < step]
        if not before:  # a rerun loads the last checkpoint before the step: say what it needs, no command
            return head + (f"<p class='none'>No rerun: a rerun from a checkpoint needs one before step {step}, and "
                           f"this run has none (train with --checkpoint.enable --checkpoint.interval N).</p>")
        if led.proof_at(step) is not None:
            return head + (f"<p>No rerun: the step was proven in process (Proof at the alarm, above). A rerun "
                           f"from a checkpoint, out of process, would test it again: <code>{_e(cmd)}</code></p>")
        return head + f"<p class='none'>No rerun was run for this step. To run one: <code>{_e(cmd)}</code></p>"
    parts = []
    for p in files[:20]:
        text = p.read_text(errors="replace")
        if p.suffix in (".json", ".jsonl"):
            lines = [ln for ln in text.splitlines() if ln.strip()]
            hits = [ln for ln in lines if f'"step": {step}' in ln or f'"step":{step}' in ln] or lines
            text = "\n".join(hits)
        parts.append(f"<p><code>{_e(p.relative_to(led.folder))}</code></p><pre>{_e(text[:5000])}</pre>")
    return head + "".join(parts)


def rollback_section(led: RunLedger, step: int, back: int, skip: int) -> str:
    """The PaLM rollback for ``step`` (``rollback.fitted_plan``: ``--back``/``--skip`` fitted
    to the checkpoints that exist and the run's length, saying so) and the commands that
    apply it, with the run's own interpreter."""
    from titan_ledger.tools.rollback import existing_skips, fitted_plan

    head = "<h2>Rollback plan</h2>"
    last = led.last_signal_step(windows=True) or step
    try:
        p, fitted = fitted_plan(led.checkpoints(), step, back, skip, last, existing=existing_skips(led))
    except TitanLedgerError as e:
        return head + f"<p class='none'>no plan: {_e(e)}</p>"
    back, skip = step - p["load_step"], p["skip_window"][1] - p["skip_window"][0] + 1
    rewinds = [r for r in led.rewinds() if int(r["step"]) == step]
    done = (f"<p>Already applied in process: rolled back to step-{rewinds[0]['rewind_to']}, skipping "
            f"{rewinds[0]['skip_window'][0]}-{rewinds[0]['skip_window'][1]}.</p>") if rewinds else ""
    fit = ("<p>Fitted to this run: " + "; ".join(_e(x) for x in fitted) + ".</p>") if fitted else ""
    launches = led.launches()
    world = launches[-1].get("world_size", "N") if launches else "N"
    py = _python(led)
    overlay = led.dump_folder / f"rollback_step{step}.toml"
    cmd1 = (f"{py} -m titan_ledger.rollback {led.dump_folder} --step {step} "
            f"--back {back} --skip {skip} --write {overlay}")
    cmd2 = (f"{_e(py)} -m torch.distributed.run --nproc_per_node {world} -m titan_ledger.train --job.config_file "
            f"&lt;the run's TOML&gt; &lt;its other flags, unchanged&gt; --job.overlay {_e(overlay)}")
    flags = " ".join(f'"{x}"' if "," in x else x for x in p["overrides"])
    return (head + done + fit + _table(["spike step", "load checkpoint", "skip window", "steps lost", "skip_steps"],
                                       [[p["spike_step"], f"step-{p['load_step']}",
                                         f"{p['skip_window'][0]}-{p['skip_window'][1]}", p["steps_lost"],
                                         ", ".join(p["skip_steps"])]]) +
            f"<p>Apply it (write the overlay, then relaunch the same command with it):</p>"
            f"<pre>{_e(cmd1)}\n{cmd2}</pre><p>or add the overrides directly: <code>{_e(flags)}</code></p>")


def report(dump_folder: str | Path, step: int, out: str | Path, ledger_folder: str = records.LEDGER_FOLDER,
           around: int = 30, back: int = 100, skip: int = 200) -> dict:
    """Write the incident page for the spike at ``step``; returns what it holds."""
    led = RunLedger(dump_folder, ledger_folder)
    hist = led.history_at(step, 0, 0)
    if hist is None and led.last_signal_step() is None:
        raise LedgerError(f"{led.folder / records.SIGNALS_FILE}: no trained step recorded")
    ev = next((e for e in led.spike_events() if int(e["step"]) == step), None)
    diag, res = diagnosis_section(led, step)
    hist = hist[0] if hist else []
    at = next((r for r in hist if r["step"] == step), {})
    worst = at.get("loss_max_rank", ev.get("loss_max_rank") if ev else None)
    if ev:
        flagged = (f"flagged by {', '.join(ev.get('rules', []))}; action {ev.get('action')}; worst DP rank "
                   f"{ev.get('loss_max_rank')}")
    else:
        flagged = "not flagged by the trainer (chosen with --step)"
    summary = _table(["step", "loss", "worst DP rank loss", "worst DP rank", "grad norm", "max logit", "lr"],
                     [[step, at.get("loss"), at.get("loss_max"), worst, at.get("grad_norm"),
                       at.get("max_logit"), at.get("lr")]])
    signals, plot_info = signals_section(led, step, around)
    box, title = answer_section(res, step)
    body = [f"<h1>Incident: {_e(title)}</h1>", box,
            f"<p>Run <code>{_e(led.dump_folder)}</code>; {_e(flagged)}.</p>", summary,
            signals, ranks_section(led, step, around), diag, proof_section(led, step),
            documents_section(led, step, worst), rerun_section(led, step),
            rollback_section(led, step, back, skip)]
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>titan_ledger incident: step {step}</title><style>{CSS}</style></head><body>"
            + "".join(body) + "</body></html>")
    Path(out).write_text(page, encoding="utf-8")
    answer = (res or {}).get("answer") or {}
    return {"step": step, "out": str(out), "cause": answer.get("cause") or None,
            "established": answer.get("established"), "answer": answer or None, "verdict": res, "bytes": len(page),
            "signals_plot": plot_info}


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser.for_tool(__name__, __doc__)
    add_dump_folder(ap)
    ap.add_argument("--step", type=int, help="the incident's step: its own page (default: the run's page -- its "
                                             "episodes first, then every incident)")
    ap.add_argument("-o", "--out", default="incident.html", help="output page")
    ap.add_argument("--around", type=int, default=30, help="steps shown before and after the spike")
    ap.add_argument("--back", type=int, default=100, help="rollback plan: checkpoint at or before T - back (fitted "
                    "to the checkpoints that exist: the earliest before the spike when none is that far back)")
    ap.add_argument("--skip", type=int, default=200, help="rollback plan: steps to skip (at most to the run's last "
                    "recorded step)")
    a = parse_args(ap, argv)
    return run_tool("titan_ledger.report", lambda: _main(a))


def _main(a) -> int:
    out = Path(a.out)
    if not out.parent.is_dir():
        raise ConfigError(f"-o {a.out}: folder {out.parent} does not exist; create it first")
    if a.around < 1:
        raise ConfigError(f"--around must be >= 1, got {a.around}")
    led = RunLedger(a.dump_folder, a.ledger_folder)
    if a.step is None:  # the run's page: its episodes, then its incidents (tools/run_page.py)
        from titan_ledger.tools.run_page import write

        if not led.trained_rows():
            raise LedgerError(f"{led.folder / records.SIGNALS_FILE}: no trained step recorded")
        info = write(a.dump_folder, out, a.ledger_folder)
        print(f"wrote {info['out']}: {len(info['episodes'])} episode(s), {len(info['incidents'])} incident(s)")
        return 0
    s = a.step
    if led.history_at(s, 0, 0) is None:
        raise LedgerError(f"step {s} is in no segment of {led.folder / records.SIGNALS_FILE}")
    info = report(a.dump_folder, s, out, a.ledger_folder, a.around, a.back, a.skip)
    ans = info.get("answer") or {}
    print(f"wrote {info['out']}: " + (f"{ans.get('title')} at step {s}: {ans.get('cause_text')}" if ans else
                                      f"step {s}: not flagged by the trainer"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
