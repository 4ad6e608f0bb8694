"""The fast read of a long signals ledger (10^6 rows in about a second): its current history as one typed table.

Design decision: one reader, :func:`read_table`, gives the current history of
``signals.jsonl`` (superseded rows left out, skipped windows as rows with
``last_step``) as a ``pyarrow.Table`` whose every column has the type
:mod:`~titan_ledger.format.signal_columns` declares (:data:`KINDS`: ints int64,
floats float64, bools, strings). Its views: :func:`read_columns` (numpy columns of the trained rows and
the skipped windows, :meth:`titan_ledger.format.reader.RunLedger.signal_columns`) and
:func:`titan_ledger.format.arrow.signals_table` (the table itself: plot, export, pandas,
polars, DuckDB). The fast path uses pyarrow's multithreaded JSON reader with a fixed
schema, then applies :func:`records.supersession_masks` -- the same rule every other
reader uses -- to numpy step arrays, so no row dicts are built. A non-finite value,
stored as the string ``"nan"``, ``"inf"`` or ``"-inf"``, makes pyarrow fail; the file
is then handed to it again with those strings as the literals it reads (``NaN``,
``Infinity``, ``-Infinity``: :func:`with_literals`), so a diverged run stays on the
fast path and a clean one is never searched. A torn line or any other value pyarrow
will not take makes it fail, and a line that is no plain row (no integer ``step``, a
row before the first header) is sent back; then the file is read exactly -- and
strictly -- through :func:`records.read_ledger` (a torn last line a warning, any other
bad line an error naming ``FILE:LINE``), and the table built from its rows.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from titan_ledger.errors import LedgerCorrupt, LedgerError
from titan_ledger.format import records, signal_columns

if TYPE_CHECKING:
    import pyarrow as pa

#: each column's kind (``int``, ``float``, ``bool``, ``str``), as the table declares it
#: (:data:`signal_columns.COLUMNS`): :data:`records.SIGNAL_KEYS`, then the keys only a
#: skipped window has (``last_step``, ``skip_lr``); the per-layer norms (a dict per row,
#: :data:`records.PER_LAYER_KEY`) are no column: ``RunLedger.signal_rows()`` has them
KINDS: dict[str, str] = {k: signal_columns.BY_NAME[k].kind
                         for k in (*signal_columns.SIGNAL_KEYS, *signal_columns.WINDOW_KEYS)}
#: every column of the table, in order
TABLE_KEYS: tuple[str, ...] = tuple(KINDS)
#: the columns the reader itself needs (supersession, windows)
_OWN = ("step", "skipped", "last_step")

# JSON has no NaN/inf: records stores them as strings; pyarrow's parser reads the literals
_LITERALS = {b'"nan"': b"NaN", b'"inf"': b"Infinity", b'"-inf"': b"-Infinity"}


@functools.cache
def types() -> dict[str, pa.DataType]:
    """Each column's pyarrow type (pyarrow is imported only by a read)."""
    import pyarrow as pa

    by_kind = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}
    return {k: by_kind[kind] for k, kind in KINDS.items()}


def check_keys(keys: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """The columns asked for (all of :data:`TABLE_KEYS` for None), ``step`` first;
    LedgerError naming an unknown one."""
    if keys is None:
        return TABLE_KEYS
    unknown = [k for k in keys if k not in KINDS]
    if unknown:
        raise LedgerError(f"keys: no signal column {', '.join(map(repr, unknown))}; the columns are "
                          f"{', '.join(TABLE_KEYS)}")
    return ("step", *dict.fromkeys(k for k in keys if k != "step"))


def read_table(path: Path, keys: tuple[str, ...] | None = None,
               headers: list[records.Header] | None = None) -> pa.Table:
    """The current history (trained rows and skipped windows, in history order) as a
    table of ``step`` and ``keys`` (default: :data:`TABLE_KEYS`); ``headers``, if given,
    gets the segments' headers (schema, run id, seq, resumed_from: whose file it is)."""
    want = check_keys(keys)
    if not Path(path).exists():
        raise LedgerError(f"{path}: no signals ledger")
    out = [] if headers is None else headers
    read = tuple(dict.fromkeys((*want, *_OWN)))
    try:
        tbl = _arrow_table(Path(path), read, out)
    except LedgerError:
        raise
    except Exception:
        out.clear()
        tbl = _exact_table(Path(path), read, out)
    return tbl.select(list(want))


def read_columns(path: Path, keys: tuple[str, ...], headers: list[records.Header] | None = None
                 ) -> tuple[dict[str, np.ndarray], list[tuple[int, int]]]:
    """Columns (``step`` and ``keys``, float64 with NaN for null) of the current trained
    rows, and the current skipped windows ``(first, last)`` (:func:`trained_columns`)."""
    return trained_columns(read_table(path, (*keys, *_OWN), headers), keys)


def trained_columns(table: pa.Table, keys: tuple[str, ...]) -> tuple[dict[str, np.ndarray], list[tuple[int, int]]]:
    """Of a :func:`read_table` table holding ``step``, ``skipped``, ``last_step`` and
    ``keys``: numpy columns of its trained rows (``step`` int64, each key float64, NaN for
    null) and its skipped windows ``(first, last)``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    step = table.column("step").to_numpy()
    skipped = pc.fill_null(table.column("skipped"), False).to_numpy(zero_copy_only=False).astype(bool)
    last = pc.fill_null(table.column("last_step"), -1).to_numpy()
    win_idx = np.flatnonzero(skipped)
    windows = [(int(step[i]), int(last[i]) if last[i] >= 0 else int(step[i])) for i in win_idx]
    trained = ~skipped
    cols = {"step": step[trained]}
    for k in keys:
        col = pc.cast(table.column(k), pa.float64())
        cols[k] = col.to_numpy(zero_copy_only=False).astype(np.float64)[trained]
    return cols, windows


def _arrow_table(path: Path, keys: tuple[str, ...], headers: list | None = None) -> pa.Table:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    typed = types()
    head = [("schema", pa.string()), ("run_id", pa.string()), ("seq", pa.int64()), ("time", pa.float64()),
            ("resumed_from", pa.int64())]
    options = pj.ParseOptions(explicit_schema=pa.schema(head + [(k, typed[k]) for k in keys]),
                              unexpected_field_behavior="ignore")
    try:
        tbl = pj.read_json(str(path), parse_options=options)
    except pa.ArrowInvalid:  # a non-finite value (or a torn line: then again, and the exact read)
        data = with_literals(path.read_bytes())
        if data is None:
            raise
        tbl = pj.read_json(pa.BufferReader(data), parse_options=options)
        del data
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
    # the history: each segment's current rows, segments in records.order_key order
    order = sorted(range(len(entries)), key=lambda i: entries[i][0])
    masks = records.supersession_masks(entries)
    keep = np.concatenate([positions[i][masks[i]] for i in order]) if order else np.zeros(0, np.int64)
    return tbl.select(list(keys)).take(pa.array(keep, type=pa.int64()))


def with_literals(data: bytes) -> bytes | None:
    """``data`` with every ``"nan"``, ``"inf"``, ``"-inf"`` string as the JSON literal
    pyarrow reads (``NaN``, ``Infinity``, ``-Infinity``); None if it has none. A string
    that is no value (a key, a list item) becomes a literal too: then pyarrow fails, and
    the exact read decides."""
    spots = []
    for tail in (b'nan"', b'inf"'):  # two scans of the file, not three
        i = data.find(tail)
        while i >= 0:
            for text in (data[i - 1:i + 4], data[i - 2:i + 4]):
                if text in _LITERALS:
                    spots.append((i + 4 - len(text), text))
                    break
            i = data.find(tail, i + 4)
    if not spots:
        return None
    view, parts, pos = memoryview(data), [], 0
    for i, text in sorted(spots):
        parts += [view[pos:i], _LITERALS[text]]
        pos = i + len(text)
    parts.append(view[pos:])
    return b"".join(parts)


def _exact_table(path: Path, keys: tuple[str, ...], headers: list | None = None) -> pa.Table:
    import pyarrow as pa

    led = records.read_ledger(path, records.SIGNALS)
    if not led.segments:
        raise LedgerError(f"{path}: empty (no header): the run died before its first step")
    if headers is not None:
        headers.extend(records.headers(led.segments))
    history = led.history
    typed = types()
    cols = {}
    for k in keys:
        values = [r.get(k) for r in history]
        try:
            cols[k] = pa.array(values, type=typed[k])
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            bad = next((r for r in history if not _fits(r.get(k), KINDS[k])), None)
            what = f"step {bad['step']}: {k!r} is {bad.get(k)!r}" if bad else f"column {k!r} holds a value"
            raise LedgerCorrupt(f"{path}: {what}, not a {KINDS[k]}: not a signals row of this titan_ledger "
                                f"(was the file edited or written by another tool?)") from None
    return pa.table(cols)


def _fits(v, kind: str) -> bool:
    if v is None:
        return True
    if kind == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
    return isinstance(v, {"bool": bool, "str": str}[kind])
