"""report: one self-contained page per spike, every section present (or saying why
not), images inlined; the CLI's one-line errors. The browser check is in
tests/e2e/test_dashboards_e2e.py (a real run's page in headless chromium)."""

from __future__ import annotations

import base64
import html
import json
import re
import struct
from pathlib import Path

import pytest

from tests.unit.tools.test_plot import assert_legible
from titan_ledger.format import records
from titan_ledger.tools.report import main, report


def _run(tmp_path):
    (tmp_path / "ledger").mkdir()
    w = records.RecordWriter(tmp_path / "ledger" / "signals.jsonl",
                             {"schema": records.SIGNALS.id, "run_id": "a", "resumed_from": 0, "seq": 1})
    for s in range(1, 13):
        row = {k: None for k in records.SIGNAL_KEYS}
        row.update(step=s, loss=8.0 - s / 10 + (2.0 if s == 5 else 0), loss_max=8.1 - s / 10, loss_max_rank=s % 2,
                   grad_norm=1.0 + (5 if s == 5 else 0), grad_norm_clipped=1.0, param_norm=10.0 + s / 100,
                   max_logit=1.0, num_zeros=100, lr=1e-3, skipped=False)
        w.write(row)
    w.close()
    w = records.RecordWriter(tmp_path / "ledger" / records.SPIKES_FILE,
                             {"schema": records.SPIKES.id, "run_id": "a", "seq": 1})
    w.write({"step": 5, "rules": ["zscore_loss"], "loss_max_rank": 0, "loss": 5.0, "grad_norm": 1.0,
             "action": "none"})
    w.close()
    return tmp_path


def test_page_has_every_section_and_inlined_images(tmp_path):
    d = _run(tmp_path)
    info = report(d, 5, tmp_path / "i.html", around=4)
    page = (tmp_path / "i.html").read_text()
    assert info["answer"]["title"] == "loss spike" and page.startswith("<!DOCTYPE html>")
    assert "<h1>Incident: loss spike at step 5</h1><div class='answer'>" in page  # the answer first
    for title in ("Signals around step 5", "Per-rank losses", "The decision tree's reading",
                  "Documents of the worst DP rank", "Rerun results", "Rollback plan"):
        assert f"<h2>{title}</h2>" in page, title
    assert len(re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{100,}"', page)) >= 1
    # the signals plot embedded is the one plot() laid out, and it is legible
    (b64,) = re.findall(r'alt="signals around step 5" src="data:image/png;base64,([^"]+)"', page)
    png = base64.b64decode(b64)
    layout = info["signals_plot"]["layout"]
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and list(struct.unpack(">II", png[16:24])) == layout["size_px"]
    assert layout["size_px"][0] == 1100  # the page's width: shown at its own size
    assert_legible(layout, [5])
    assert not re.search(r'(src|href)="(https?:|file:|/)', page)  # self-contained
    assert "Q0 divergence" in page and "Q5 bf16" in page  # every question, with numbers
    assert "no data ledger" in page and "a rerun from a checkpoint needs one before step 5" in page  # inputs said
    assert "<td>None</td>" not in page and "n/a" in page  # a missing value, never a bare None
    assert "no plan:" in page and "checkpoint" in page


def test_rerun_folder_shown_and_cli(tmp_path, capsys):
    d = _run(tmp_path)
    (d / "ledger" / "rerun").mkdir()
    (d / "ledger" / "rerun" / "result.jsonl").write_text('{"step": 5, "loss": 5.01}\n{"step": 6}\n')
    assert main([str(d), "--step", "5", "-o", str(tmp_path / "p.html")]) == 0  # the flagged spike: step 5
    page = (tmp_path / "p.html").read_text()
    assert "rerun/result.jsonl" in page and "5.01" in page
    assert main([str(d), "--step", "99", "-o", str(tmp_path / "q.html")]) == 2
    assert main([str(tmp_path / "nope"), "-o", str(tmp_path / "q.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("titan_ledger.report: error: ") for line in err)


def test_the_decision_tables_numbers_are_escaped_once(tmp_path):
    """A list among a question's numbers (the evidence rules the trainer fired) reads as
    written in the browser: its quotes escaped once, not shown as ``&#x27;``."""
    d = _run(tmp_path)
    path = d / "ledger" / records.SPIKES_FILE
    path.write_text(path.read_text().replace('zscore_loss', 'doc_high'))
    report(d, 5, tmp_path / "i.html", around=4)
    page = (tmp_path / "i.html").read_text()
    assert "evidence_rules=[&#x27;doc_high&#x27;]" in page
    assert "&amp;#x27;" not in page and "&amp;" not in page.split("<h2>The decision tree's reading</h2>")[1].split(
        "</table>")[1]


def test_the_page_shows_the_proof_as_it_ran(tmp_path):
    """Every execution (variant, loss, grad norm, per-rank values), what was applied, and
    the group testing's rounds; a step without a proof says so."""
    d = _run(tmp_path)
    page = (tmp_path / "none.html")
    report(d, 5, page, around=4)
    assert "<h2>Proof at the alarm</h2><p class='none'>no proof recorded" in page.read_text()
    ex = [{"variant": v, "loss": 7.5 - i / 10, "grad_norm": 9.0 - i, "normal": i == 3, "seconds": 0.1,
           "per_rank": [{"loss": 1900.0 + i, "grad_sq": 40.0, "tokens": 256}, {"loss": 1930.0, "grad_sq": 44.0,
                                                                               "tokens": 256}]}
          for i, v in enumerate(["original", "same", "bisect", "masked"])]
    ex[1]["bit_equal"] = True
    proof = {"verdict": "bad_data", "applied": "masked", "why": "group testing: masking 1 of the step's 8 documents",
             "acting": True, "executions": ex, "seconds": 0.4, "decided_at": 6, "documents": [["c", 5]],
             "suspect": {"dp_rank": 1, "evidence": "bisection", "dp_ranks": [0, 1]},
             "bisection": [{"masked": [["c", 5], ["c", 6]], "control": [["c", 1], ["c", 2]], "masked_normal": True,
                            "control_normal": False}]}
    with open(d / "ledger" / records.SPIKES_FILE, "a") as f:
        f.write(json.dumps({"step": 5, "rules": ["ratio"], "loss_max_rank": 0, "loss": 5.0, "grad_norm": 1.0,
                            "action": "proof: bad_data", "proof": proof}) + "\n")
    report(d, 5, tmp_path / "p.html", around=4)
    section = (tmp_path / "p.html").read_text().split("<h2>Proof at the alarm</h2>")[1].split("<h2>")[0]
    for text in ("masked", "decided at", "bisection", "dp_ranks=[0, 1]", "original",
                 "bisect", "DP rank 0: loss sum 1902 over 256 tokens, gradient sum of squares 40",
                 "Group testing, round by round", "2: c:5, c:6", "bad data on DP ranks 0, 1, documents c:5"):
        assert text in section, text
    assert section.count("<tr>") == 6 + 5 + 2  # facts, executions, rounds (each with its header)
    assert "<th></th>" not in section and "grad sq" not in section  # no empty headers, plain words
    # the answer box above: the convicted data, proven in step, and what the trainer did
    box = (tmp_path / "p.html").read_text().split("<div class='answer'>")[1].split("</div>")[0]
    assert "<p class='cause'>bad data</p>" in box and "proven in step" in box
    assert "trained without the convicted data" in box


REAL_PROOFS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "proofs.json").read_text())


@pytest.mark.parametrize("kind", ["bad_data", "hardware", "lr_window", "outlier"])
def test_the_box_the_proof_table_the_console_and_diagnose_tell_one_story(tmp_path, kind, capsys):
    """Real proof records (tests/unit/fixtures/proofs.json, written by real zoo runs): the
    page's answer box and ``diagnose`` render the one answer (``format.answers``, built from
    the record by the same function the trainer's console uses); the proof section keeps
    what the proof measured, the window's re-runs as rows with the one judge's effect."""
    from titan_ledger.format.answers import Answer, Fix, of_run, render
    from titan_ledger.format.proofs import Proof, describe_proof
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools import diagnose

    ev = dict(REAL_PROOFS[kind], step=5)
    d = _run(tmp_path)
    path = d / "ledger" / records.SPIKES_FILE
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1] + [json.dumps(ev)]) + "\n")  # its event in place of the synthetic one
    p = Proof.of(ev["proof"])
    info = report(d, 5, tmp_path / "p.html", around=4)
    page = (tmp_path / "p.html").read_text()
    box = page.split("<div class='answer'>")[1].split("</div>")[0]
    section = page.split("<h2>Proof at the alarm</h2>")[1].split("<h2>")[0]
    assert "<th>cause</th>" not in section  # the proof section derives no cause
    if kind == "outlier":  # a note's proof that found nothing harmful: no incident, no answer
        assert info["answer"] is None and of_run.answer_at(RunLedger(d), 5) is None and "not an incident" in box
    else:
        a = of_run.answer_at(RunLedger(d), 5)
        assert Answer.of(info["answer"]) == a and f"<p class='cause'>{html.escape(a.cause_text)}</p>" in box
        assert a.cause == {"bad_data": "bad_data", "hardware": "hardware", "lr_window": "lr"}[kind]
    line = describe_proof(ev["proof"])
    assert f"<tr><th>in one line</th><td>{html.escape(line)}</td></tr>" in section
    assert section.count("<td>window from step") == sum(r.kind == "window" for r in p.runs)
    if kind == "lr_window":
        assert p.runs[-5].variant == "same" and [r.removed for r in p.runs[-4:]] == \
            ["removed", "not removed", "not removed", "not removed"]
        assert a.fix.variant == "lr" and a.established == "window" and a.fix.effect == "removed"
        assert a.fix.flags == () and "records none of the run's settings" in a.fix.change  # an older ledger
        assert "effect (the one judge)" in section and "+2.167" in section  # the LR fix's loss cost
    assert diagnose.main([str(d), "--step", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("\n".join(render.lines(Answer.of(info["answer"]), [Fix.of(f) for f in info["verdict"].get("reading") or []])) if info["answer"] else
                          "step 5: not an incident")


def test_above_dp_16_the_per_rank_section_summarises(tmp_path):
    """20 loss-owning ranks: the section says count, median, spread and the worst ranks in
    words (not 20 table rows), and draws the median, the band and the worst three."""
    d = _run(tmp_path)
    for r in range(20):
        w = records.RecordWriter(d / "ledger" / records.rank_file(r),
                                 {"schema": records.RANK.id, "run_id": "a", "resumed_from": 0, "seq": 1})
        for s in range(1, 13):
            w.write({"step": s, "loss": 3.0 + r / 100 + (1.0 if (s == 5 and r == 17) else 0.0), "tokens": 256})
        w.close()
    report(d, 5, tmp_path / "p.html", around=4)
    ranks = (tmp_path / "p.html").read_text().split("<h2>Per-rank losses</h2>")[1].split("<h2>")[0]
    assert "20 ranks: median" in ranks and "highest rank 17 4.1700" in ranks and "<td>" not in ranks


def test_without_a_step_the_runs_page_leads_with_its_episodes_then_every_incident(tmp_path, capsys):
    """No ``--step``: the run's page -- its episodes first (each one's cause, how, fix), then
    every incident with its own answer and the episode it belongs to -- said in one line."""
    d = _run(tmp_path)
    with open(d / "ledger" / records.SPIKES_FILE, "a") as f:
        f.write(json.dumps({"step": 9, "rules": ["grad_jump"], "loss_max_rank": 0, "loss": 7.1, "grad_norm": 6.0,
                            "action": "none"}) + "\n")
        f.write(json.dumps({"step": 90, "rules": ["grad_jump"], "loss_max_rank": 0, "loss": 7.1, "grad_norm": 6.0,
                            "action": "none"}) + "\n")
    assert main([str(d), "-o", str(tmp_path / "p.html")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'p.html'}: 2 episode(s), 3 incident(s)\n"
    page = (tmp_path / "p.html").read_text()
    boxes = re.findall(r"<div class='ep'>(.*?)</div>", page)
    assert len(boxes) == 2 and "Episode 1, steps 5-9: 2 incidents at steps 5-9" in boxes[0]
    assert "<p class='cause'>cause not established</p>" in boxes[0] and "step 90" in boxes[1]
    assert page.index("<div class='ep'>") < page.index("<h2>Incidents")  # the episodes above the incidents
    assert page.count("<td>episode 1</td>") == 2 and page.count("<td>episode 2</td>") == 1
    from titan_ledger.tools.run_page import page as run_page  # (what report writes, read without a file)

    assert run_page(d)[0] == page
