"""The postmortem of automatic actions and the one verdict (``incident.judge``) on
synthetic ledgers written through ``records.RecordWriter``: a step the trainer flagged
and rolled back (later a skipped window), an update skip, an injected batch, and how
sure each verdict is (``certainty``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_ledger.format import records
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools import diagnose, lookup, report, rollback
from titan_ledger.tools.incident import DOC_STANDOUT, judge
from titan_ledger.tools.postmortem import actions_at

from ..bad_input_ledgers import data_header, signal_row

T, LOAD, WIN = 25, 20, (21, 26)  # the spike, the checkpoint rolled back to, the skipped window
DP, MBS = 2, 2


def _hdr(seq: int, resumed: int, run: str, **extra) -> dict:
    return {"run_id": run, "seq": seq, "resumed_from": resumed, "time": float(seq), "config_digest": "d1",
            "world_size": DP, "dp_size": DP, "param_dtype": "float32", **extra}


def _tags(step: int, r: int) -> list:
    ids = [(step - 1) * MBS * DP + r * MBS + j for j in range(MBS)]
    return [[i, "stdlib_docs", [[1000 + i, 0, 256]]] for i in ids]


def _doc_loss(step: int, r: int, outlier: float | None) -> dict:
    """Both rows' documents; row 0's at ``outlier`` x the others' loss when given."""
    base = 3.0
    first = base * outlier if outlier else base
    return {"median": base, "top": [[0, 0, first * 256, 256], [1, 0, base * 256, 256]], "bottom": []}


def make_rolled_back_run(dump: Path, *, rules=("grad_jump",), evidence: dict | None = None, action="rollback",
                         outlier_rank: int | None = 1, outlier: float = 3.0, injected: str | None = None,
                         steps: int = 30) -> Path:
    """seq 1 trains 1..T and is flagged at T; the trainer rolls back to LOAD and skips
    WIN (seq 2, run id ``a.r1``), then trains WIN[1]+1..steps."""
    led = dump / "ledger"
    led.mkdir(parents=True)
    rolled = action.startswith("rollback")
    records.append_segment(led, records.Header(schema="", **{k: v for k, v in _hdr(1, 0, "a").items()
                                                             if k in ("run_id", "seq", "resumed_from", "time")},
                                               extra={"config_digest": "d1", "world_size": DP, "dp_size": DP}))
    if rolled:
        records.append_segment(led, records.Header(schema="", run_id="a.r1", seq=2, resumed_from=LOAD, time=2.0,
                                                   extra={"config_digest": "d1", "rewind_from": T}))
    w = records.RecordWriter(led / records.SIGNALS_FILE, {"schema": records.SIGNALS.id, **_hdr(1, 0, "a")})
    for s in range(1, (T if rolled else steps) + 1):
        if s == T:
            w.write(signal_row(s, loss=3.05, grad_norm=10.0, spike=True, loss_max=3.4, loss_max_rank=1,
                               update_skipped=action != "none"))
        else:
            w.write(signal_row(s))
    w.close()
    if rolled:
        w = records.RecordWriter(led / records.SIGNALS_FILE,
                                 {"schema": records.SIGNALS.id, **_hdr(2, LOAD, "a.r1", rewind_from=T)})
        w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": WIN[0], "last_step": WIN[1], "skip_lr": "freeze",
                 "skipped": True, "lr": 1e-3, "consumed_samples": 4 * WIN[1], "consumed_tokens": 0,
                 "skipped_samples": 4 * (WIN[1] - WIN[0] + 1), "update_skipped": False, "step_time_s": 0.0,
                 "data_loading_s": 0.0})
        for s in range(WIN[1] + 1, steps + 1):
            w.write(signal_row(s))
        w.close()
    e = records.RecordWriter(led / records.SPIKES_FILE, {"schema": records.SPIKES.id, **_hdr(1, 0, "a")})
    e.write({"step": T, "rung": 0, "action": action, "attempt": 1, "repeat_within_horizon": False, "ladder": True})
    e.write({"step": T, "loss": 3.05, "grad_norm": 10.0, "loss_max": 3.4, "loss_max_rank": 1, "rules": list(rules),
             "grad_norm_median": 1.0, "loss_median": 2.96, **(evidence or {}), "action": action})
    if rolled:
        e.write({"step": T, "rewind_to": LOAD, "skip_window": list(WIN), "action": "rollback"})
    e.close()
    for r in range(DP):
        w = records.RecordWriter(led / records.data_file(r),
                                 {**data_header(r, DP, MBS), **_hdr(1, 0, "a"), "dp_rank": r})
        for s in range(1, (T if rolled else steps) + 1):
            row = {"step": s, "skipped": False, "rows": _tags(s, r)}
            if s == T:
                row["doc_loss"] = _doc_loss(s, r, outlier if r == outlier_rank else None)
                if injected and r == 1:
                    row["injected"] = injected
            w.write(row)
        w.close()
        if rolled:
            w = records.RecordWriter(led / records.data_file(r),
                                     {**data_header(r, DP, MBS), **_hdr(2, LOAD, "a.r1"), "dp_rank": r})
            w.write({"step": WIN[0], "last_step": WIN[1], "skipped": True,
                     "rows": [t for s in range(WIN[0], WIN[1] + 1) for t in _tags(s, r)]})
            for s in range(WIN[1] + 1, steps + 1):
                w.write({"step": s, "skipped": False, "rows": _tags(s, r)})
            w.close()
    for r in range(DP):  # each rank's own loss (rank<r>.jsonl), the rewound step included
        w = records.RecordWriter(led / records.rank_file(r), {"schema": records.RANK.id, **_hdr(1, 0, "a")})
        for s in range(1, (T if rolled else steps) + 1):
            w.write({"step": s, "loss": 3.4 if (s == T and r == 1) else 2.9, "tokens": 1024})
        w.close()
    d = dump / "checkpoint" / f"step-{LOAD}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"dcp")
    return dump


def test_a_rolled_back_step_is_judged_as_it_stood_and_says_what_was_done(tmp_path):
    dump = make_rolled_back_run(tmp_path / "run")
    led = RunLedger(dump)
    res = judge(led, T)
    assert res["rewound"] is True and res["param_dtype"] == "float32"
    assert res["trainer"]["rules"] == ["grad_jump"] and res["trainer"]["action"] == "rollback"
    assert res["rank_losses"] == {"0": 2.9, "1": 3.4}  # the superseded rank rows, as the step trained
    a = res["actions"]
    assert a["rewind"] == {"from": T, "to": LOAD, "skip_window": list(WIN)} and a["now"] == "skipped"
    assert a["after"]["steps"] == [27, 28, 29, 30, 31][:4] and a["after"]["flagged"] == []
    done = res["done"]
    assert "rolled back to checkpoint step-20, skipped 21\u201326" in done
    assert "retrained as steps 27\u201330: none flagged" in done and "action rollback" in done
    # a step the rollback undid without being flagged says so
    assert "undone by the rollback from step 25 to checkpoint step-20" in actions_at(led, 23)["summary"]
    assert actions_at(led, 28)["summary"] == "not flagged by the trainer"


def test_diagnose_lists_the_acted_on_step_and_report_gives_the_same_verdict(tmp_path, capsys):
    dump = make_rolled_back_run(tmp_path / "run")
    assert diagnose.main([str(dump), "--json"]) == 0  # no --step: the acted-on steps
    (d,) = json.loads(capsys.readouterr().out)["spikes"]
    assert d["step"] == T and d["rewound"] and "rolled back to checkpoint step-20" in d["done"]
    assert d["certainty"] in ("proven", "evidence", "guess") and d["certainty_rule"]
    assert diagnose.main([str(dump), "--step", str(T)]) == 0
    out = capsys.readouterr().out
    a = d["answer"]  # the one answer: no proof ran here, so no cause is claimed; the tree's reading is apart
    assert a["step"] == T and a["established"] == "none" and a["cause"] == ""
    assert out.startswith(f"{a['title']} at step {T}: cause not established")
    assert f"the decision tree (heuristics over the signals; a candidate, never the answer): {d['tree']['cause']}" \
        in out and "recorded actions: flagged by the trainer" in out
    info = report.report(dump, T, tmp_path / "p.html", around=5, back=1, skip=2)
    assert info["answer"] == a and info["verdict"]["tree"] == d["tree"]
    assert info["verdict"]["done"] == d["done"] and info["verdict"]["checks"] == d["checks"]
    page = (tmp_path / "p.html").read_text()
    assert "rolled back to checkpoint step-20" in page and d["tree"]["rule"].split(";")[0][:40] in page


def test_lookup_and_rollback_say_the_step_was_rolled_back(tmp_path, capsys):
    dump = make_rolled_back_run(tmp_path / "run")
    assert lookup.main(["--dump-folder", str(dump), "--step", str(T)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"step {T}: SKIPPED (window 21-26)") and "rolled back to checkpoint step-20" in out
    assert lookup.main(["--dump-folder", str(dump), "--step", str(T), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["actions"]["rewind"]["to"] == LOAD
    assert rollback.main(["--dump-folder", str(dump), "--step", str(T), "--back", "1", "--skip", "6"]) == 0
    out = capsys.readouterr().out
    assert f"step {T}: already rolled back in process" in out and "skipped 21\u201326" in out


def test_an_update_skip_is_said(tmp_path):
    dump = make_rolled_back_run(tmp_path / "run", action="skip_update")
    res = judge(RunLedger(dump), T)
    assert not res["rewound"] and res["actions"]["update_skipped"]
    assert "its update was not applied" in res["done"] and "trained on as steps 26\u201330" in res["done"]


def test_bad_data_with_agreeing_evidence_names_standout_documents_only(tmp_path):
    ev = {"doc_high_y": 1.1, "doc_y_median_high": 0.1, "doc_high_rank": 1, "suspect_dp_rank": 1}
    dump = make_rolled_back_run(tmp_path / "run", rules=("grad_jump", "doc_high"), evidence=ev, outlier=3.0)
    res = judge(RunLedger(dump), T)
    assert res["cause"] == "bad_data" and res["rank"] == 1
    assert res["certainty"] == "evidence" and "doc_high named DP rank 1" in res["certainty_rule"]
    assert [d["doc"] for d in res["documents"]] == [1000 + (T - 1) * 4 + 2]  # rank 1's row 0 only
    assert all(d["vs_median"] >= DOC_STANDOUT for d in res["documents"])
    assert "2x the step's median document" in res["documents"][0]["criterion"]


def test_an_acting_rule_with_an_agreeing_document_note_is_evidence(tmp_path):
    """The tiers: grad_jump acted, doc_high fired as a note on the same step (the trainer
    records it in the spike's ``notes``): the document data agree with the flag."""
    ev = {"notes": ["doc_high"], "doc_high_y": 1.1, "doc_y_median_high": 0.1, "doc_high_rank": 1,
          "suspect_dp_rank": 1}
    dump = make_rolled_back_run(tmp_path / "run", rules=("grad_jump",), evidence=ev, outlier=3.0)
    res = judge(RunLedger(dump), T)
    assert res["cause"] == "bad_data" and res["rank"] == 1 and res["trainer"]["notes"] == ["doc_high"]
    assert res["certainty"] == "evidence" and "doc_high named DP rank 1" in res["certainty_rule"]


def test_a_note_only_step_is_a_guess_that_says_it_was_never_acted_on(tmp_path, capsys):
    dump = make_rolled_back_run(tmp_path / "run", action="none", outlier=4.0)
    p = dump / "ledger" / records.SPIKES_FILE
    lines = [ln for ln in p.read_text().splitlines() if '"rules"' not in ln and '"ladder"' not in ln]
    lines.append(json.dumps({"step": T, "loss": 3.05, "grad_norm": 10.0, "loss_max_rank": 1, "notes": ["doc_high"],
                             "doc_high_y": 1.1, "doc_y_median_high": 0.1, "doc_high_rank": 1}))
    p.write_text("".join(ln + "\n" for ln in lines))
    led = RunLedger(dump)
    assert led.spike_events() == [] and [e["step"] for e in led.note_events()] == [T]
    res = judge(led, T)
    assert res["trainer"] is None and res["trainer_notes"] == ["doc_high"]
    assert res["certainty"] == "guess" and "recorded a note (doc_high), which never acts" in res["certainty_rule"]
    assert res.get("documents", []) == [] and "quarantine_command" not in res
    assert diagnose.main([str(dump), "--step", str(T)]) == 0
    out = capsys.readouterr().out
    assert "trainer: not flagged; a note (doc_high): recorded, never acted on" in out
    assert diagnose.main([str(dump)]) == 0  # no acting flag: the offline rules, and the notes line
    assert f"notes (weaker evidence, recorded and never acted on): 1 step(s): {T}" in capsys.readouterr().out


def test_no_document_stands_out_no_quarantine(tmp_path, capsys):
    # the rule fired, but the document is 1.5x the median and its side 2x its usual distance
    ev = {"doc_high_y": 0.2, "doc_y_median_high": 0.1, "doc_high_rank": 1, "suspect_dp_rank": 1}
    dump = make_rolled_back_run(tmp_path / "run", rules=("doc_high",), evidence=ev, outlier=1.5)
    assert diagnose.main([str(dump), "--step", str(T), "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)["spikes"]
    assert d["cause"] == "bad_data" and d["documents"] == [] and "quarantine_command" not in d
    assert "no document stands out" in d["documents_note"] and d["certainty"] == "guess"


def test_an_injected_batch_names_no_documents(tmp_path, capsys):
    ev = {"doc_low_y": 1.1, "doc_y_median_low": 0.1, "doc_low_rank": 1, "suspect_dp_rank": 1}
    dump = make_rolled_back_run(tmp_path / "run", rules=("doc_low",), evidence=ev, injected="random")
    assert diagnose.main([str(dump), "--step", str(T), "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)["spikes"]
    assert d["injected"] == {"1": "random"} and d["documents"] == [] and "quarantine_command" not in d
    assert "batch replaced by an injection (--ledger.rehearsal.inject)" in d["documents_note"]
    assert "no documents to quarantine" in d["documents_note"]
    assert d["certainty"] == "evidence" and "injection (random)" in d["certainty_rule"]


@pytest.mark.parametrize("flagged", [True, False])
def test_an_unflagged_step_is_a_guess_and_gets_no_quarantine(tmp_path, capsys, flagged):
    dump = make_rolled_back_run(tmp_path / "run", action="none", outlier=4.0)
    if not flagged:  # the same numbers, but the trainer never flagged the step
        p = dump / "ledger" / records.SPIKES_FILE
        p.write_text("".join(ln + "\n" for ln in p.read_text().splitlines() if '"rules"' not in ln
                             and '"ladder"' not in ln))
    res = judge(RunLedger(dump), T)
    assert res["certainty"] == "guess"
    if not flagged:
        assert "did not flag" in res["certainty_rule"] and res.get("documents", []) == []
        assert res["done"] == "not flagged by the trainer"
    else:
        assert "nothing done (the update was applied)" in res["done"]


def test_a_rerun_summary_decides_certainty(tmp_path):
    from titan_ledger.tools.rerun.run import write_summary

    dump = make_rolled_back_run(tmp_path / "run", action="none")
    led_dir = dump / "ledger"
    rep = {"step": T, "load_step": LOAD, "stop": T + 1, "variants": [],
           "verdict": {"step": T, "cause": "bad_data", "proven": True, "removed_by": "skip", "evidence": []}}
    write_summary(led_dir, rep)
    res = judge(RunLedger(dump), T)
    assert res["cause"] == "bad_data" and res["certainty"] == "evidence"
    assert "something in this step's data" in res["certainty_rule"]
    rep["verdict"]["removed_by"] = "quarantine"
    write_summary(led_dir, rep)
    res = judge(RunLedger(dump), T)
    assert res["certainty"] == "proven" and res["rerun_verdict"]["removed_by"] == "quarantine"


def test_a_rerun_that_contradicts_the_in_step_proof_does_not_override_it(tmp_path):
    """Issue 51: an LR spike proven ``not_data`` in the step; ``diagnose --rerun`` skipped a
    window of steps and the spike went away ("bad_data", evidence). The verdict keeps the
    proof's reading and says what the rerun claimed; a rerun that names a cause that is
    not the data (lr) after a not_data proof still decides."""
    from titan_ledger.format.answers.of_run import contradicts as rerun_contradicts
    from titan_ledger.tools.rerun.run import write_summary

    proof = {"verdict": "not_data", "applied": "original", "why": "reproducible, abnormal without the suspect data",
             "executions": []}
    dump = make_rolled_back_run(tmp_path / "run", action="none", evidence={"proof": proof})
    led_dir = dump / "ledger"
    rep = {"step": T, "load_step": LOAD, "stop": T + 1, "variants": [],
           "verdict": {"step": T, "cause": "bad_data", "proven": True, "removed_by": "skip", "evidence": []}}
    write_summary(led_dir, rep)
    res = judge(RunLedger(dump), T)
    # the heuristics' bad_data stays the guess the proof made it (the rerun's skip did not upgrade it)
    assert res["certainty"] == "guess" and res["rerun_verdict"]["contradicts_proof"] == "not_data", res
    assert "contradicting the in-step proof's not_data: the proof stands" in res["certainty_rule"]
    rep["verdict"].update(cause="lr", removed_by="lr")
    write_summary(led_dir, rep)
    res = judge(RunLedger(dump), T)
    assert res["cause"] == "lr" and "contradicts_proof" not in res["rerun_verdict"]
    assert rerun_contradicts("bad_data", "lr") and rerun_contradicts("hardware", "bad_data")
    assert rerun_contradicts("outlier", "hardware") and not rerun_contradicts("bad_data", "bad_data")


def test_a_document_extreme_against_its_usual_distance_stands_out_below_2x(tmp_path):
    """The spike zoo's planted repeated document: 0.71x the step's median document (under
    the 2x criterion) but its rank's low side 17.8x its usual distance; masking it alone
    removed the spike. Named, with why; the trainer flagged no evidence rule: a guess."""
    ev = {"doc_low_y": 1.78, "doc_y_median_low": 0.1, "doc_low_rank": 1}
    dump = make_rolled_back_run(tmp_path / "run", rules=("grad_jump",), evidence=ev, outlier=0.71)
    res = judge(RunLedger(dump), T)
    assert res["cause"] == "bad_data" and res["rank"] == 1 and res["rank_from"] == "documents"
    (d,) = res["documents"]
    assert d["vs_median"] == pytest.approx(0.71) and "17.8x its usual distance" in d["stands_out"]
    assert res["certainty"] == "guess"
    ev["doc_low_y"] = 0.2  # 2x its usual: not extreme, and 0.71x is inside 2x: nothing named
    dump = make_rolled_back_run(tmp_path / "run2", rules=("grad_jump",), evidence=ev, outlier=0.71)
    res = judge(RunLedger(dump), T)
    assert res.get("documents", []) == []
