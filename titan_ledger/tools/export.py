"""``python -m titan_ledger.export``: a run's signals (and one step's data rows) as Parquet, CSV or Arrow files.

Design decision: no reader of its own. The tables are
:func:`titan_ledger.format.arrow.signals_table` (the current history of
``signals.jsonl``, every column typed, read by the fast column path: seconds at 10^5
steps) and, with ``--step``, :func:`titan_ledger.format.arrow.data_table`; this tool only
writes them with pyarrow's writers (installed with ``datasets``: nothing new to
install). Every table is read before anything is written, and each file is written
under a temporary name and renamed into place, so a failed export leaves no file and
no partial one. Files: ``OUT/signals.<ext>`` and ``OUT/data_step<S>.<ext>``
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
from titan_ledger.format.arrow import data_table, signals_table
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools.cli import ToolParser, add_dump_folder, parse_args, run_tool

#: ``--format`` -> file name extension
FORMATS = {"parquet": "parquet", "csv": "csv", "arrow": "arrow"}


def write(table, path: Path, fmt: str) -> int:
    """Write ``table`` to ``path`` in ``fmt`` (via ``<path>.tmp``, renamed into place);
    returns the file's size in bytes."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
        elif fmt == "csv":
            import pyarrow.csv as pc

            pc.write_csv(table, tmp)
        else:
            import pyarrow as pa

            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def export(dump_folder: str | os.PathLike, out: str | os.PathLike, fmt: str = "parquet",
           step: int | None = None, ledger_folder: str = records.LEDGER_FOLDER) -> list[dict]:
    """Write the signals table (and ``step``'s data table) into the folder ``out``
    (created if missing); returns one ``{"path", "rows", "columns", "bytes", "read_s",
    "write_s"}`` per file written."""
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
    out.mkdir(parents=True, exist_ok=True)
    done = []
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
    a = parse_args(ap, argv)
    return run_tool("titan_ledger.export", lambda: _main(a))


def _main(a) -> int:
    for f in export(a.dump_folder, a.out, a.format, a.step, a.ledger_folder):
        print(f"wrote {f['path']}: {f['rows']} rows x {f['columns']} columns, {_size(f['bytes'])} "
              f"({f['bytes']} bytes), read {f['read_s']:.2f} s, written {f['write_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
