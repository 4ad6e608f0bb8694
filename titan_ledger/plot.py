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
import json
import math
import sys
from pathlib import Path

import numpy as np

from titan_ledger import records

PANELS = (("loss", "loss", ("loss", "loss_max")), ("pre-clip grad norm", "log", ("grad_norm",)),
          ("param norm", "linear", ("param_norm",)), ("max attention logit", "linear", ("max_logit",)),
          ("zeros in grads", "linear", ("num_zeros",)), ("learning rate", "linear", ("lr",)))
KEYS = ("loss", "loss_max", "grad_norm", "param_norm", "max_logit", "num_zeros", "lr")


def read_columns(path: Path) -> tuple[dict[str, np.ndarray], list[tuple[int, int]]]:
    """Columns of the current history, superseded rows dropped.

    Fast path: pyarrow's multithreaded JSON reader with a fixed schema (a 10^6-row
    ledger in about a second). A torn line or a non-finite value stored as a
    string makes it fail; then the rows are parsed in Python.
    """
    try:
        return _read_columns_arrow(path)
    except Exception:  # noqa: BLE001 - any arrow failure: the exact (slower) path
        return _read_columns_py(path)


def _read_columns_arrow(path: Path):
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    fields = [("schema", pa.string()), ("resumed_from", pa.int64()), ("step", pa.int64()),
              ("last_step", pa.int64()), ("skipped", pa.bool_())] + [(k, pa.float64()) for k in KEYS]
    tbl = pj.read_json(str(path), parse_options=pj.ParseOptions(
        explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore"))
    is_hdr = tbl.column("schema").is_valid().to_numpy(zero_copy_only=False)
    step = pc.fill_null(tbl.column("step"), -1).to_numpy(zero_copy_only=False)
    keep = ~is_hdr
    resumed = pc.fill_null(tbl.column("resumed_from"), -1).to_numpy(zero_copy_only=False)
    for h in np.flatnonzero(is_hdr):
        if resumed[h] >= 0:
            keep[:h] &= ~(step[:h] > resumed[h])
    skipped = pc.fill_null(tbl.column("skipped"), False).to_numpy(zero_copy_only=False).astype(bool)
    last = pc.fill_null(tbl.column("last_step"), -1).to_numpy(zero_copy_only=False)
    win_idx = np.flatnonzero(keep & skipped)
    windows = [(int(step[i]), int(last[i]) if last[i] >= 0 else int(step[i])) for i in win_idx]
    rows = keep & ~skipped
    cols = {"step": step[rows]}
    for k in KEYS:
        cols[k] = tbl.column(k).to_numpy(zero_copy_only=False).astype(np.float64)[rows]
    return cols, windows


def _read_columns_py(path: Path):
    lines = Path(path).read_bytes().splitlines()
    good = [ln for ln in lines if ln.startswith(b"{") and ln.endswith(b"}")]
    try:
        parsed = json.loads(b"[" + b",".join(good) + b"]")
    except json.JSONDecodeError:  # a corrupt line in the middle: parse line by line, skip it
        parsed = []
        for ln in good:
            try:
                parsed.append(json.loads(ln))
            except json.JSONDecodeError:
                pass
    history: list[dict] = []
    for obj in parsed:
        if "schema" in obj:
            resumed = obj.get("resumed_from")
            if resumed is not None and history and history[-1]["step"] > resumed:
                history = [r for r in history if r["step"] <= resumed]
        else:
            history.append(obj)
    windows = [(r["step"], r.get("last_step", r["step"])) for r in history if r.get("skipped")]
    trained = [r for r in history if not r.get("skipped")]
    cols = {"step": np.fromiter((r["step"] for r in trained), dtype=np.int64, count=len(trained))}
    for k in KEYS:
        cols[k] = np.array([_num(r.get(k)) for r in trained], dtype=np.float64)
    return cols, windows


def _num(v) -> float:
    if v is None:
        return math.nan
    if isinstance(v, str):
        return float(v)
    return float(v)


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

    folder = Path(dump_folder) / ledger_folder
    cols, windows = read_columns(folder / "signals.jsonl")
    sel = np.ones(len(cols["step"]), dtype=bool)
    if from_step is not None:
        sel &= cols["step"] >= from_step
    if to_step is not None:
        sel &= cols["step"] <= to_step
    cols = {k: v[sel] for k, v in cols.items()}
    spikes = []
    if (folder / "spikes.jsonl").exists():
        spikes = sorted({r["step"] for r in records.read_ledger(folder / "spikes.jsonl").history})
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
    ap = argparse.ArgumentParser(prog="python -m titan_ledger.plot",
                                 description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 epilog="Examples:" + __doc__.split("Examples::", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump_folder")
    ap.add_argument("-o", "--out", default="signals.png")
    ap.add_argument("--from-step", type=int)
    ap.add_argument("--to-step", type=int)
    ap.add_argument("--ledger-folder", default="ledger")
    a = ap.parse_args(argv)
    try:
        info = plot(a.dump_folder, a.out, a.ledger_folder, a.from_step, a.to_step)
    except FileNotFoundError as e:
        print(f"titan_ledger.plot: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {info['out']}: {info['rows']} steps, {info['spikes']} spikes, "
          f"{info['skipped_windows']} skipped windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
