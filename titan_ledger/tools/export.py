"""``python -m titan_ledger.export``: a run's signals (and one step's data rows) as Parquet, CSV or Arrow files.

Design decision: no reader of its own. The tables are
:func:`titan_ledger.format.arrow.signals_table` (the current history of
``signals.jsonl``, every column typed, read by the fast column path: seconds at 10^5
steps) and, with ``--step``, :func:`titan_ledger.format.arrow.data_table`; this tool only
writes them with pyarrow's writers (installed with ``datasets``: nothing new to
install). Every table is read before anything is written, and each file is written
under a temporary name and renamed into place, so a failed export leaves no file and
no partial one. Files: ``OUT/signals.<ext>``, ``OUT/spikes.<ext>``, ``OUT/episodes.<ext>`` (the run's
episodes: ``format.answers.episodes``) and ``OUT/data_step<S>.<ext>``
(``parquet``, ``csv``, ``arrow``: the Arrow IPC file format, Feather v2). Read them with
``pd.read_parquet``, ``pl.read_parquet`` or DuckDB's ``SELECT ... FROM
'OUT/signals.parquet'`` (docs/tools.md).

Examples::

    python -m titan_ledger.export outputs/debug_cpu -o export
    python -m titan_ledger.export outputs/debug_cpu -o export --step 8
    python -m titan_ledger.export outputs/debug_cpu -o export --format csv
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from titan_ledger.errors import ConfigError, LedgerError
from titan_ledger.format import records
from titan_ledger.format.arrow import (
    data_table,
    data_tables,
    documents_tables,
    episodes_table,
    ranks_tables,
    signals_table,
    spikes_table,
)
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools.cli import ToolParser, add_dump_folder, parse_args, run_tool

#: ``--format`` -> file name extension
FORMATS = {"parquet": "parquet", "csv": "csv", "arrow": "arrow"}


def write(table, path: Path, fmt: str) -> int:
    """Write ``table`` to ``path`` in ``fmt`` (via ``<path>.tmp``, renamed into place);
    returns the file's size in bytes."""
    return write_batches(iter([table]), path, fmt)[1]


def _flat(table, fmt: str):
    """CSV holds no lists: a list column becomes its items joined by ``;``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if fmt != "csv":
        return table
    for i, f in enumerate(table.schema):
        if pa.types.is_list(f.type):
            joined = pc.binary_join(table.column(i), ";")
            table = table.set_column(i, f.name, joined)
    return table


def write_batches(tables, path: Path, fmt: str) -> tuple[int, int]:
    """Write the tables (one schema) one after another into ``path`` in ``fmt`` -- memory
    bounded by one table -- via ``<path>.tmp``, renamed into place when complete; returns
    (rows, bytes). A failure leaves no file."""
    tmp = path.with_name(path.name + ".tmp")
    writer = None
    rows = 0
    try:
        for table in tables:
            table = _flat(table, fmt)
            if writer is None:
                if fmt == "parquet":
                    import pyarrow.parquet as pq

                    writer = pq.ParquetWriter(tmp, table.schema)
                elif fmt == "csv":
                    import pyarrow.csv as pcsv

                    writer = pcsv.CSVWriter(str(tmp), table.schema)
                else:
                    import pyarrow as pa

                    writer = pa.ipc.new_file(pa.OSFile(str(tmp), "wb"), table.schema)
            writer.write_table(table)
            rows += table.num_rows
        if writer is None:
            raise LedgerError(f"{path.name}: nothing to write")
        writer.close()
        writer = None
        os.replace(tmp, path)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    return rows, path.stat().st_size


def parse_steps(spec: str) -> tuple[int, int]:
    """``--steps A:B`` -> (A, B), inclusive, 1 <= A <= B."""
    a, sep, b = str(spec).partition(":")
    try:
        first, last = int(a), int(b)
    except ValueError:
        first = last = 0
    if not sep or not 1 <= first <= last:
        raise ConfigError(f"--steps {spec}: give A:B, the first and last step (1 <= A <= B), e.g. 1000:2000")
    return first, last


def export(dump_folder: str | os.PathLike, out: str | os.PathLike, fmt: str = "parquet",
           step: int | None = None, ledger_folder: str = records.LEDGER_FOLDER,
           steps: tuple[int, int] | None = None) -> list[dict]:
    """Write the signals, spikes and episodes tables (and ``step``'s data table; with ``steps``
    (A, B), the per-rank losses, the per-document losses and the data rows of steps A..B,
    streamed) into the folder ``out`` (created if missing); returns one ``{"path", "rows",
    "columns", "bytes", "read_s", "write_s"}`` per file written."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: give one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"-o {out}: a file, not a folder; give a folder (it is created if missing)")
    if step is not None and step < 1:
        raise ConfigError(f"--step {step}: steps start at 1")
    led = RunLedger(dump_folder, ledger_folder)
    tables = []
    t0 = time.perf_counter()
    signals = signals_table(led)
    tables.append(("signals", signals, time.perf_counter() - t0))
    if step is not None:
        t0 = time.perf_counter()
        if not led.data.ranks_at(step):
            steps = signals.column("step")
            held = f"; the signals ledger holds steps {steps[0]}-{steps[-1]}" if len(steps) else ""
            raise LedgerError(f"--step {step}: no DP rank has a data-ledger row for it in {led.folder}"
                              f"{held}; give a step the run consumed")
        tables.append((f"data_step{step}", data_table(led, step), time.perf_counter() - t0))
    t0 = time.perf_counter()
    tables.append(("spikes", spikes_table(led), time.perf_counter() - t0))
    t0 = time.perf_counter()
    tables.append(("episodes", episodes_table(led), time.perf_counter() - t0))
    out.mkdir(parents=True, exist_ok=True)
    done = []
    if steps is not None:
        first, last = steps
        for name, make in (("ranks", ranks_tables), ("documents", documents_tables), ("data", data_tables)):
            path = out / f"{name}_steps{first}-{last}.{FORMATS[fmt]}"
            t0 = time.perf_counter()
            try:
                rows, size = write_batches(make(led, first, last), path, fmt)
            except LedgerError as e:
                if "nothing to write" not in str(e):
                    raise
                continue  # (no rows of that kind in the range: no file)
            done.append({"path": str(path), "rows": rows, "columns": None, "bytes": size, "read_s": 0.0,
                         "write_s": time.perf_counter() - t0})
    for name, table, read_s in tables:
        path = out / f"{name}.{FORMATS[fmt]}"
        t0 = time.perf_counter()
        size = write(table, path, fmt)
        done.append({"path": str(path), "rows": table.num_rows, "columns": table.num_columns, "bytes": size,
                     "read_s": read_s, "write_s": time.perf_counter() - t0})
    return done


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 1024:.1f} KB" if n >= 1024 else f"{n} B"


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser.for_tool(__name__, __doc__)
    add_dump_folder(ap)
    ap.add_argument("-o", "--out", required=True, metavar="OUT",
                    help="folder to write into (created if missing): OUT/signals.<ext>, OUT/data_step<S>.<ext>")
    ap.add_argument("--format", default="parquet", choices=sorted(FORMATS),
                    help="file format (default parquet; arrow: the Arrow IPC file format, Feather v2)")
    ap.add_argument("--step", type=int, metavar="S",
                    help="also write step S's data rows: one row per (DP rank, row, segment)")
    ap.add_argument("--steps", metavar="A:B",
                    help="also write steps A..B's per-rank losses (ranks_stepsA-B), per-document losses "
                         "(documents_stepsA-B) and data rows (data_stepsA-B), streamed")
    a = parse_args(ap, argv)
    return run_tool("titan_ledger.export", lambda: _main(a))


def _main(a) -> int:
    steps = parse_steps(a.steps) if a.steps else None
    for f in export(a.dump_folder, a.out, a.format, a.step, a.ledger_folder, steps=steps):
        cols = f" x {f['columns']} columns" if f["columns"] is not None else ""
        print(f"wrote {f['path']}: {f['rows']} rows{cols}, {_size(f['bytes'])} "
              f"({f['bytes']} bytes), read {f['read_s']:.2f} s, written {f['write_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
