"""Column reads of a long signals ledger (10^6 rows in about a second) for plotting.

Design decision: the fast path uses pyarrow's multithreaded JSON reader with a
fixed schema, then applies :func:`records.supersession_masks` -- the same rule
every other reader uses -- to numpy step arrays, so no row dicts are built. A torn
line or a non-finite value stored as a string makes pyarrow fail, and a line that
is no plain row (no integer ``step``, a row before the first header) is sent back;
then the file is read exactly -- and strictly -- through :func:`records.read_ledger`
(a torn last line a warning, any other bad line an error naming ``FILE:LINE``). Used only through
:meth:`titan_ledger.format.reader.RunLedger.signal_columns`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from titan_ledger.errors import LedgerError
from titan_ledger.format import records


def read_columns(path: Path, keys: tuple[str, ...], headers: list[records.Header] | None = None
                 ) -> tuple[dict[str, np.ndarray], list[tuple[int, int]]]:
    """Columns (``step`` and ``keys``) of the current trained rows, and the current
    skipped windows ``(first, last)``; ``headers``, if given, gets the segments' headers
    (schema, run id, seq, resumed_from: whose file it is)."""
    if not Path(path).exists():
        raise LedgerError(f"{path}: no signals ledger")
    out = [] if headers is None else headers
    try:
        return _arrow(Path(path), keys, out)
    except LedgerError:
        raise
    except Exception:
        out.clear()
        return _exact(Path(path), keys, out)


def _arrow(path: Path, keys: tuple[str, ...], headers: list | None = None):
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    fields = [("schema", pa.string()), ("run_id", pa.string()), ("seq", pa.int64()),
              ("time", pa.float64()), ("resumed_from", pa.int64()), ("step", pa.int64()),
              ("last_step", pa.int64()), ("skipped", pa.bool_())] + [(k, pa.float64()) for k in keys]
    tbl = pj.read_json(str(path), parse_options=pj.ParseOptions(
        explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore"))
    arr = lambda name, fill: pc.fill_null(tbl.column(name), fill).to_numpy(zero_copy_only=False)  # noqa: E731
    schema = tbl.column("schema").to_pylist()
    is_hdr = np.array([s is not None for s in schema], dtype=bool)
    seg_of = np.cumsum(is_hdr) - 1
    if (~is_hdr & (tbl.column("step").is_null().to_numpy(zero_copy_only=False) | (seg_of < 0))).any():
        raise ValueError("a line that is no plain row: read it exactly, strictly")
    if not is_hdr.any():
        raise LedgerError(f"{path}: empty (no header): the run died before its first step")
    for s in {s for s in schema if s is not None}:
        records.check_schema(s, records.SIGNALS, path)
    step = arr("step", -1)
    hdr_idx = np.flatnonzero(is_hdr)
    seq, tm, res = arr("seq", -1), arr("time", 0.0), arr("resumed_from", -1)
    run_ids = tbl.column("run_id").to_pylist()
    if (seq[hdr_idx] < 0).any():
        raise ValueError("a header without seq: the strict reader names the line")
    if headers is not None:
        headers.extend(records.Header(schema[h], run_ids[h] or "", int(seq[h]),
                                      int(res[h]) if res[h] >= 0 else None, float(tm[h]))
                       for h in hdr_idx)
    rows = ~is_hdr & (seg_of >= 0)
    entries, positions = [], []
    for n, h in enumerate(hdr_idx):
        idx = np.flatnonzero(rows & (seg_of == n))
        key = (int(seq[h]), n)  # records.order_key
        entries.append((key, run_ids[h] or "", int(res[h]) if res[h] >= 0 else None, step[idx]))
        positions.append(idx)
    keep = np.zeros(len(step), dtype=bool)
    for idx, mask in zip(positions, records.supersession_masks(entries)):
        keep[idx[mask]] = True
    skipped = arr("skipped", False).astype(bool)
    last = arr("last_step", -1)
    win_idx = np.flatnonzero(keep & skipped)
    windows = [(int(step[i]), int(last[i]) if last[i] >= 0 else int(step[i])) for i in win_idx]
    trained = keep & ~skipped
    cols = {"step": step[trained]}
    for k in keys:
        cols[k] = tbl.column(k).to_numpy(zero_copy_only=False).astype(np.float64)[trained]
    return cols, windows


def _num(v) -> float:
    if v is None:
        return math.nan
    return float(v)


def _exact(path: Path, keys: tuple[str, ...], headers: list | None = None):
    led = records.read_ledger(path, records.SIGNALS)
    if not led.segments:
        raise LedgerError(f"{path}: empty (no header): the run died before its first step")
    if headers is not None:
        headers.extend(records.headers(led.segments))
    history = led.history
    windows = [(r["step"], r.get("last_step", r["step"])) for r in history if r.get("skipped")]
    trained = [r for r in history if not r.get("skipped")]
    cols = {"step": np.fromiter((r["step"] for r in trained), dtype=np.int64, count=len(trained))}
    for k in keys:
        cols[k] = np.array([_num(r.get(k)) for r in trained], dtype=np.float64)
    return cols, windows
