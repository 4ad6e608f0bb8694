"""The offset index (format/index.py): point queries equal the whole-file reading, read a
bounded number of bytes whatever the run's length, and survive a missing, torn or stale
index. Complexity is asserted by counting bytes read, not by timing."""

from __future__ import annotations

import json
import random
import tracemalloc
import warnings

import pytest

from titan_ledger.errors import LedgerWarning
from titan_ledger.format import index, records
from titan_ledger.format.data_reader import DataLedger, step_ids_between
from titan_ledger.format.reader import RunLedger, latest_data_header


def _data_segment(folder, r, seq, resumed, steps, dp=2, run=None, window=None):
    hdr = records.Header(schema=records.DATA.id, run_id=run or f"run{seq}", seq=seq, resumed_from=resumed,
                         time=float(seq), extra={"dp_size": dp, "mbs": 2, "global_batch": 2 * dp})
    w = records.RecordWriter(folder / records.data_file(r), hdr)
    for s in steps:
        if window and s == window[0]:
            w.write({"step": s, "skipped": True, "last_step": window[1],
                     "samples": [(s - 1) * 2 * dp, window[1] * 2 * dp]})
        elif window and window[0] < s <= window[1]:
            continue
        else:
            base = (s - 1) * 2 * dp + r * 2
            w.write({"step": s, "skipped": False, "rows": [[base, "c", [[base, 0, 8]]], [base + 1, "c", [[base + 1, 0, 8]]]]})
    w.close()


def _history(folder, launches):
    """Write a run: ``launches`` = [(resumed_from, last_step, dp, window)], every rank of each."""
    folder.mkdir(parents=True, exist_ok=True)
    for seq, (resumed, last, dp, window) in enumerate(launches, 1):
        for r in range(dp):
            _data_segment(folder, r, seq, resumed, range(resumed + 1, last + 1), dp=dp, window=window)


def _full_row(led: DataLedger, r: int, step: int):
    for row in led.history.get(r, []):
        if row["step"] <= step <= row.get("last_step", row["step"]):
            return row
    return None


@pytest.mark.parametrize("seed", range(4))
def test_point_queries_equal_the_whole_file_reading(tmp_path, seed):
    rng = random.Random(seed)
    launches, last = [], 0
    for _ in range(rng.randint(2, 5)):
        resumed = rng.randint(max(0, last - 30), last)
        end = resumed + rng.randint(5, 60)
        dp = rng.choice([1, 2, 4])
        win = None
        if rng.random() < 0.5 and end - resumed > 10:
            a = rng.randint(resumed + 1, end - 5)
            win = (a, a + rng.randint(0, 4))
        launches.append((resumed, end, dp, win))
        last = end
    _history(tmp_path, launches)
    fast, slow = DataLedger(tmp_path), DataLedger(tmp_path)
    for step in range(1, last + 3):
        for r in fast.ranks():
            assert fast.row(r, step) == _full_row(slow, r, step), (step, r, launches)
            got = fast.trained_row(r, step)
            want = None
            for seg in sorted(records.read_segments(slow.files[r], records.DATA)[0], key=records.order_key):
                for x in seg.rows:
                    if x["step"] == step and not x.get("skipped") and "last_step" not in x:
                        want = x
            assert got == want, (step, r)
        assert fast.missing_ranks(step) == [r for r in range(max((fast._row_dp.get(id(fast.row(q, step)), 0)
                                                                  for q in fast.ranks_at(step)), default=0))
                                            if r not in fast.ranks_at(step)]
    assert fast.last_step == max((row.get("last_step", row["step"]) for h in slow.history.values() for row in h),
                                 default=0)


def _long(folder, steps, dp=2):
    for r in range(dp):
        hdr = records.Header(schema=records.DATA.id, run_id="a", seq=1, resumed_from=0, time=1.0,
                             extra={"dp_size": dp, "mbs": 2, "global_batch": 2 * dp})
        w = records.RecordWriter(folder / records.data_file(r), hdr)
        for s in range(1, steps + 1):
            w.write({"step": s, "skipped": False, "samples": [(s - 1) * 2 * dp, s * 2 * dp], "digest": "0" * 16})
        w.close()


@pytest.fixture(scope="module")
def long_ledger(tmp_path_factory):
    folder = tmp_path_factory.mktemp("long")
    _long(folder, 100_000)
    return folder


def test_a_point_query_reads_a_bounded_number_of_bytes(long_ledger):
    size = (long_ledger / "data_dp0.jsonl").stat().st_size
    for step in (1, 50_000, 99_999, 100_000, 100_001):
        led = DataLedger(long_ledger)
        led.row(0, step)
        led.row(1, step)
        # O(log n): ~17 probe lines of ~80 B, one 4 KiB block, the index and the headers
        assert led.bytes_read() < 3 * (index.BLOCK + 64 * 200), (step, led.bytes_read())
    assert size > 5_000_000  # the file really is long (a whole read would show)


def test_opening_and_the_launch_check_read_no_rows(long_ledger):
    led = DataLedger(long_ledger)
    assert led.bytes_read() < 2 * (index.BLOCK + 1024)  # the index, headers, each segment's last line
    f = index.IndexedFile(long_ledger / "data_dp0.jsonl", records.DATA)
    assert f.segments[-1].header.seq == 1 and f.bytes_read < 1024
    assert latest_data_header(long_ledger)["dp_size"] == 2


def test_a_missing_index_is_rebuilt_once_and_written_back(long_ledger, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    copy.mkdir()
    for p in long_ledger.glob("*.jsonl"):
        shutil.copy(p, copy / p.name)  # a folder copied without its index
    led = DataLedger(copy)
    assert all(f.rebuilt for f in led._idx.values())
    assert (copy / "data_dp0.jsonl.idx").read_text() == (long_ledger / "data_dp0.jsonl.idx").read_text()
    assert led.row(1, 77_777) == DataLedger(long_ledger).row(1, 77_777)
    again = DataLedger(copy)
    assert not any(f.rebuilt for f in again._idx.values())


def test_a_stale_index_is_rebuilt_and_never_answers_wrong(tmp_path):
    for seq, (resumed, last) in enumerate([(0, 400), (300, 500)], 1):
        records.append_segment(tmp_path, records.Header(schema="", run_id=f"run{seq}", seq=seq,
                                                        resumed_from=resumed))
        kept = {r: records.index_path(tmp_path / records.data_file(r)).read_bytes() for r in range(2)} if seq == 2 else None
        for r in range(2):
            _data_segment(tmp_path, r, seq, resumed, range(resumed + 1, last + 1))
    # an older titan_ledger (no index) appended the resume: its header is unknown to the index
    for r, raw in kept.items():
        records.index_path(tmp_path / records.data_file(r)).write_bytes(raw)
    led = DataLedger(tmp_path)  # the launch log names seq 2, the index stops at 1: the tail is scanned
    assert led._idx[0].rebuilt and len(led.segments[0]) == 2
    full = DataLedger(tmp_path)
    for step in (299, 350, 401, 500):
        assert led.row(0, step) == _full_row(full, 0, step), step
    assert led.row(0, 350)["samples" if "samples" in led.row(0, 350) else "rows"]
    # a file no later launch wrote is scanned once, then remembered ("checked")
    records.append_segment(tmp_path, records.Header(schema="", run_id="run3", seq=3, resumed_from=500))
    first = DataLedger(tmp_path)
    assert not first._idx[0].rebuilt
    assert b'"checked":3' in records.index_path(tmp_path / "data_dp0.jsonl").read_bytes()
    again = index.IndexedFile(tmp_path / "data_dp0.jsonl", records.DATA, 3)
    assert len(again.segments) == 2 and again.bytes_read < 1024


def test_an_index_entry_past_the_end_is_a_segment_being_opened(tmp_path):
    _history(tmp_path, [(0, 20, 1, None)])
    size = (tmp_path / "data_dp0.jsonl").stat().st_size
    records.note_segment(tmp_path / "data_dp0.jsonl", size, 2)  # crash between the entry and the header
    led = DataLedger(tmp_path)
    assert led.row(0, 20)["step"] == 20 and not led._idx[0].rebuilt
    _data_segment(tmp_path, 0, 3, 10, range(11, 15), dp=1)  # the next launch writes at the same offset
    led = DataLedger(tmp_path)
    assert led.row(0, 14)["step"] == 14 and led.row(0, 18) is None  # resumed at 10: 15-20 superseded
    assert led._idx[0].rebuilt  # the dead entry named seq 2 where seq 3's header is: rebuilt


def test_a_torn_index_entry_and_a_torn_segment_end(tmp_path):
    _history(tmp_path, [(0, 30, 1, None)])
    path = tmp_path / "data_dp0.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"step": 31, "skipped": fa')  # kill -9 mid-row
    with open(records.index_path(path), "ab") as f:
        f.write(b'{"offset": 99')  # and a torn index entry of a launch that never wrote its header
    _data_segment(tmp_path, 0, 2, 25, range(26, 40), dp=1)
    with pytest.warns(LedgerWarning, match="torn line 32"):
        led = DataLedger(tmp_path)
    assert led.row(0, 31)["step"] == 31 and led.row(0, 39)["step"] == 39
    assert led.torn == {0: 1}


def test_a_rollback_with_another_dp_size_supersedes_every_rank_file(tmp_path):
    _history(tmp_path, [(0, 50, 4, None), (20, 60, 2, (21, 25))])
    led = DataLedger(tmp_path)
    assert led.row(3, 30) is None and led.row(3, 10)["step"] == 10  # DP 4's rank 3 lost steps > 20
    assert led.row(0, 23)["last_step"] == 25  # the skip window
    assert led.trained_row(3, 30)["step"] == 30  # as it trained before the resume
    assert led.missing_ranks(30) == [] and led.missing_ranks(10) == []
    ids = step_ids_between(led, 1, 60)
    assert set(ids[30]) == {0, 1} and set(ids[10]) == {0, 1, 2, 3}


def test_signal_windows_equal_the_history_as_of(tmp_path):
    folder = tmp_path / "ledger"
    folder.mkdir()
    for seq, (resumed, last) in enumerate([(0, 40), (20, 35), (30, 50)], 1):
        w = records.RecordWriter(folder / records.SIGNALS_FILE, {"schema": records.SIGNALS.id, "run_id": f"r{seq}",
                                                                  "resumed_from": resumed, "seq": seq})
        for s in range(resumed + 1, last + 1):
            w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": s, "loss": float(s * 10 + seq),
                     "skipped": False})
        w.close()
    led = RunLedger(tmp_path)
    for step in range(1, 52):
        full = led.rows_as_of(step)
        got = led.history_at(step, 7, 3)
        if full is None:
            assert got is None
            continue
        rows, current = got
        assert current == (full is led.signal_rows())
        assert rows == [r for r in full if step - 7 <= r["step"] <= step + 3], step
    assert led.last_signal_step() == 50


def test_replay_check_of_two_long_ledgers_streams(tmp_path):
    from titan_ledger.tools.replay import check

    for name in ("a", "b"):
        (tmp_path / name / "ledger").mkdir(parents=True)
        _long(tmp_path / name / "ledger", 12_000, dp=4)
    tracemalloc.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = check(tmp_path / "a", tmp_path / "b", chunk_ids=4_000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert res.equal and res.steps == 12_000
    # 48,000 rows a ledger (4.4 MB of ledger, ~60 MB as dicts): chunked, the peak is a chunk's
    assert peak < 12e6, peak


@pytest.mark.parametrize("chunk_ids", [1, 7, 40, 10_000])
def test_replay_check_is_the_same_whatever_the_chunk(tmp_path, chunk_ids):
    """Chunk edges cut skip windows, resumes and DP-size changes: the answer must not move."""
    from titan_ledger.tools.replay import check

    _history(tmp_path / "a" / "ledger", [(0, 50, 4, None), (20, 60, 2, (21, 25)), (40, 90, 2, (70, 77))])
    _history(tmp_path / "b" / "ledger", [(0, 30, 2, None), (10, 60, 4, (21, 25)), (35, 90, 2, (70, 77))])
    _history(tmp_path / "c" / "ledger", [(0, 90, 2, (21, 25))])
    for x, y in (("a", "a"), ("a", "b"), ("a", "c")):
        got = check(tmp_path / x, tmp_path / y, chunk_ids=chunk_ids).to_json()
        want = check(tmp_path / x, tmp_path / y, chunk_ids=10**9).to_json()
        assert got == want, (x, y)


def test_the_writer_keeps_one_index_line_per_segment(tmp_path):
    _history(tmp_path, [(0, 10, 1, None), (5, 12, 1, None)])
    lines = [json.loads(x) for x in records.index_path(tmp_path / "data_dp0.jsonl").read_text().splitlines()]
    assert [e["seq"] for e in lines] == [1, 2] and lines[0]["offset"] == 0
    raw = (tmp_path / "data_dp0.jsonl").read_bytes()
    assert raw[lines[1]["offset"]:].startswith(b'{"schema"')


# --------------------------------------------------------------------------- review cases


def _seg(folder, seq, run, resumed, rows, schema=records.DATA, name=None):
    h = records.Header(schema="", run_id=run, seq=seq, resumed_from=resumed, time=seq,
                       extra={"dp_size": 1, "global_batch": 2, "mbs": 1})
    records.append_segment(folder, h)
    w = records.RecordWriter(folder / (name or records.data_file(0)), records.Header(**{**h.__dict__, "schema": schema.id}))
    for r in rows:
        w.write(r)
    w.close()


def _step(s):
    return {"step": s, "skipped": False, "rows": [[(s - 1) * 2 + j, "x", [[0, 0, 1]]] for j in range(2)]}


def _window(a, b):
    return {"step": a, "last_step": b, "skipped": True, "samples": [(a - 1) * 2, b * 2],
            "layout": {"mbs": 1, "dp_size": 1, "global_batch": 2}}


@pytest.mark.parametrize("chunk", [1, 2, 4, 5, 100])
def test_the_stream_carries_every_window_that_crosses_a_chunk_edge(tmp_path, chunk):
    """A later launch's window inside an earlier window that stays current: both cross the
    chunk edge (a single carried window lost steps 7-20 here)."""
    from titan_ledger.format.data_reader import stream_step_ids

    _seg(tmp_path, 1, "A", 0, [_window(1, 20)])
    _seg(tmp_path, 2, "B", 1, [_window(2, 6), _step(7)])
    _seg(tmp_path, 3, "C", 2, [_step(3)])
    got = {}
    for _, _, ids in stream_step_ids(DataLedger(tmp_path), chunk):
        got.update(ids)
    assert got == step_ids_between(DataLedger(tmp_path), 1, 20) and sorted(got) == list(range(1, 21))


def test_a_header_cut_before_its_newline_is_a_header(tmp_path):
    """The old strict reading takes a complete header at the file's end as a segment, so a
    resume there supersedes what follows its resumed_from; the index reading must too."""
    _seg(tmp_path, 1, "A", 0, [_step(s) for s in range(1, 30)])
    path = tmp_path / records.data_file(0)
    hdr = {"schema": records.DATA.id, "run_id": "B", "seq": 2, "resumed_from": 10, "dp_size": 1,
           "global_batch": 2, "mbs": 1}
    records.note_segment(path, path.stat().st_size, 2)
    with open(path, "ab") as f:
        f.write(json.dumps(hdr).encode())  # no newline: the write cut just before it
    full = records.read_ledger(path, records.DATA)
    led = DataLedger(tmp_path)
    for s in (5, 10, 11, 20):
        assert led.row(0, s) == next((r for r in full.history if r["step"] == s), None), s


def test_a_torn_first_header_is_not_rescanned_on_every_open(tmp_path):
    path = tmp_path / records.data_file(0)
    path.write_bytes(b'{"schema": "titan_le')  # kill -9 in the first header
    _seg(tmp_path, 2, "B", 0, [_step(s) for s in range(1, 200)])
    with pytest.warns(LedgerWarning):
        first = DataLedger(tmp_path)
    assert first._idx[0].rebuilt
    with pytest.warns(LedgerWarning):
        again = DataLedger(tmp_path)
    assert not again._idx[0].rebuilt and again.row(0, 150)["step"] == 150


def test_a_blank_line_inside_a_segment_is_passed_over(tmp_path):
    _seg(tmp_path, 1, "A", 0, [_step(s) for s in range(1, 50)])
    path = tmp_path / records.data_file(0)
    lines = path.read_bytes().split(b"\n")
    lines.insert(20, b"")
    path.write_bytes(b"\n".join(lines))
    full = records.read_ledger(path, records.DATA)
    led = DataLedger(tmp_path)
    assert [led.row(0, s)["step"] for s in range(1, 50)] == [r["step"] for r in full.history]


def test_history_at_a_never_trained_step_inside_a_window_is_none_as_rows_as_of(tmp_path):
    folder = tmp_path / "ledger"
    folder.mkdir()
    keys = {k: None for k in records.SIGNAL_KEYS}
    _seg(folder, 1, "A", 0, [{**keys, "step": 1, "loss": 1.0, "skipped": False},
                             {**keys, "step": 2, "last_step": 9, "skipped": True}],
         schema=records.SIGNALS, name=records.SIGNALS_FILE)
    led = RunLedger(tmp_path)
    for s in (1, 2, 5, 9):
        want = led.rows_as_of(s)
        got = led.history_at(s, 100, 100)
        assert (got is None) == (want is None), s
        if got is not None:
            assert got[0] == want and got[1] == (want is led.signal_rows())
