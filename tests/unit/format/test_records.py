"""The on-disk format (titan_ledger.format.records): torn lines, segments, THE supersession rule,
schema ids, the launch log, non-finite values."""

import json

import numpy as np
import pytest

from titan_ledger.errors import LedgerCorrupt, LedgerError, LedgerWarning
from titan_ledger.format import records
from titan_ledger.format.records import SIGNALS, RecordWriter, read_ledger


def _rows(w, steps):
    for s in steps:
        w.write({"step": s, "loss": float(s)})


def test_round_trip_and_nonfinite(tmp_path):
    p = tmp_path / "signals.jsonl"
    w = RecordWriter(p, {"schema": SIGNALS.id, "run_id": "a", "resumed_from": 0, "seq": 1})
    w.write({"step": 1, "loss": float("nan"), "x": float("inf")})
    w.close()
    for line in p.read_text().splitlines():
        json.loads(line)  # strict JSON: no bare NaN
    led = read_ledger(p, SIGNALS.id)
    row = led.history[0]
    assert row["loss"] != row["loss"] and row["x"] == float("inf")


def test_torn_last_line_is_skipped_and_repaired(tmp_path):
    p = tmp_path / "signals.jsonl"
    w = RecordWriter(p, {"schema": SIGNALS.id, "run_id": "a", "resumed_from": 0, "seq": 1})
    _rows(w, [1, 2, 3])
    w.close()
    with open(p, "ab") as f:  # kill -9 in the middle of a write
        f.write(b'{"step": 4, "lo')
    with pytest.warns(LedgerWarning, match=r"signals.jsonl:5: torn last line skipped \(a kill -9"):
        led = read_ledger(p)
    assert [r["step"] for r in led.history] == [1, 2, 3] and led.torn_lines == 1
    # the next run resumes from a checkpoint at step 2; its header starts a new line
    w = RecordWriter(p, {"schema": SIGNALS.id, "run_id": "b", "resumed_from": 2, "seq": 2})
    _rows(w, [3, 4])
    w.close()
    with pytest.warns(LedgerWarning, match="signals.jsonl: torn line 5 skipped"):  # its segment's last
        led = read_ledger(p)
    assert [r["step"] for r in led.history] == [1, 2, 3, 4]
    assert [r["loss"] for r in led.history] == [1.0, 2.0, 3.0, 4.0]
    assert [(r["step"], r["superseded_by"]) for r in led.superseded] == [(3, "b")]
    assert [s.header["run_id"] for s in led.segments] == ["a", "b"]
    assert led.torn_lines == 1


def test_fresh_run_in_old_folder_supersedes_everything(tmp_path):
    p = tmp_path / "signals.jsonl"
    for seq, run in enumerate(("a", "b"), 1):
        w = RecordWriter(p, {"schema": SIGNALS.id, "run_id": run, "resumed_from": 0, "seq": seq})
        _rows(w, [1, 2])
        w.close()
    led = read_ledger(p)
    assert len(led.history) == 2 and len(led.superseded) == 2
    assert led.by_step()[2]["step"] == 2


def test_rows_cannot_pose_as_headers(tmp_path):
    w = RecordWriter(tmp_path / "x.jsonl", {"schema": SIGNALS.id})
    with pytest.raises(ValueError):
        w.write({"schema": "x", "step": 1})
    with pytest.raises(ValueError):
        RecordWriter(tmp_path / "y.jsonl", {"run_id": "no schema"})


def test_wrong_schema_and_missing_file(tmp_path):
    p = tmp_path / "r.jsonl"
    RecordWriter(p, {"schema": "titan_ledger.rank/1"}).close()
    with pytest.raises(LedgerError, match="not a signals ledger"):
        read_ledger(p, SIGNALS.id)
    with pytest.raises(LedgerError, match="no such ledger file"):
        read_ledger(tmp_path / "nope.jsonl")


def test_newer_schema_is_refused_older_reads(tmp_path):
    p = tmp_path / "signals.jsonl"
    RecordWriter(p, {"schema": "titan_ledger.signals/2", "run_id": "a"}).close()
    with pytest.raises(LedgerError, match="newer titan_ledger"):
        read_ledger(p, records.SIGNALS)
    q = tmp_path / "old.jsonl"
    RecordWriter(q, {"schema": "titan_ledger.signals/1", "run_id": "a", "resumed_from": 0, "seq": 1}).close()
    assert read_ledger(q, records.SIGNALS).segments[0].header.run_id == "a"


def _seg(path, run, resumed, steps, **hdr):
    w = RecordWriter(path, {"schema": records.DATA.id, "run_id": run, "resumed_from": resumed, **hdr})
    _rows(w, steps)
    w.close()


def _current(folder, n):
    segs, _ = records.read_many({r: folder / f"d{r}.jsonl" for r in range(n)}, records.DATA)
    cur, sup = records.resolve(segs)
    return {r: [x["step"] for x in rows] for r, rows in cur.items()}, sup


def test_supersession_follows_seq_not_wall_clock(tmp_path):
    # launch A (seq 1, 2 ranks) wrote steps 1-4; launch B (seq 2, 1 rank) resumed at 2.
    # B's clock is BEHIND A's (a node with a skewed clock): order must come from seq.
    for r in (0, 1):
        _seg(tmp_path / f"d{r}.jsonl", "A", 0, [1, 2, 3, 4], seq=1, time=500.0)
    _seg(tmp_path / "d0.jsonl", "B", 2, [3, 4, 5], seq=2, time=100.0)
    cur, sup = _current(tmp_path, 2)
    assert cur == {0: [1, 2, 3, 4, 5], 1: [1, 2]}
    assert sorted((x["step"], x["superseded_by"]) for x in sup) == [(3, "B"), (3, "B"), (4, "B"), (4, "B")]
    # a header without seq (an edited file) is refused, naming the line
    _seg(tmp_path / "d1.jsonl", "C", 4, [5])
    with pytest.raises(LedgerError, match=r"d1.jsonl:6: .*without an integer 'seq'"):
        _current(tmp_path, 2)


def test_sibling_ranks_of_one_launch_do_not_supersede_each_other(tmp_path):
    # a resumed launch writes resumed_from=2 into BOTH ranks' files: rank 1's header
    # must not drop rank 0's rows 3-4 that the same launch just wrote
    for r in (0, 1):
        _seg(tmp_path / f"d{r}.jsonl", "A", 0, [1, 2, 3], seq=1)
    for r in (0, 1):
        _seg(tmp_path / f"d{r}.jsonl", "B", 2, [3, 4], seq=2)
    cur, sup = _current(tmp_path, 2)
    assert cur == {0: [1, 2, 3, 4], 1: [1, 2, 3, 4]} and len(sup) == 2


def test_resolve_and_masks_are_one_rule(tmp_path):
    entries = [((1, 0.0, 0), "A", 0, np.array([1, 2, 3, 4, 5])),
               ((2, 0.0, 1), "B", 3, np.array([4, 5, 6])),
               ((3, 0.0, 2), "C", 1, np.array([2]))]
    m = records.supersession_masks(entries)
    assert [x.tolist() for x in m] == [[True, False, False, False, False], [False, False, False], [True]]


def test_event_logs_are_never_superseded(tmp_path):
    p = tmp_path / "spikes.jsonl"
    for seq, (run, resumed) in enumerate((("A", 0), ("B", 2)), 1):
        w = RecordWriter(p, {"schema": records.SPIKES.id, "run_id": run, "resumed_from": resumed, "seq": seq})
        w.write({"step": 5, "rules": ["zscore"]})
        w.close()
    assert [e["step"] for e in read_ledger(p, records.SPIKES).history] == [5, 5]


def test_history_as_of_a_rewound_step(tmp_path):
    p = tmp_path / "signals.jsonl"
    w = RecordWriter(p, {"schema": SIGNALS.id, "run_id": "a", "resumed_from": 0, "seq": 1})
    _rows(w, [1, 2, 3, 4, 5])
    w.close()
    w = RecordWriter(p, {"schema": SIGNALS.id, "run_id": "a.r1", "resumed_from": 2, "seq": 2})
    _rows(w, [6, 7])  # steps 3-5 skipped after the rewind
    w.close()
    led = read_ledger(p, records.SIGNALS)
    assert [r["step"] for r in led.history] == [1, 2, 6, 7]
    assert [r["step"] for r in led.history_as_of(5)] == [1, 2, 3, 4, 5]
    assert led.history_as_of(6) is led.history and led.history_as_of(99) is None


def test_launch_log_numbers_segments(tmp_path):
    assert records.next_seq(tmp_path) == 1
    records.append_segment(tmp_path, records.Header(schema="x", run_id="A", seq=1, resumed_from=0))
    records.append_segment(tmp_path, records.Header(schema="x", run_id="B", seq=2, resumed_from=4))
    with open(tmp_path / records.SEGMENTS_FILE, "ab") as f:
        f.write(b'{"seq": 3, "ru')  # killed mid-write: not a segment
    assert records.next_seq(tmp_path) == 3
    with pytest.warns(LedgerWarning, match="segments.jsonl:4: torn last line"):
        rows = read_ledger(tmp_path / records.SEGMENTS_FILE, records.SEGMENTS).history
    assert [(r["run_id"], r["step"]) for r in rows] == [("A", 0), ("B", 4)]
    # the next launch appends its row after the torn one: each launch log row is a launch,
    # so the torn row was the last line of its launch
    records.append_segment(tmp_path, records.Header(schema="x", run_id="C", seq=3, resumed_from=4))
    with pytest.warns(LedgerWarning, match="torn line 4 skipped"):
        rows = read_ledger(tmp_path / records.SEGMENTS_FILE, records.SEGMENTS).history
    assert [r["run_id"] for r in rows] == ["A", "B", "C"]


# --------------------------------------------------------------------------- issue 26: strict reading
def _three_rows(p):
    w = RecordWriter(p, {"schema": SIGNALS.id, "run_id": "a", "resumed_from": 0, "seq": 1})
    _rows(w, [1, 2, 3])
    w.close()


def _set_line(p, n, raw):
    lines = p.read_bytes().splitlines(keepends=True)
    lines[n - 1] = raw
    p.write_bytes(b"".join(lines))


@pytest.mark.parametrize("line,raw,why", [
    (3, b"garbage\n", "not JSON"),
    (3, b'{"step": 2, "lo\n', "not JSON"),  # a cut row with a row after it: not a kill -9
    (4, b"\x00\xff\n", "not JSON"),  # the last line, but with its newline
    (3, b"[2, 3]\n", "a JSON list, not an object"),
    (3, b'{"loss": 2.0}\n', "no integer 'step'"),
    (3, b'{"step": "2"}\n', "'step' is '2', not an integer"),
    (3, b'{"step": true}\n', "'step' is True"),
    (3, b'{"step": 2, "last_step": 4.5}\n', "'last_step' is 4.5"),
    (1, b'{"step": 0, "loss": 0.0}\n', "a row before the file's first header"),
])
def test_a_corrupt_line_is_an_error_naming_file_and_line(tmp_path, line, raw, why):
    p = tmp_path / "signals.jsonl"
    _three_rows(p)
    _set_line(p, line, raw)
    with pytest.raises(LedgerCorrupt) as e:
        read_ledger(p, records.SIGNALS)
    assert str(e.value).startswith(f"{p}:{line}: not a ledger row ({why}") and "\n" not in str(e.value)
    assert isinstance(e.value, LedgerError)


def test_only_torn_lines_are_skipped_and_the_rest_reads_silently(tmp_path, recwarn):
    p = tmp_path / "signals.jsonl"
    _three_rows(p)
    assert [r["step"] for r in read_ledger(p).history] == [1, 2, 3] and not recwarn.list
    p.write_bytes(p.read_bytes().rstrip(b"\n"))  # a complete last row without its newline
    assert [r["step"] for r in read_ledger(p).history] == [1, 2, 3] and not recwarn.list


def test_rows_after_an_offset(tmp_path):
    p = tmp_path / "d.jsonl"
    _seg(p, "A", 0, [1, 2])
    off = p.stat().st_size
    _seg(p, "B", 1, [2, 3])
    assert [r["step"] for r in records.rows_after(p, off)] == [2, 3]
    assert list(records.rows_after(tmp_path / "missing.jsonl", 0)) == []
