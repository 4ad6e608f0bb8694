"""``python -m titan_ledger.export``: the files hold the tables (pandas reads them back), what
was written is printed, and bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pytest

from titan_ledger.export import main
from titan_ledger.format.arrow import data_table, signals_table
from titan_ledger.format.columns import TABLE_KEYS

from ..bad_input_ledgers import make_run, tear


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path / "run", steps=12, dp=2, mbs=2, spike_at=9, checkpoints=(), skip=(4, 5))


def _rows(table) -> list[dict]:
    return [{k: "NaN" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
            for r in table.to_pylist()]


@pytest.mark.parametrize("fmt", ["parquet", "csv", "arrow"])
def test_export_writes_the_tables_and_says_so(run, tmp_path, capsys, fmt):
    out = tmp_path / "out" / "nested"
    assert main([str(run), "-o", str(out), "--format", fmt, "--step", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    # every column of the signal-column table (format/signal_columns.py)
    assert lines[0].startswith(f"wrote {out}/signals.{fmt}: 11 rows x {len(TABLE_KEYS)} columns, ")
    assert lines[1].startswith(f"wrote {out}/data_step7.{fmt}: 4 rows x 10 columns, ")
    assert lines[2].startswith(f"wrote {out}/spikes.{fmt}: 1 rows x 41 columns, ")
    assert lines[3].startswith(f"wrote {out}/episodes.{fmt}: 1 rows x 14 columns, ")  # the spike at 9: one burst
    assert all(" bytes), read " in ln and ln.endswith(" s") for ln in lines)
    assert sorted(p.name for p in out.iterdir()) == [f"data_step7.{fmt}", f"episodes.{fmt}", f"signals.{fmt}",
                                                      f"spikes.{fmt}"]
    want, data = signals_table(run), data_table(run, 7)
    if fmt == "parquet":
        import pandas as pd
        import pyarrow.parquet as pq

        assert pq.read_table(out / "signals.parquet").equals(want)
        assert pq.read_table(out / "data_step7.parquet").equals(data)
        df = pd.read_parquet(out / "signals.parquet")
        assert list(df["step"]) == [r["step"] for r in want.to_pylist()] and df["step"].dtype == "int64"
    elif fmt == "arrow":
        with pa.OSFile(str(out / "signals.arrow")) as f:
            assert _rows(pa.ipc.open_file(f).read_all()) == _rows(want)
    else:
        import pyarrow.csv as pc

        got = pc.read_csv(out / "signals.csv", convert_options=pc.ConvertOptions(
            column_types=want.schema, strings_can_be_null=True))  # CSV: an empty string is null
        assert _rows(got) == _rows(want)


def test_export_without_step_writes_signals_and_spikes_and_warns_on_a_torn_line(run, tmp_path, capsys):
    tear(run / "ledger" / "signals.jsonl")
    assert main(["--dump-folder", str(run), "-o", str(tmp_path / "o")]) == 0
    out, err = capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["episodes.parquet", "signals.parquet",
                                                                   "spikes.parquet"]
    assert "signals.parquet: 11 rows" in out
    assert err.startswith("titan_ledger.export: warning: ") and "torn last line skipped" in err


@pytest.mark.parametrize("argv,must", [
    (["{t}/nope", "-o", "{t}/o"], ["nope", "no such dump folder"]),
    (["{t}/run", "-o", "{t}/o", "--ledger-folder", "x"], ["x/signals.jsonl", "no signals ledger"]),
    (["{t}/run", "-o", "{t}/file"], ["-o", "a file, not a folder"]),
    (["{t}/run", "-o", "{t}/o", "--step", "0"], ["--step 0", "steps start at 1"]),
    (["{t}/run", "-o", "{t}/o", "--step", "99"], ["--step 99", "no DP rank", "steps 1-12"]),
    (["{t}/run", "-o", "{t}/o", "--format", "xml"], ["--format", "xml"]),
    (["{t}/run"], ["-o"]),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(run, tmp_path, capsys, argv, must):
    (tmp_path / "file").write_text("x")
    files = lambda: sorted(p for p in tmp_path.rglob("*") if p.suffix != ".idx")  # noqa: E731  (.idx: a reader's cache)
    before = files()
    try:
        code = main([a.replace("{t}", str(tmp_path)) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("titan_ledger.export: error: "), err
    assert all(m in err for m in must), err
    assert files() == before


def _incident(run):
    """The run's spike at 9 proven bad data (documents quarantined), a note at 3 proven
    outlier, an Adam flag at 11 observed; every global rank's loss; the data rows' documents."""
    from titan_ledger.format import records

    led = run / "ledger"
    hdr = {"schema": records.SPIKES.id, "run_id": "run-a", "seq": 1, "resumed_from": 0, "time": 1.0}
    e = records.RecordWriter(led / records.SPIKES_FILE, hdr)
    e.write({"step": 3, "notes": ["doc_low"], "proof": {"verdict": "outlier", "applied": "original"}})
    e.write({"step": 9, "rules": ["ratio"], "loss": 3.6, "grad_norm": 10.0, "action": "proof: bad_data",
             "proof": {"verdict": "bad_data", "applied": "masked", "policy": "act", "seconds": 0.5,
                       "documents": [["stdlib_docs", 33], ["stdlib_docs", 34]],
                       "executions": [{"variant": "original"}, {"variant": "same"}, {"variant": "masked"}]}})
    e.write({"step": 11, "rules": ["grad_jump"], "action": "none",
             "proof": {"verdict": "optimizer_state", "applied": "original", "optimizer": {"amplification": 9.5}}})
    e.write({"step": 12, "breaker": "paused", "actions": [9, 10], "limit": 1, "window": 3})
    e.close()
    for r in range(2):  # rank 1 worst at every step but 10
        w = records.RecordWriter(led / f"rank{r}.jsonl", {**hdr, "schema": records.RANK.id})
        for step in range(1, 13):
            w.write({"step": step, "loss": 3.0 + (0.5 if (r == 1) != (step == 10) else 0.0), "tokens": 512})
        w.close()
    return run


def test_the_documented_duckdb_queries_answer_on_an_export(run, tmp_path):
    """docs/tools.md's incident queries, run as written on an export of steps 1-12."""
    import re

    import duckdb

    from titan_ledger.format.arrow import event_kind

    _incident(run)
    out = tmp_path / "out"
    assert main([str(run), "-o", str(out), "--steps", "1:12"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["data_steps1-12.parquet", "documents_steps1-12.parquet",
                                                      "episodes.parquet", "ranks_steps1-12.parquet",
                                                      "signals.parquet", "spikes.parquet"]
    doc = (Path(__file__).resolve().parents[3] / "docs" / "tools.md").read_text()
    block = doc.split("The questions asked first after an incident", 1)[1].split("```sql", 1)[1].split("```", 1)[0]
    sql = block.replace("OUT/", f"{out}/").replace("stepsA-B", "steps1-12")
    queries = [q.strip() for q in re.sub(r"--[^\n]*", "", sql).split(";") if q.strip()]
    assert len(queries) == 4
    by_verdict, convicted, where, worst = (duckdb.sql(q).fetchall() for q in queries)
    assert by_verdict == [("bad_data", 1, [9], 1, 0), ("optimizer_state", 1, [11], 0, 0), ("outlier", 1, [3], 0, 0)] \
        or sorted(by_verdict) == sorted([("bad_data", 1, [9], 1, 0), ("optimizer_state", 1, [11], 0, 0),
                                         ("outlier", 1, [3], 0, 0)])
    assert convicted == [(9, "stdlib_docs:33", True), (9, "stdlib_docs:34", True)]
    assert sorted({w[3] for w in where}) == ["stdlib_docs:33", "stdlib_docs:34"]  # the rows that held them
    assert [(s, r) for s, r, *_ in worst] == [(s, 0 if s == 10 else 1) for s in range(1, 13)]
    kinds = duckdb.sql(f"SELECT kind FROM '{out}/spikes.parquet' ORDER BY step").fetchall()
    assert [k for (k,) in kinds] == ["note", "spike", "spike", "spike", "breaker"]  # (the run's own flag at 9 too)
    assert event_kind({"step": 5, "stall": {"kind": "stalled"}}) == "stall" and event_kind({"stall": {}}) == "stall"


def test_steps_are_checked_and_named(run, tmp_path, capsys):
    assert main([str(run), "-o", str(tmp_path / "o"), "--steps", "5"]) == 2
    assert "--steps 5: give A:B" in capsys.readouterr().err
