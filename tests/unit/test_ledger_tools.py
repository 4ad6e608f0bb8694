"""Ledger readers and planners without processes: data-ledger supersession across
files, the rollback plan and overlay, plot's fast and exact readers."""

from __future__ import annotations


import numpy as np
import pytest

from titan_ledger import records
from titan_ledger.data.provenance import DataLedger, LedgerError
from titan_ledger.plot import _read_columns_arrow, _read_columns_py, envelope, plot
from titan_ledger.rollback import PlanError, overlay_toml, plan


def _hdr(run, resumed, dp, t, mbs=2):
    return {"schema": records.DATA_SCHEMA, "run_id": run, "resumed_from": resumed, "time": t,
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
    assert led.last_step == 6
    with pytest.raises(LedgerError, match="no data for step 9"):
        led.ids_at(9, 0)
    with pytest.raises(LedgerError, match="no data ledger"):
        DataLedger(tmp_path / "empty")


def test_rollback_plan_and_overlay():
    p = plan([100, 200, 300, 400], spike_step=390, back=100, skip=200, existing=["50-60"])
    assert p["load_step"] == 200 and p["skip_window"] == [201, 400]
    assert p["skip_steps"] == ["50-60", "201-400"]
    assert p["overrides"] == ["--checkpoint.load_step", "200", "--ledger.skip_steps", "50-60,201-400"]
    text = overlay_toml(p)
    import tomli

    assert tomli.loads(text) == {"checkpoint": {"load_step": 200}, "ledger": {"skip_steps": ["50-60", "201-400"]}}
    with pytest.raises(PlanError, match="smaller --back"):
        plan([100], spike_step=150, back=100)
    with pytest.raises(PlanError, match="does not contain the spike"):
        plan([100], spike_step=400, back=100, skip=50)


def _signals(tmp_path, torn=False, nan=False):
    w = records.RecordWriter(tmp_path / "signals.jsonl", {"schema": records.SIGNALS_SCHEMA, "resumed_from": 0})
    for s in range(1, 11):
        row = {k: None for k in records.SIGNAL_KEYS}
        row.update(step=s, loss=float(s), grad_norm=1.0, skipped=False, lr=1e-3)
        if nan and s == 9:
            row["loss"] = float("nan")
        w.write(row)
    w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": 11, "last_step": 14, "skipped": True})
    w.close()
    w = records.RecordWriter(tmp_path / "signals.jsonl", {"schema": records.SIGNALS_SCHEMA, "resumed_from": 6})
    for s in range(7, 9):
        row = {k: None for k in records.SIGNAL_KEYS}
        row.update(step=s, loss=100.0 + s, grad_norm=2.0, skipped=False, lr=1e-3)
        w.write(row)
    w.close()
    if torn:
        with open(tmp_path / "signals.jsonl", "ab") as f:
            f.write(b'{"step": 9, "lo')


@pytest.mark.parametrize("variant", ["plain", "torn", "nan"])
def test_plot_readers_agree_and_drop_superseded_rows(tmp_path, variant):
    _signals(tmp_path, torn=variant == "torn", nan=variant == "nan")
    slow = _read_columns_py(tmp_path / "signals.jsonl")
    assert list(slow[0]["step"]) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert slow[0]["loss"][-1] == 108.0 and slow[1] == []  # the window was in the lost run
    if variant == "plain":
        fast = _read_columns_arrow(tmp_path / "signals.jsonl")
        assert all(np.array_equal(fast[0][k], slow[0][k], equal_nan=True) for k in slow[0])
        assert fast[1] == slow[1]


def test_envelope_keeps_single_step_peaks():
    x = np.arange(100_000)
    y = np.ones(100_000)
    y[54_321] = 50.0
    ex, ey = envelope(x, y, 500)
    assert len(ex) == 1000 and ey.max() == 50.0


def test_plot_writes_a_png(tmp_path):
    (tmp_path / "ledger").mkdir()
    _signals(tmp_path / "ledger")
    info = plot(tmp_path, tmp_path / "s.png")
    assert info["rows"] == 8 and info["skipped_windows"] == 0
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
