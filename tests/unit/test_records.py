"""The JSONL record format: torn lines, segments, superseded history, non-finite values."""

import json

import pytest

from titan_ledger.records import SIGNALS_SCHEMA, RecordWriter, read_ledger


def _rows(w, steps):
    for s in steps:
        w.write({"step": s, "loss": float(s)})


def test_round_trip_and_nonfinite(tmp_path):
    p = tmp_path / "signals.jsonl"
    w = RecordWriter(p, {"schema": SIGNALS_SCHEMA, "run_id": "a", "resumed_from": 0})
    w.write({"step": 1, "loss": float("nan"), "x": float("inf")})
    w.close()
    for line in p.read_text().splitlines():
        json.loads(line)  # strict JSON: no bare NaN
    led = read_ledger(p, SIGNALS_SCHEMA)
    row = led.history[0]
    assert row["loss"] != row["loss"] and row["x"] == float("inf")


def test_torn_last_line_is_skipped_and_repaired(tmp_path):
    p = tmp_path / "signals.jsonl"
    w = RecordWriter(p, {"schema": SIGNALS_SCHEMA, "run_id": "a", "resumed_from": 0})
    _rows(w, [1, 2, 3])
    w.close()
    with open(p, "ab") as f:  # kill -9 in the middle of a write
        f.write(b'{"step": 4, "lo')
    led = read_ledger(p)
    assert [r["step"] for r in led.history] == [1, 2, 3] and led.torn_lines == 1
    # the next run resumes from a checkpoint at step 2; its header starts a new line
    w = RecordWriter(p, {"schema": SIGNALS_SCHEMA, "run_id": "b", "resumed_from": 2})
    _rows(w, [3, 4])
    w.close()
    led = read_ledger(p)
    assert [r["step"] for r in led.history] == [1, 2, 3, 4]
    assert [r["loss"] for r in led.history] == [1.0, 2.0, 3.0, 4.0]
    assert [(r["step"], r["superseded_by"]) for r in led.superseded] == [(3, "b")]
    assert [s.header["run_id"] for s in led.segments] == ["a", "b"]
    assert led.torn_lines == 1


def test_fresh_run_in_old_folder_supersedes_everything(tmp_path):
    p = tmp_path / "signals.jsonl"
    for run in ("a", "b"):
        w = RecordWriter(p, {"schema": SIGNALS_SCHEMA, "run_id": run, "resumed_from": 0})
        _rows(w, [1, 2])
        w.close()
    led = read_ledger(p)
    assert len(led.history) == 2 and len(led.superseded) == 2
    assert led.by_step()[2]["step"] == 2


def test_rows_cannot_pose_as_headers(tmp_path):
    w = RecordWriter(tmp_path / "x.jsonl", {"schema": SIGNALS_SCHEMA})
    with pytest.raises(ValueError):
        w.write({"schema": "x", "step": 1})
    with pytest.raises(ValueError):
        RecordWriter(tmp_path / "y.jsonl", {"run_id": "no schema"})


def test_wrong_schema_and_missing_file(tmp_path):
    p = tmp_path / "r.jsonl"
    RecordWriter(p, {"schema": "titan_ledger.rank/1"}).close()
    with pytest.raises(ValueError, match="schema"):
        read_ledger(p, SIGNALS_SCHEMA)
    with pytest.raises(FileNotFoundError):
        read_ledger(tmp_path / "nope.jsonl")
