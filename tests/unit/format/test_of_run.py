"""titan_ledger.format.answers.of_run: which answer of a step stands, read from a run's ledger.

The trainer's recorded answer is read back as it was written; a ledger without answers gets
one built by the same builder from the step's recorded event and proof; a rerun that proved
a cause writes its answer beside its verdict and every view reads that one; a rerun that
contradicts the proof at the alarm changes nothing. No processes."""

from __future__ import annotations

import json

from titan_ledger.format import records
from titan_ledger.format.answers import Answer, Context, Knobs, build, of_run
from titan_ledger.format.answers.build import RerunFinding
from titan_ledger.format.proofs import ProofRecord
from titan_ledger.format.reader import RunLedger

ARGV = ["--job.config_file", "train_configs/debug_cpu.toml", "--optimizer.lr", "0.05", "--training.steps", "12"]


def _run(tmp_path, event: dict, answer: bool):
    """A 12-step run whose step 5 flagged (``event``), its launch recorded; with ``answer``
    the trainer's answer rides in the event, as a trainer of today writes it."""
    led = tmp_path / "ledger"
    led.mkdir(parents=True)
    row = {"run_id": "a", "seq": 1, "resumed_from": 0, "time": 1.0, "world_size": 2, "argv": ARGV, "cwd": "/src",
           "python": "/venv/bin/python", "step": 0,
           "knobs": {"lr": 0.05, "eps": 1e-8, "betas": [0.9, 0.95], "qk_norm": False, "z_loss": 0.0}}
    (led / records.SEGMENTS_FILE).write_text(json.dumps({"schema": records.SEGMENTS.id}) + "\n" + json.dumps(row) + "\n")
    w = records.RecordWriter(led / "signals.jsonl", {"schema": records.SIGNALS.id, "run_id": "a",
                                                     "resumed_from": 0, "seq": 1})
    for s in range(1, 13):
        w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": s, "loss": 8.0 - s / 10 + (2.0 if s == 5 else 0),
                 "grad_norm": 1.0, "lr": 1e-3, "skipped": False})
    w.close()
    if answer:
        ctx = of_run.context(RunLedger(tmp_path))
        p = event.get("proof")
        event = {**event, "answer": build(5, "spike", event, ProofRecord.of(p) if p else None, ctx).to_json()}
    w = records.RecordWriter(led / records.SPIKES_FILE, {"schema": records.SPIKES.id, "run_id": "a", "seq": 1})
    w.write(event)
    w.close()
    return RunLedger(tmp_path)


FLAG = {"step": 5, "rules": ["zscore_loss"], "loss_max_rank": 0, "loss": 10.0, "loss_recent": 7.5, "grad_norm": 1.0,
        "action": "none"}
NOT_DATA = {"verdict": "not_data", "applied": "original", "why": "reproducible", "acting": True, "executions": []}


def _rerun(led: RunLedger, verdict: dict, with_answer: bool) -> None:
    summary = {"step": 5, "load_step": 0, "stop": 6, "verdict": verdict, "variants": []}
    if with_answer:
        summary["answer"] = of_run.rerun_answer(led, 5, verdict).to_json()
    f = records.rerun_summary_file(led.folder, 5)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(summary) + "\n")


def test_the_recorded_answer_stands_and_a_ledger_without_one_gets_the_same_builders(tmp_path):
    recorded = _run(tmp_path / "new", {**FLAG, "proof": NOT_DATA}, answer=True)
    old = _run(tmp_path / "old", {**FLAG, "proof": NOT_DATA}, answer=False)
    a, b = of_run.answer_at(recorded, 5), of_run.answer_at(old, 5)
    assert a == Answer.of(of_run.recorded(recorded)[5]) and a.title == "loss spike"
    assert (b.cause, b.established, b.not_proven) == (a.cause, a.established, a.not_proven) == ("", "none",
                                                                                                "no window proof ran")
    assert of_run.answer_at(recorded, 4) is None  # not an incident
    ctx = of_run.context(recorded)
    assert ctx.knobs == Knobs(lr=0.05, eps=1e-8, betas=(0.9, 0.95), qk_norm=False, z_loss=0.0)
    assert ctx.argv == tuple(ARGV) and ctx.world_size == 2 and ctx.python == "/venv/bin/python"


def test_a_rerun_that_proved_the_lr_is_recorded_and_read_as_the_answer(tmp_path):
    """``diagnose --rerun`` proved the LR (its ``lr`` variant removed a reproduced spike): the
    rerun writes the answer, with the LR's own fix and its command, and every view reads it."""
    led = _run(tmp_path, {**FLAG, "proof": NOT_DATA}, answer=True)
    verdict = {"cause": "lr", "proven": True, "certainty": "proven", "removed_by": "lr"}
    _rerun(led, verdict, with_answer=True)
    a = of_run.answer_at(led, 5)
    assert (a.cause, a.established, a.fix.variant) == ("lr", "rerun", "lr")
    assert "--optimizer.lr 0.005" in a.command and a.how == "a rerun reproduced it and the lr variant removed it"
    # a rerun summary from before answers were written beside it: the same answer, built on read
    _rerun(led, verdict, with_answer=False)
    assert of_run.answer_at(led, 5) == a


def test_a_rerun_that_contradicts_the_proof_or_only_skipped_the_step_does_not_prove(tmp_path):
    bad = {"verdict": "bad_data", "applied": "original", "why": "", "acting": True, "executions": [],
           "documents": [["c", 7]]}
    led = _run(tmp_path / "a", {**FLAG, "proof": bad}, answer=True)
    assert of_run.rerun_finding({"cause": "lr", "proven": True}, "bad_data") is None  # the proof stands
    assert of_run.rerun_answer(led, 5, {"cause": "lr", "proven": True}) is None
    skip = of_run.rerun_finding({"cause": "bad_data", "proven": True, "removed_by": "skip"}, None)
    assert skip == RerunFinding("bad_data", "a rerun reproduced it and skip removed it: something in this step's "
                                "data (not which documents: the quarantine variant names them)", False)
    assert of_run.rerun_finding({"cause": "lr", "proven": False}, None) is None  # nothing proven, no evidence
    assert of_run.contradicts("not_data", "hardware") and not of_run.contradicts("not_data", "lr")
    assert Context().checkpoints == ()
