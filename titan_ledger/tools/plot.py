"""``python -m titan_ledger.plot``: the signals ledger as one picture.

Design decision: read the same ledger files as every other tool (signals.jsonl,
spikes.jsonl) and draw the panels the signal-column table declares
(:func:`titan_ledger.format.signal_columns.plot_panels`) against step -- today six: loss
(average and worst DP rank), pre-clip grad norm, param norm, max attention logit, zeros in grads, LR --
with spikes as red lines (their steps in red above the first panel, their rules and worst
DP rank in the title), skipped windows shaded, rows a rollback (or resume) superseded drawn
faintly, and the clip threshold ``max_norm`` as a dashed line on the grad-norm panel (pre-
and post-clip norms). Legibility: a fixed height per panel (the figure grows with the
panels, constrained layout, no gaps) and legends right of the panels, never over the data;
``plot`` returns where everything landed (``layout``), which the tests check. Long runs are
decimated to a min/max envelope per pixel column, so a 10^6-row ledger draws as fast as a
short one and a single-step spike is never averaged away; its columns are
:func:`titan_ledger.format.arrow.signal_columns`, the table ``export`` writes.

Examples::

    python -m titan_ledger.plot outputs/debug_cpu -o signals.png
    python -m titan_ledger.plot outputs/debug_cpu -o late.png --from-step 130000 --to-step 140000
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from titan_ledger.errors import ConfigError, LedgerError
from titan_ledger.format import records
from titan_ledger.format.arrow import signal_columns
from titan_ledger.format.reader import RunLedger
from titan_ledger.format.signal_columns import COLUMNS, plot_panels
from titan_ledger.tools.cli import ToolParser, add_dump_folder, parse_args, run_tool

# the panels, the columns they draw and their legend labels are the table's
# (format/signal_columns.py: a column's ``plot`` and ``label``)
PANELS = plot_panels()  # (y-axis label, scale, columns), top to bottom
KEYS = tuple(k for _, _, keys in PANELS for k in keys)
LABELS = {c.name: c.label for c in COLUMNS if c.label}
DPI = 100
PANEL_PX = 170  # figure height per panel (the axes get ~157 px of it: legible, no tall gaps)
HEAD_PX = 90  # the two-line title and the x axis label


def envelope(x: np.ndarray, y: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Min/max per bucket, interleaved, so peaks survive decimation."""
    if len(x) <= 2 * buckets:
        # break the line where steps are missing (skipped windows, rewinds)
        gaps = np.flatnonzero(np.diff(x) > 1) + 1
        return (np.insert(x.astype(np.float64), gaps, np.nan),
                np.insert(y.astype(np.float64), gaps, np.nan))
    edges = np.linspace(0, len(x), buckets + 1).astype(np.int64)
    yy = np.where(np.isfinite(y), y, np.nan)
    starts = edges[:-1]
    with np.errstate(all="ignore"):
        lo = np.fmin.reduceat(yy, starts)
        hi = np.fmax.reduceat(yy, starts)
    xs = x[starts]
    return np.repeat(xs, 2), np.column_stack([lo, hi]).ravel()


def plot(dump_folder: str | Path, out: str | Path, ledger_folder: str = records.LEDGER_FOLDER,
         from_step: int | None = None, to_step: int | None = None, width_px: int = 1600,
         max_norm: float | None = None) -> dict:
    """Draw the panels into ``out``; ``max_norm`` (the clip threshold) is inferred from
    the clipped steps when not given (no line if the clip never acted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    led = RunLedger(dump_folder, ledger_folder)
    if from_step is not None and to_step is not None:
        # a window (report's panels): its rows only, through the offset index, not the run
        cur, sup = led.signals_window(from_step, to_step)
        cols, windows = _columns([r for r in cur if not r.get("skipped")]), \
            [(r["step"], r.get("last_step", r["step"])) for r in cur if r.get("skipped")]
        old = _columns([r for r in sup if not r.get("skipped") and r.get("loss") is not None
                        and from_step <= r["step"] <= to_step], float_steps=True)
    else:
        cols, windows = signal_columns(led, KEYS)  # the rows checked as signals rows, the run as the launch log's
        old = None
    # a skipped window outside the range would widen the x axis (axvspan autoscales)
    windows = [(a, b) for a, b in windows
               if (to_step is None or a <= to_step) and (from_step is None or b >= from_step)]
    if max_norm is None:
        max_norm = infer_max_norm(cols)
        if max_norm is None and old is not None:  # a window where the clip never acted: the run's
            max_norm = infer_max_norm(signal_columns(led, ("grad_norm", "grad_norm_clipped"))[0])
    sel = np.ones(len(cols["step"]), dtype=bool)
    if from_step is not None:
        sel &= cols["step"] >= from_step
    if to_step is not None:
        sel &= cols["step"] <= to_step
    cols = {k: v[sel] for k, v in cols.items()}
    if not len(cols["step"]):
        rng = "" if from_step is None and to_step is None else \
            f" between --from-step {from_step} and --to-step {to_step}"
        raise LedgerError(f"{led.folder / records.SIGNALS_FILE}: no trained step{rng} to draw (the run "
                          f"died before its first step, every step was skipped, or the range is "
                          f"outside the run)")
    events = [e for e in led.spike_events()
              if (from_step is None or e["step"] >= from_step) and (to_step is None or e["step"] <= to_step)]
    spikes = sorted({int(e["step"]) for e in events})
    old = rolled_back(led, from_step, to_step) if old is None else old
    fig, axes = plt.subplots(len(PANELS), 1, sharex=True, dpi=DPI, layout="constrained",
                             figsize=(width_px / DPI, (PANEL_PX * len(PANELS) + HEAD_PX) / DPI))
    x = cols["step"]
    series: list[list] = []  # per panel: the data lines drawn (what a legend must not cover)
    for ax, (title, scale, keys) in zip(axes, PANELS):
        drawn = []
        for k in keys:
            y = cols[k]
            if not np.isfinite(y).any():
                continue
            ex, ey = envelope(x, y, width_px)
            line, = ax.plot(ex, ey, lw=0.8, label=_label(k))
            drawn.append(line)
            if k in old and np.isfinite(old[k]).any():  # rows a rollback or resume superseded
                dots, = ax.plot(old["step"], old[k], ls="none", marker="o", ms=3, alpha=0.35,
                                color=line.get_color(), label=f"{_label(k)}, rolled back")
                drawn.append(dots)
        if "grad_norm" in keys and max_norm is not None:
            ax.axhline(max_norm, color="black", lw=0.8, ls="--", label=f"max_norm {max_norm:g}")
        if scale == "log":
            ax.set_yscale("log")
        ax.set_ylabel(title, fontsize=8)
        ax.tick_params(labelsize=8)
        for a, b in windows:
            ax.axvspan(a - 0.5, b + 0.5, color="0.8", alpha=0.6, lw=0)
        for s in spikes:
            ax.axvline(s, color="red", lw=0.8, alpha=0.7)
        if len(ax.get_legend_handles_labels()[0]) > 1:
            # outside the data, right of the panel: a legend never covers a line
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0,
                      frameon=False)
        series.append(drawn)
    if spikes:
        # each spike's step as a red tick label on the top edge of the first panel: short,
        # attached to its line, outside the data; rules and ranks are in the title
        top = axes[0].secondary_xaxis("top")
        shown = thin_labels(spikes, x, width_px)
        top.set_xticks(shown, labels=[str(s) for s in shown])
        top.tick_params(axis="x", colors="red", labelsize=7, length=3, pad=1)
    axes[-1].set_xlabel("step (one global batch each)", fontsize=8)
    budget = int(width_px / 6.5)  # characters of 8-9 pt text that fit the figure's width
    head = (f"{len(x)} trained steps, {len(spikes)} spikes (red), {len(windows)} skipped windows (grey), "
            f"{len(old.get('step', ()))} rolled-back rows (faint dots)")
    name = str(dump_folder)
    if len(name) + len(head) + 2 > budget:
        name = "..." + name[-max(8, budget - len(head) - 5):]
    lines = [f"{name}: {head}"]
    if events:
        lines.append(_fit("spikes: " + "; ".join(t for _, t in spike_labels(events)), budget))
    axes[0].set_title("\n".join(lines), fontsize=8)
    fig.savefig(out, dpi=DPI)
    layout = figure_layout(fig, axes, series)
    plt.close(fig)
    return {"rows": int(len(x)), "spikes": len(spikes), "skipped_windows": len(windows), "out": str(out),
            "rolled_back_rows": int(len(old.get("step", ()))), "max_norm": max_norm, "layout": layout}


def _label(key: str) -> str:
    return LABELS.get(key, key.replace("_", " "))


def _fit(text: str, budget: int) -> str:
    return text if len(text) <= budget else text[:budget - 12].rsplit("; ", 1)[0] + "; ... (more)"


def thin_labels(spikes: list[int], x: np.ndarray, width_px: int) -> list[int]:
    """The spikes to label: at most one per label width (7 px a digit, plus a gap) of the
    x axis, so no two labels overprint; every spike's red line is drawn regardless."""
    lo, hi = float(np.nanmin(x)), float(np.nanmax(x))
    min_px = 7 * len(str(int(max(spikes)))) + 10
    gap = (hi - lo) * min_px / max(width_px, 1)
    out: list[int] = []
    for s in spikes:
        if not out or s - out[-1] >= gap:
            out.append(s)
    return out


def figure_layout(fig, axes, series: list[list]) -> dict:
    """Where things landed in the saved image, in pixels from its top-left corner
    (``[x0, y0, x1, y1]``): each panel's axes, its legend (``None`` if it has none),
    the extent of each data line it draws, and the spike labels. What the tests check
    legibility against: panel heights, legends off the data, labels inside the figure."""
    renderer = fig.canvas.get_renderer()
    height = fig.bbox.height

    def box(b) -> list[float]:
        return [round(float(v), 1) for v in (b.x0, height - b.y1, b.x1, height - b.y0)]

    def extent(line) -> list[float] | None:
        xy = np.column_stack([np.asarray(line.get_xdata(), dtype=np.float64),
                              np.asarray(line.get_ydata(), dtype=np.float64)])
        xy = xy[np.isfinite(xy).all(axis=1)]
        if not len(xy):
            return None
        px = line.get_transform().transform(xy)
        return [round(float(v), 1) for v in (px[:, 0].min(), height - px[:, 1].max(), px[:, 0].max(),
                                             height - px[:, 1].min())]

    panels = []
    for ax, drawn, (title, _, _) in zip(axes, series, PANELS):
        leg = ax.get_legend()
        lines = {ln.get_label(): extent(ln) for ln in drawn}
        panels.append({"name": title.split("\n")[0], "axes": box(ax.get_window_extent(renderer)),
                       "legend": box(leg.get_window_extent(renderer)) if leg is not None else None,
                       "lines": {k: v for k, v in lines.items() if v is not None}})
    labels = []
    for child in axes[0].child_axes:  # the spike labels' top axis
        for t in child.xaxis.get_ticklabels():
            if t.get_visible() and t.get_text():
                labels.append({"text": t.get_text(), "box": box(t.get_window_extent(renderer))})
    return {"size_px": [round(fig.bbox.width), round(height)], "panels": panels, "spike_labels": labels,
            "title": box(axes[0].title.get_window_extent(renderer))}


def rolled_back(led: RunLedger, from_step: int | None = None, to_step: int | None = None) -> dict:
    """Columns of the trained rows a rollback or a resume superseded (``{}`` if none).

    Only a ledger with more than one segment can have them; only then is the whole
    file read exactly (the fast column path reads the current history only)."""
    try:
        launches = led.launches()  # no launch log (older ledgers): read the file to know
        if launches and len(launches) < 2 and not led.rewinds():
            return {}
        rows = [r for r in led.signals.superseded if not r.get("skipped") and r.get("loss") is not None
                and (from_step is None or r["step"] >= from_step) and (to_step is None or r["step"] <= to_step)]
    except Exception:
        return {}
    return _columns(rows, float_steps=True)


def _columns(rows: list[dict], float_steps: bool = False) -> dict:
    """Numpy columns of signal rows (``step`` and :data:`KEYS`, NaN for null); ``{}`` when
    ``float_steps`` and there are none (no rolled-back rows to draw)."""
    if float_steps and not rows:
        return {}
    num = lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan  # noqa: E731
    out = {"step": np.array([r["step"] for r in rows], dtype=np.float64 if float_steps else np.int64)}
    for k in KEYS:
        out[k] = np.array([num(r.get(k)) for r in rows], dtype=np.float64)
    return out


def infer_max_norm(cols: dict) -> float | None:
    """The clip threshold: the post-clip norm of the steps the clip scaled down."""
    gn, gc = cols.get("grad_norm"), cols.get("grad_norm_clipped")
    if gn is None or gc is None:
        return None
    with np.errstate(all="ignore"):
        hit = np.isfinite(gn) & np.isfinite(gc) & (gn > gc * (1 + 1e-4))
    return float(f"{np.median(gc[hit]):.4g}") if hit.any() else None


def spike_labels(events: list[dict]) -> list[tuple[int, str]]:
    """One label per flagged step: its rules and the worst DP rank."""
    out = {}
    for e in events:
        rules = ", ".join(e.get("rules", []))
        out[int(e["step"])] = f"{e['step']}: {rules} (DP rank {e.get('loss_max_rank')})"
    return sorted(out.items())


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser.for_tool(__name__, __doc__)
    add_dump_folder(ap)
    ap.add_argument("-o", "--out", help="the image (default: signals.png in the dump folder)")
    ap.add_argument("--from-step", type=int)
    ap.add_argument("--to-step", type=int)
    ap.add_argument("--max-norm", type=float,
                    help="the clip threshold to draw (default: inferred from the clipped steps)")
    a = parse_args(ap, argv)
    return run_tool("titan_ledger.plot", lambda: _main(a))


def _main(a) -> int:
    if a.from_step is not None and a.to_step is not None and a.from_step > a.to_step:
        raise ConfigError(f"--from-step {a.from_step} is after --to-step {a.to_step}")
    if a.out is None:  # beside the run's ledger, not in whatever folder the user stands in
        a.out = str(Path(a.dump_folder) / "signals.png")
    out = Path(a.out)
    if not out.parent.is_dir():
        raise ConfigError(f"-o {a.out}: folder {out.parent} does not exist; create it first")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    fmts = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in fmts:
        raise ConfigError(f"-o {a.out}: unknown image type {out.suffix or '(none)'!r}; end the name "
                          f"in one of .{', .'.join(sorted(fmts))}")
    info = plot(a.dump_folder, a.out, a.ledger_folder, a.from_step, a.to_step, max_norm=a.max_norm)
    print(f"wrote {info['out']}: {info['rows']} steps, {info['spikes']} spikes, "
          f"{info['skipped_windows']} skipped windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
