"""``python -m titan_ledger.plot``: the signals ledger as one picture.

Design decision: read the same ledger files as every other tool (signals.jsonl,
spikes.jsonl) and draw six panels against step -- loss (average and worst DP
rank), pre-clip grad norm, param norm, max attention logit, zeros in grads, LR --
with spikes as red lines and skipped windows shaded. Long runs are decimated to
a min/max envelope per pixel column, so a 10^6-row ledger draws as fast as a
short one and a single-step spike is never averaged away.

Examples::

    python -m titan_ledger.plot outputs/debug_cpu -o signals.png
    python -m titan_ledger.plot outputs/debug_cpu -o late.png --from-step 130000 --to-step 140000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from titan_ledger.cli import ToolParser, add_dump_folder, parse_args, run_tool
from titan_ledger.reader import RunLedger

PANELS = (("loss", "loss", ("loss", "loss_max")), ("pre-clip grad norm", "log", ("grad_norm",)),
          ("param norm", "linear", ("param_norm",)), ("max attention logit", "linear", ("max_logit",)),
          ("zeros in grads", "linear", ("num_zeros",)), ("learning rate", "linear", ("lr",)))
KEYS = ("loss", "loss_max", "grad_norm", "param_norm", "max_logit", "num_zeros", "lr")


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


def plot(dump_folder: str | Path, out: str | Path, ledger_folder: str = "ledger",
         from_step: int | None = None, to_step: int | None = None, width_px: int = 1600) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    led = RunLedger(dump_folder, ledger_folder)
    cols, windows = led.signal_columns(KEYS)
    sel = np.ones(len(cols["step"]), dtype=bool)
    if from_step is not None:
        sel &= cols["step"] >= from_step
    if to_step is not None:
        sel &= cols["step"] <= to_step
    cols = {k: v[sel] for k, v in cols.items()}
    spikes = led.spike_steps()
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(width_px / 100, 2.0 * len(PANELS)), sharex=True,
                             dpi=100)
    x = cols["step"]
    for ax, (title, scale, keys) in zip(axes, PANELS):
        for k in keys:
            y = cols[k]
            if not np.isfinite(y).any():
                continue
            ex, ey = envelope(x, y, width_px)
            ax.plot(ex, ey, lw=0.8, label={"loss": "avg", "loss_max": "worst DP rank"}.get(k, k))
        if scale == "log":
            ax.set_yscale("log")
        ax.set_ylabel(title, fontsize=8)
        for a, b in windows:
            ax.axvspan(a - 0.5, b + 0.5, color="0.8", alpha=0.6, lw=0)
        for s in spikes:
            ax.axvline(s, color="red", lw=0.8, alpha=0.7)
        if len(keys) > 1:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("step")
    axes[0].set_title(f"{dump_folder}: {len(x)} trained steps, {len(spikes)} spikes (red), "
                      f"{len(windows)} skipped windows (grey)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return {"rows": int(len(x)), "spikes": len(spikes), "skipped_windows": len(windows), "out": str(out)}


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m titan_ledger.plot",
                                 description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 epilog="Examples:" + __doc__.split("Examples::", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dump_folder(ap)
    ap.add_argument("-o", "--out", default="signals.png")
    ap.add_argument("--from-step", type=int)
    ap.add_argument("--to-step", type=int)
    a = parse_args(ap, argv)
    return run_tool("titan_ledger.plot", lambda: _main(a))


def _main(a) -> int:
    info = plot(a.dump_folder, a.out, a.ledger_folder, a.from_step, a.to_step)
    print(f"wrote {info['out']}: {info['rows']} steps, {info['spikes']} spikes, "
          f"{info['skipped_windows']} skipped windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
