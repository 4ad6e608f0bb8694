"""A run's ledgers as pyarrow tables: the way into pandas, polars and DuckDB.

Design decision: no second reader. :func:`signals_table` is the fast column read of
:mod:`titan_ledger.format.columns` (pyarrow's JSON reader, the one supersession rule of
:func:`records.supersession_masks`, the exact strict reader when pyarrow will not do),
checked the way :class:`~titan_ledger.format.reader.RunLedger` checks the file (its
run is the launch log's, its rows are signals rows); row for row and value for value
it is ``RunLedger.signal_rows()``, every column typed as :class:`records.SignalRow`
declares it. :func:`data_table` flattens what ``RunLedger.data.at(step, r)`` answers for
each DP rank, through ``DataLedger``'s public methods only. pyarrow comes with
``datasets`` (a dependency already); pandas, polars and DuckDB read the tables without
copying (``table.to_pandas()``, ``pl.from_arrow(table)``, DuckDB's replacement scans),
and ``python -m titan_ledger.export`` writes them as Parquet, CSV or Arrow files.

Example::

    from titan_ledger.format.arrow import data_table, signals_table

    df = signals_table("outputs/debug_cpu").to_pandas()   # one row per step or skipped window
    rows = data_table("outputs/debug_cpu", 8)            # step 8: one row per (DP rank, row, segment)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from titan_ledger.errors import LedgerCorrupt, LedgerError
from titan_ledger.format import columns, records
from titan_ledger.format.reader import SIGNAL_ROW_KEYS, RunLedger, same_run

if TYPE_CHECKING:
    import pyarrow as pa

#: the columns of :func:`data_table`, and their kinds
DATA_COLUMNS = {"step": "int", "dp_rank": "int", "row": "int", "segment": "int", "sample_id": "int",
                "source": "str", "doc": "int", "start": "int", "end": "int", "skipped": "bool"}


def ledger_of(ledger: RunLedger | str | os.PathLike) -> RunLedger:
    """A :class:`RunLedger` as given, or of a dump folder or its ledger folder."""
    return ledger if isinstance(ledger, RunLedger) else RunLedger.at(ledger)


def signals_table(ledger: RunLedger | str | os.PathLike, keys: tuple[str, ...] | list[str] | None = None
                  ) -> pa.Table:
    """The current history of ``signals.jsonl`` (superseded rows left out; a skipped
    window is one row, ``step`` its first step, with ``last_step``) as a table of ``step``
    and ``keys`` (default: every column, :data:`columns.TABLE_KEYS`): ints int64, floats
    float64 (non-finite values as floats), bools, strings; null where a row has none.

    ``ledger``: a :class:`RunLedger`, a dump folder or a ledger folder."""
    led = ledger_of(ledger)
    path = led.folder / records.SIGNALS_FILE
    if not path.exists():
        raise LedgerError(f"{path}: no signals ledger; was the run trained with titan_ledger (and "
                          f"--ledger.signals on)?")
    headers: list[records.Header] = []
    table = columns.read_table(path, keys, headers)
    same_run(path, [records.FileSegment(h) for h in headers], led.launch_ids)
    first = next(records.rows_after(path, 0), None)
    lacking = [k for k in SIGNAL_ROW_KEYS if first is not None and k not in first]
    if lacking:  # the columns would be all null: an empty table that looks like a run
        raise LedgerCorrupt(f"{path}: step {first['step']} has no {', '.join(lacking)}: not a signals row "
                            f"of this titan_ledger (was the file edited or written by another tool?)")
    return table


def signal_columns(ledger: RunLedger | str | os.PathLike, keys: tuple[str, ...]
                   ) -> tuple[dict[str, np.ndarray], list[tuple[int, int]]]:
    """:func:`signals_table` as numpy columns of the trained rows (``step`` int64, each
    of ``keys`` float64, NaN for null) and the skipped windows ``(first, last)``: what
    plot draws (:func:`columns.trained_columns`)."""
    return columns.trained_columns(signals_table(ledger, (*keys, "skipped", "last_step")), keys)


def data_table(ledger: RunLedger | str | os.PathLike, step: int) -> pa.Table:
    """What each DP rank trained on (or consumed, in a skipped window) at ``step``: one
    row per (DP rank, row of its batch, segment of that row), with ``step``, ``dp_rank``,
    ``row``, ``segment``, ``sample_id``, ``source``, ``doc``, ``start``, ``end`` (token
    offsets into the document) and ``skipped``. LedgerError when no DP rank has the step,
    or when a DP rank of the run has no row for it (never a partial step as the whole)."""
    import pyarrow as pa

    led = ledger_of(ledger)
    data = led.data
    ranks = data.ranks_at(step)
    if not ranks:
        raise LedgerError(f"{led.folder}: no DP rank has a data-ledger row for step {step}")
    lost = data.missing_ranks(step)
    if lost:
        names = ", ".join(str(led.folder / records.data_file(r)) for r in lost)
        raise LedgerError(f"{names}: no row for step {step}, but the run had {len(lost) + len(ranks)} DP "
                          f"ranks (the file is missing, empty or cut); restore it")
    out: dict[str, list] = {k: [] for k in DATA_COLUMNS}
    for r in ranks:
        got = data.at(step, r)
        for i, tag in enumerate(got.tags):
            for j, seg in enumerate(tag.segments):
                for k, v in zip(DATA_COLUMNS, (step, r, i, j, tag.sample_id, tag.source, seg.doc, seg.start,
                                               seg.end, got.skipped)):
                    out[k].append(v)
    typed = {"int": pa.int64(), "str": pa.string(), "bool": pa.bool_()}
    return pa.table({k: pa.array(v, type=typed[DATA_COLUMNS[k]]) for k, v in out.items()})
