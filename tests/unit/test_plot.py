"""plot: decimation keeps peaks; the CLI writes a PNG and fails in one line."""

from __future__ import annotations

import numpy as np

from titan_ledger.plot import envelope, main, plot
from tests.unit.test_columns import _signals


def test_envelope_keeps_single_step_peaks():
    x = np.arange(100_000)
    y = np.ones(100_000)
    y[54_321] = 50.0
    ex, ey = envelope(x, y, 500)
    assert len(ex) == 1000 and ey.max() == 50.0


def test_plot_writes_a_png(tmp_path):
    (tmp_path / "ledger").mkdir()
    _signals(tmp_path / "ledger" / "signals.jsonl")
    info = plot(tmp_path, tmp_path / "s.png")
    assert info["rows"] == 8 and info["skipped_windows"] == 0
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["--dump_folder", str(tmp_path), "-o", str(tmp_path / "t.png")]) == 0


def test_missing_run_is_one_line_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such dump folder" in err[0]
