"""plot: decimation keeps peaks; the CLI writes a PNG and fails in one line."""

from __future__ import annotations

import numpy as np

from tests.unit.test_columns import _signals
from titan_ledger.tools.plot import envelope, main, plot


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


def test_rolled_back_rows_max_norm_and_spike_labels(tmp_path):
    """Rows a resume superseded are drawn (faintly), the clip threshold is inferred
    from the clipped steps, and each spike is labelled with its rules and rank."""
    from titan_ledger.format import records
    from titan_ledger.tools.plot import infer_max_norm, spike_labels

    (tmp_path / "ledger").mkdir()
    _signals(tmp_path / "ledger" / "signals.jsonl")
    w = records.RecordWriter(tmp_path / "ledger" / records.SPIKES_FILE,
                             {"schema": records.SPIKES_SCHEMA, "run_id": "a", "seq": 1})
    w.write({"step": 9, "rules": ["zscore_grad_norm", "ratio"], "loss_max_rank": 1, "loss": 9.0,
             "grad_norm": 1.0})
    w.close()
    info = plot(tmp_path, tmp_path / "s.png", max_norm=1.0)
    # _signals: segment b resumed from step 6, so a's trained rows 7-10 are superseded
    assert info["rolled_back_rows"] == 4 and info["spikes"] == 1 and info["max_norm"] == 1.0
    assert spike_labels([{"step": 9, "rules": ["zscore_grad_norm", "ratio"], "loss_max_rank": 1}]) == \
        [(9, "9: zscore_grad_norm,ratio (DP rank 1)")]
    gn = np.array([0.5, 3.0, 2.0, np.nan])
    assert infer_max_norm({"grad_norm": gn, "grad_norm_clipped": np.array([0.5, 1.0, 1.0, np.nan])}) == 1.0
    assert infer_max_norm({"grad_norm": gn, "grad_norm_clipped": gn}) is None
