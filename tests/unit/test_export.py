"""``python -m titan_ledger.export``: the files hold the tables (pandas reads them back), what
was written is printed, and bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from titan_ledger.export import main
from titan_ledger.format.arrow import data_table, signals_table

from .bad_input_ledgers import make_run, tear


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
    assert len(lines) == 2
    assert lines[0].startswith(f"wrote {out}/signals.{fmt}: 11 rows x 28 columns, ")
    assert lines[1].startswith(f"wrote {out}/data_step7.{fmt}: 4 rows x 10 columns, ")
    assert all(" bytes), read " in ln and ln.endswith(" s") for ln in lines)
    assert sorted(p.name for p in out.iterdir()) == [f"data_step7.{fmt}", f"signals.{fmt}"]
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


def test_export_without_step_writes_signals_only_and_warns_on_a_torn_line(run, tmp_path, capsys):
    tear(run / "ledger" / "signals.jsonl")
    assert main(["--dump-folder", str(run), "-o", str(tmp_path / "o")]) == 0
    out, err = capsys.readouterr()
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["signals.parquet"]
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
