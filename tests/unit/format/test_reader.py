"""RunLedger / DataLedger (titan_ledger.format.reader): every tool's one way in."""

from __future__ import annotations

import pytest

from titan_ledger.errors import LedgerError, LedgerWarning
from titan_ledger.format import records
from titan_ledger.format.data_reader import DataLedger
from titan_ledger.format.reader import RunLedger, checkpoints


def _hdr(run, resumed, dp, t, mbs=2):
    return {"schema": records.DATA.id, "run_id": run, "resumed_from": resumed, "time": t, "seq": int(t),
            "dp_size": dp, "dp_rank": 0, "mbs": mbs, "global_batch": 4, "source_kind": "text"}


def test_data_ledger_resume_with_fewer_ranks_supersedes_across_files(tmp_path):
    # run A: 2 DP ranks, steps 1-4 (killed); run B: 1 rank, resumed from step 2
    for r in (0, 1):
        w = records.RecordWriter(tmp_path / f"data_dp{r}.jsonl", {**_hdr("A", 0, 2, 1.0), "dp_rank": r})
        for s in range(1, 5):
            w.write({"step": s, "skipped": False,
                     "rows": [[(s - 1) * 4 + r * 2 + j, "c4", [[0, 0, 8]]] for j in range(2)]})
        w.close()
    w = records.RecordWriter(tmp_path / "data_dp0.jsonl", _hdr("B", 2, 1, 2.0, mbs=4))
    for s in (3, 4):
        w.write({"step": s, "skipped": False, "rows": [[(s - 1) * 4 + j, "c4", [[0, 0, 8]]] for j in range(4)]})
    w.write({"step": 5, "last_step": 6, "skipped": True, "samples": [16, 24],
             "layout": {"mbs": 4, "dp_size": 1, "global_batch": 4}})
    w.close()
    led = DataLedger(tmp_path)
    assert led.ranks_at(2) == [0, 1] and led.ranks_at(3) == [0]  # rank 1's steps 3-4 are superseded
    assert led.ids_at(3, 0) == (8, 9, 10, 11)
    assert led.ids_at(6, 0) == (20, 21, 22, 23) and led.ids_at(5, 0) == (16, 17, 18, 19)
    assert led.last_step == 6 and led.header()["run_id"] == "B"
    with pytest.raises(LedgerError, match="no data for step 9"):
        led.ids_at(9, 0)
    with pytest.raises(LedgerError, match="DP rank 5"):
        led.at(2, 5)
    with pytest.raises(LedgerError, match="no data ledger"):
        DataLedger(tmp_path / "empty")


def test_an_empty_rank_file_is_an_error_not_a_missing_rank(tmp_path):
    w = records.RecordWriter(tmp_path / "data_dp1.jsonl", _hdr("A", 0, 2, 1.0))
    w.write({"step": 1, "skipped": False, "rows": [[2, "c4", [[0, 0, 8]]]]})
    w.close()
    (tmp_path / "data_dp0.jsonl").write_bytes(b'{"schema": "titan_le')  # torn before its header
    with pytest.raises(LedgerError, match="data_dp0.jsonl"), pytest.warns(LedgerWarning, match="torn"):
        DataLedger(tmp_path)


def _signals(folder, steps, resumed=0, run="a", seq=1):
    w = records.RecordWriter(folder / records.SIGNALS_FILE,
                             {"schema": records.SIGNALS.id, "run_id": run, "resumed_from": resumed, "seq": seq})
    for s in steps:
        w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": s, "loss": float(s), "skipped": False})
    w.close()


def test_run_ledger_views(tmp_path):
    led_dir = tmp_path / "ledger"
    led_dir.mkdir()
    _signals(led_dir, [1, 2, 3, 4])
    _signals(led_dir, [3], resumed=2, run="b", seq=2)
    w = records.RecordWriter(led_dir / records.SPIKES_FILE, {"schema": records.SPIKES.id, "run_id": "a", "seq": 1})
    w.write({"step": 4, "rules": ["ratio"]})
    w.write({"step": 4, "rewind_to": 2, "skip_window": [3, 4], "action": "rollback"})
    w.close()
    for step, complete in ((2, True), (4, False)):
        d = tmp_path / "checkpoint" / f"step-{step}"
        d.mkdir(parents=True)
        if complete:
            (d / ".metadata").write_bytes(b"x")
    led = RunLedger(tmp_path)
    assert [r["step"] for r in led.signal_rows()] == [1, 2, 3]
    assert [r["step"] for r in led.rows_as_of(4)] == [1, 2, 3, 4]
    assert led.spike_steps() == [4] and led.rewinds()[0]["rewind_to"] == 2
    assert led.checkpoints() == [2] == checkpoints(tmp_path)  # step-4 was killed mid-write
    assert RunLedger.at(led_dir).folder == led.folder


def test_run_ledger_errors_name_the_folder(tmp_path):
    with pytest.raises(LedgerError, match="no such dump folder"):
        RunLedger(tmp_path / "nope")
    (tmp_path / "ledger").mkdir()
    with pytest.raises(LedgerError, match="no signals ledger"):
        RunLedger(tmp_path).signal_rows()
    (tmp_path / "ledger" / records.SIGNALS_FILE).write_bytes(b"")
    with pytest.raises(LedgerError, match="died before its first step"):
        RunLedger(tmp_path).signal_rows()


def test_a_file_of_another_run_is_named_and_a_launch_opening_now_is_not(tmp_path):
    """Issue 26: every file of a run is checked against its launch log (run id, seq) on read."""
    from titan_ledger.errors import LedgerCorrupt

    def data_file(r, run, seq, resumed=0, steps=(1, 2)):
        w = records.RecordWriter(tmp_path / f"data_dp{r}.jsonl",
                                 {**_hdr(run, resumed, 2, float(seq)), "dp_rank": r, "seq": seq})
        for s in steps:
            w.write({"step": s, "skipped": False, "rows": [[(s - 1) * 4 + r * 2 + j, "c4", [[0, 0, 8]]]
                                                           for j in range(2)]})
        w.close()

    data_file(0, "A", 1)
    data_file(1, "Z", 1)  # copied in from another run
    assert DataLedger(tmp_path).ranks() == [0, 1]  # no launch log (an older ledger): not checked
    records.append_segment(tmp_path, records.Header(schema="", run_id="A", seq=1, resumed_from=0))
    with pytest.raises(LedgerCorrupt, match=r"data_dp1.jsonl: holds run 'Z' \(segment 1\), but this run's "
                                            r"launch log .*segments.jsonl records run 'A' at segment 1"):
        DataLedger(tmp_path)
    (tmp_path / "data_dp1.jsonl").unlink()
    data_file(1, "A", 1)
    data_file(1, "B", 2, resumed=1, steps=(2,))  # the next launch: rank 1 wrote its header first
    assert DataLedger(tmp_path).ranks_at(2) == [1]  # a launch opening right now is not foreign
    data_file(2, "B", 2, resumed=1, steps=(2,))
    assert 2 in DataLedger(tmp_path).ranks()
    records.append_segment(tmp_path, records.Header(schema="", run_id="B", seq=2, resumed_from=1))
    data_file(3, "Y", 1)  # another run's rank 3, seq 1 of ITS run
    with pytest.raises(LedgerCorrupt, match="data_dp3.jsonl: holds run 'Y'"):
        DataLedger(tmp_path)
    from titan_ledger.format.run_identity import launch_ids

    assert launch_ids(tmp_path) == {1: "A", 2: "B"}  # the run identity every reader checks a file against


def test_a_sample_is_checked_against_the_run_before_any_corpus_access(tmp_path):
    w = records.RecordWriter(tmp_path / "data_dp0.jsonl", _hdr("A", 0, 1, 1.0))
    w.write({"step": 1, "skipped": False, "rows": [[0, "c4", [[0, 0, 8]]], [1, "c4", [[0, 8, 16]]]]})
    w.write({"step": 2, "last_step": 3, "skipped": True, "samples": [2, 6]})
    w.close()
    led = DataLedger(tmp_path)
    assert led.sample_range == (0, 5)
    for bad in (-1, 6, 10**12):
        with pytest.raises(LedgerError, match=rf"sample {bad}: outside the run: it consumed samples 0-5 "
                                              rf"\(steps 1-3, "):
            led.sample(bad)
    with pytest.raises(LedgerError, match="text stream"):  # in range: on to the corpus
        led.sample(5)
