"""plot: decimation keeps peaks; the CLI writes a PNG and fails in one line; the panels
are legible (``assert_legible``, also run on a real run's incident page in
tests/e2e/test_dashboards_e2e.py)."""

from __future__ import annotations

import numpy as np

from titan_ledger.tools.plot import PANELS, envelope, main, plot

from ..format.test_columns import _signals


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
    assert (tmp_path / "t.png").stat().st_size > 10_000
    assert main([str(tmp_path)]) == 0 and (tmp_path / "signals.png").is_file()  # default: into the dump folder


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
                             {"schema": records.SPIKES.id, "run_id": "a", "seq": 1})
    w.write({"step": 9, "rules": ["zscore_grad_norm", "ratio"], "loss_max_rank": 1, "loss": 9.0,
             "grad_norm": 1.0})
    w.close()
    info = plot(tmp_path, tmp_path / "s.png", max_norm=1.0)
    # _signals: segment b resumed from step 6, so a's trained rows 7-10 are superseded
    assert info["rolled_back_rows"] == 4 and info["spikes"] == 1 and info["max_norm"] == 1.0
    assert spike_labels([{"step": 9, "rules": ["zscore_grad_norm", "ratio"], "loss_max_rank": 1}]) == \
        [(9, "9: zscore_grad_norm, ratio (DP rank 1)")]
    gn = np.array([0.5, 3.0, 2.0, np.nan])
    assert infer_max_norm({"grad_norm": gn, "grad_norm_clipped": np.array([0.5, 1.0, 1.0, np.nan])}) == 1.0
    assert infer_max_norm({"grad_norm": gn, "grad_norm_clipped": gn}) is None


# --------------------------------------------------------------------------- legibility
MIN_PANEL_PX = 120  # a panel's plotting area, in pixels of the saved image
MAX_GAP_PX = 40  # blank space between two panels


def _overlap(a, b) -> bool:
    """Do two ``[x0, y0, x1, y1]`` boxes share any area?"""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def assert_legible(layout: dict, spikes: list[int], scale: float = 1.0) -> None:
    """The panels of ``plot``'s ``layout`` are readable: each at least MIN_PANEL_PX tall
    (times ``scale``, the size it is shown at), no tall gaps between them, no legend over
    any of its panel's data (not even the data area), every spike labelled with its step,
    the labels short and between the title and the first panel, nothing off the image."""
    w, h = layout["size_px"]
    panels = layout["panels"]
    # every panel the table declares (format/signal_columns.py), top to bottom
    assert [p["name"] for p in panels] == [ylabel.split("\n")[0] for ylabel, _, _ in PANELS], panels
    inside = lambda b: -1 <= b[0] and b[2] <= w + 1 and -1 <= b[1] and b[3] <= h + 1  # noqa: E731
    for p in panels:
        ax = p["axes"]
        assert (ax[3] - ax[1]) * scale >= MIN_PANEL_PX, (p["name"], ax, scale)
        assert inside(ax), p
        leg = p["legend"]
        if leg is not None:
            assert inside(leg), (p["name"], leg, layout["size_px"])
            assert not _overlap(leg, ax), (p["name"], "legend over the data area", leg, ax)
            for name, ext in p["lines"].items():
                assert not _overlap(leg, ext), (p["name"], f"legend over the line {name!r}", leg, ext)
    for a, b in zip(panels, panels[1:]):
        assert 0 <= b["axes"][1] - a["axes"][3] <= MAX_GAP_PX, ("gap", a["name"], a["axes"], b["name"], b["axes"])
    assert sum(p["axes"][3] - p["axes"][1] for p in panels) >= 0.75 * h  # the image is mostly data
    first, title = panels[0]["axes"], layout["title"]
    assert inside(title) and title[3] <= first[1], (title, first)
    labels = layout["spike_labels"]
    assert {int(lab["text"]) for lab in labels} == set(spikes), (labels, spikes)
    for lab in labels:
        b = lab["box"]
        assert len(lab["text"]) <= 8 and inside(b), lab
        assert title[3] - 1 <= b[1] and b[3] <= first[1] + 1 and first[0] <= b[0] and b[2] <= first[2], (lab, first)
        assert not any(_overlap(b, p["axes"]) for p in panels), lab
    for a, b in zip(labels, labels[1:]):
        assert not _overlap(a["box"], b["box"]), (a, b)


def _drill(tmp_path, spikes=(9,)):
    """The _signals ledger (a resume superseded steps 7-10) with flagged ``spikes``."""
    from titan_ledger.format import records

    (tmp_path / "ledger").mkdir()
    _signals(tmp_path / "ledger" / "signals.jsonl")
    w = records.RecordWriter(tmp_path / "ledger" / records.SPIKES_FILE,
                             {"schema": records.SPIKES.id, "run_id": "a", "seq": 1})
    for s in spikes:
        w.write({"step": s, "rules": ["zscore_loss", "zscore_grad_norm", "grad_jump", "ratio"], "loss_max_rank": 1,
                 "loss": 9.0, "grad_norm": 1.0})
    w.close()
    return tmp_path


def test_panels_are_legible(tmp_path):
    d = _drill(tmp_path)
    for width in (1100, 1600):
        info = plot(d, tmp_path / f"s{width}.png", width_px=width, max_norm=1.0)
        assert info["layout"]["size_px"][0] == width
        assert_legible(info["layout"], [9])


def test_spike_labels_never_overprint(tmp_path):
    """3000 steps, a spike every 20: one label per ~label width, none overlapping, every line drawn."""
    from titan_ledger.format import records
    from titan_ledger.tools.plot import thin_labels

    (tmp_path / "ledger").mkdir()
    w = records.RecordWriter(tmp_path / "ledger" / "signals.jsonl",
                             {"schema": records.SIGNALS.id, "run_id": "a", "resumed_from": 0, "seq": 1})
    for s in range(1, 3001):
        w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": s, "loss": 5.0 + (s % 20 == 0), "lr": 1e-3,
                 "grad_norm": 1.0, "skipped": False})
    w.close()
    spikes = list(range(20, 3001, 20))
    w = records.RecordWriter(tmp_path / "ledger" / records.SPIKES_FILE,
                             {"schema": records.SPIKES.id, "run_id": "a", "seq": 1})
    for s in spikes:
        w.write({"step": s, "rules": ["zscore_loss"], "loss_max_rank": 0, "loss": 6.0, "grad_norm": 1.0})
    w.close()
    info = plot(tmp_path, tmp_path / "s.png")
    shown = [int(lab["text"]) for lab in info["layout"]["spike_labels"]]
    assert shown == thin_labels(spikes, np.arange(1, 3001), 1600) and shown[0] == 20
    assert 10 <= len(shown) < len(spikes) and set(shown) <= set(spikes)
    assert info["spikes"] == len(spikes)
    assert_legible(info["layout"], shown)


def test_the_legibility_check_fails_on_the_old_layout(tmp_path, monkeypatch):
    """What the issue showed: thin panels, and legends drawn over the data (loc inside the axes)."""
    import matplotlib.axes
    import pytest

    from titan_ledger.tools import plot as plot_mod

    d = _drill(tmp_path)
    monkeypatch.setattr(plot_mod, "PANEL_PX", 90)
    with pytest.raises(AssertionError, match="loss"):
        assert_legible(plot(d, tmp_path / "thin.png")["layout"], [9])
    monkeypatch.undo()
    legend = matplotlib.axes.Axes.legend
    monkeypatch.setattr(matplotlib.axes.Axes, "legend",
                        lambda self, **k: legend(self, fontsize=7, loc="upper right"))
    with pytest.raises(AssertionError, match="legend over"):
        assert_legible(plot(d, tmp_path / "covered.png")["layout"], [9])


def test_a_windowed_plot_reads_the_window_and_draws_what_the_whole_read_draws(tmp_path, monkeypatch):
    """report's panels (--from-step and --to-step) read the window through the offset index;
    the columns, windows and rolled-back dots equal the whole file's, restricted."""
    import titan_ledger.tools.plot as plot_mod
    from titan_ledger.format.arrow import signal_columns as whole_columns
    from titan_ledger.format.reader import RunLedger

    (tmp_path / "ledger").mkdir()
    _signals(tmp_path / "ledger" / "signals.jsonl", nan=True)
    led = RunLedger(tmp_path)
    for lo, hi in ((1, 14), (5, 9), (8, 12)):
        cur, sup = led.signals_window(lo, hi)
        got = plot_mod._columns([r for r in cur if not r.get("skipped")])
        cols, _ = whole_columns(led, plot_mod.KEYS)
        sel = (cols["step"] >= lo) & (cols["step"] <= hi)
        for k, v in cols.items():
            want = v[sel]
            have = got[k][(got["step"] >= lo) & (got["step"] <= hi)]
            assert np.array_equal(want, have, equal_nan=True), (lo, hi, k)
        old = plot_mod._columns([r for r in sup if not r.get("skipped") and r.get("loss") is not None
                                 and lo <= r["step"] <= hi], float_steps=True)
        ref = plot_mod.rolled_back(led, lo, hi)
        assert old.keys() == ref.keys() and all(np.array_equal(old[k], ref[k], equal_nan=True) for k in ref)
    info = plot(tmp_path, tmp_path / "w.png", from_step=5, to_step=9)
    assert info["rows"] == 4 and info["rolled_back_rows"] == 3 and info["skipped_windows"] == 0  # 7-9 resumed
