"""titan_ledger.format.arrow: the signals table is ``RunLedger.signal_rows()``, row for row
and value for value (a resume that supersedes rows, a skipped window, a torn last line,
non-finite values), read by the fast column path; the data table is ``data.at``."""

from __future__ import annotations

import contextlib
import math
import random

import pyarrow as pa
import pytest

from titan_ledger.errors import LedgerError, LedgerWarning
from titan_ledger.format import columns, records
from titan_ledger.format.arrow import data_table, signal_columns, signals_table
from titan_ledger.format.reader import RunLedger
from titan_ledger.format.signal_columns import COLUMNS

from ..bad_input_ledgers import make_run

#: a value of each kind (format.columns.KINDS), full-precision floats
_VALUE = {"int": lambda rng: rng.randrange(10**9), "float": lambda rng: 10 * rng.random(),
          "bool": lambda rng: rng.random() < 0.5, "str": lambda rng: rng.choice(("a", "b"))}


def signal_row(step: int, rng: random.Random, **over) -> dict:
    """A row as the recorder writes it: every key of records.SIGNAL_KEYS in order, each a
    value of its column's kind (null where its option is off by default), then the step's
    own facts (derived from the table: a new column needs no change here)."""
    row = {c.name: None if c.off else _VALUE[c.kind](rng) for c in COLUMNS if not c.window}
    loss = 2.0 + rng.random()
    row.update(step=step, consumed_samples=8 * step, consumed_tokens=2040 * step, loss=loss,
               loss_max=loss + rng.random() / 10, loss_max_rank=rng.randrange(2), skipped=False,
               skipped_samples=0, spike=False, spike_note=None, update_skipped=False)
    assert tuple(row) == records.SIGNAL_KEYS
    return {**row, **over}


def window_row(first: int, last: int, **over) -> dict:
    return {**{k: None for k in records.SIGNAL_KEYS}, "step": first, "last_step": last, "skipped": True,
            "skip_lr": "freeze", "lr": 1e-4, "consumed_samples": 8 * last, "consumed_tokens": 0,
            "skipped_samples": 8 * (last - first + 1), "update_skipped": False, "step_time_s": 0.01,
            "data_loading_s": 0.0, **over}


def write_ledger(dump, variant: str = "plain"):
    """Launch a: steps 1-10 (a NaN loss, an infinite grad norm and a -inf worst-rank loss
    at step 5 with ``nonfinite``), a window 11-12, step 13; launch b resumed from
    step 6: steps 7-9, a window 10-12 that stays, steps 13-15; ``torn``: a torn last
    line; ``torn_then_resumed``: launch a's last line torn, launch b behind it."""
    rng = random.Random(0)
    led = dump / "ledger"
    for seq, run, resumed, rows in (
        (1, "a", 0, [signal_row(s, rng) for s in range(1, 11)] + [window_row(11, 12), signal_row(13, rng)]),
        (2, "b", 6, [signal_row(s, rng) for s in (7, 8, 9)] + [window_row(10, 12)]
         + [signal_row(s, rng, spike=s == 14) for s in (13, 14, 15)]),
    ):
        hdr = records.Header(schema="", run_id=run, seq=seq, resumed_from=resumed, time=float(seq),
                             extra={"world_size": 2, "dp_size": 2})
        records.append_segment(led, hdr)
        w = records.RecordWriter(led / records.SIGNALS_FILE, {**hdr.to_json(), "schema": records.SIGNALS.id})
        for row in rows:
            if variant == "nonfinite" and row["step"] == 5:
                row.update(loss=math.nan, grad_norm=math.inf, loss_max=-math.inf)
            w.write(row)
        w.close()
        if variant == "torn_then_resumed" and seq == 1:  # killed mid-write, then resumed behind it
            with open(led / records.SIGNALS_FILE, "ab") as f:
                f.write(b'{"step":14,"lo')
    if variant == "torn":
        with open(led / records.SIGNALS_FILE, "ab") as f:
            f.write(b'{"step":16,"consumed_samples":128,"lo')
    return dump


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and (type(a) is type(b) or (isinstance(a, float) and type(b) is int))


@pytest.mark.parametrize("variant", ["plain", "nonfinite", "torn", "torn_then_resumed"])
def test_signals_table_is_signal_rows(tmp_path, variant, monkeypatch):
    dump = write_ledger(tmp_path / "run", variant)
    torn = variant.startswith("torn")
    warns = pytest.warns(LedgerWarning, match="torn (last )?line") if torn else contextlib.nullcontext()
    with warns:
        want = RunLedger(dump).signal_rows()
    if not torn:  # the fast path reads it: non-finite values included
        monkeypatch.setattr(columns, "_exact_table", lambda *a, **k: pytest.fail("fell back to the exact read"))
    with warns:
        table = signals_table(dump)
    assert table.column_names == list(columns.TABLE_KEYS)
    got = table.to_pylist()
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 14, 15]
    for g, w in zip(got, want):
        for k in columns.TABLE_KEYS:
            assert same(g[k], w.get(k)), (g["step"], k, g[k], w.get(k))
    assert got[9]["last_step"] == 12 and got[9]["skip_lr"] == "freeze" and got[9]["loss"] is None
    assert table.schema.field("consumed_tokens").type == pa.int64()
    assert table.schema.field("loss").type == pa.float64() and table.schema.field("spike").type == pa.bool_()
    if variant == "nonfinite":
        assert math.isnan(got[4]["loss"]) and got[4]["grad_norm"] == math.inf and got[4]["loss_max"] == -math.inf


@pytest.mark.parametrize("variant", ["plain", "nonfinite"])
def test_the_fast_and_the_exact_read_give_the_same_table(tmp_path, variant):
    path = write_ledger(tmp_path / "run", variant) / "ledger" / records.SIGNALS_FILE
    fast = columns._arrow_table(path, columns.TABLE_KEYS)
    exact = columns._exact_table(path, columns.TABLE_KEYS)
    assert fast.schema == exact.schema
    nan = lambda v: "NaN" if isinstance(v, float) and math.isnan(v) else v  # noqa: E731
    assert [{k: nan(v) for k, v in r.items()} for r in fast.to_pylist()] == \
        [{k: nan(v) for k, v in r.items()} for r in exact.to_pylist()]


def test_segments_out_of_file_order_are_read_in_seq_order(tmp_path):
    """The history is in segment order (seq), whatever order the file holds them in."""
    led = tmp_path / "ledger"
    rng = random.Random(1)
    for seq, resumed, steps in ((2, 3, (4, 5, 6)), (1, 0, (1, 2, 3, 4, 5))):
        w = records.RecordWriter(led / records.SIGNALS_FILE, {"schema": records.SIGNALS.id, "run_id": f"r{seq}",
                                                              "seq": seq, "resumed_from": resumed})
        for s in steps:
            w.write(signal_row(s, rng, loss=float(10 * seq + s)))
        w.close()
    want = RunLedger(tmp_path).signal_rows()
    got = signals_table(led, ["loss"]).to_pylist()
    assert got == [{"step": r["step"], "loss": r["loss"]} for r in want]
    assert [r["loss"] for r in got] == [11.0, 12.0, 13.0, 24.0, 25.0, 26.0]


def test_keys_select_columns_and_an_unknown_key_is_named(tmp_path):
    dump = write_ledger(tmp_path / "run")
    t = signals_table(RunLedger(dump), ["loss", "last_step"])
    assert t.column_names == ["step", "loss", "last_step"] and t.num_rows == 13
    with pytest.raises(LedgerError, match="keys: no signal column 'los'; the columns are step, "):
        signals_table(dump, ["los"])


def test_signal_columns_are_what_plot_read_before(tmp_path):
    """plot's columns through the table equal the numpy column read (RunLedger.signal_columns)."""
    import numpy as np

    dump = write_ledger(tmp_path / "run", "nonfinite")
    keys = ("loss", "num_zeros", "lr", "spike")
    cols, windows = signal_columns(dump, keys)
    old_cols, old_windows = columns.read_columns(dump / "ledger" / records.SIGNALS_FILE, keys)
    assert windows == old_windows == [(10, 12)]
    assert cols.keys() == old_cols.keys()
    assert all(np.array_equal(cols[k], old_cols[k], equal_nan=True) and cols[k].dtype == old_cols[k].dtype
               for k in cols)
    assert cols["step"].dtype == np.int64 and cols["num_zeros"].dtype == np.float64


def test_errors_are_the_readers(tmp_path):
    with pytest.raises(LedgerError, match="no such dump folder"):
        signals_table(tmp_path / "nope")
    (tmp_path / "run" / "ledger").mkdir(parents=True)
    with pytest.raises(LedgerError, match="signals.jsonl: no signals ledger"):
        signals_table(tmp_path / "run")
    p = tmp_path / "run" / "ledger" / records.SIGNALS_FILE
    w = records.RecordWriter(p, {"schema": records.SIGNALS.id, "run_id": "a", "seq": 1, "resumed_from": 0})
    w.write({"step": 1, "loss": 2.0})
    w.close()
    with pytest.raises(LedgerError, match="step 1 has no grad_norm, lr, skipped"):
        signals_table(tmp_path / "run")
    p.write_bytes(p.read_bytes() + b'{"step": 2, "loss": 2.0, "grad_norm": 1, "lr": 1, "skipped": "no"}\n')
    with pytest.raises(LedgerError, match="step 2: 'skipped' is 'no', not a bool"):
        signals_table(tmp_path / "run")


def test_data_table_is_data_at(tmp_path):
    dump = make_run(tmp_path / "run", steps=6, dp=2, mbs=2, spike_at=None, checkpoints=())
    led = RunLedger(dump)
    t = data_table(led, 4)
    assert t.column_names == ["step", "dp_rank", "row", "segment", "sample_id", "source", "doc", "start", "end",
                              "skipped"]
    want = [(4, r, i, j, tag.sample_id, tag.source, s.doc, s.start, s.end, False)
            for r in led.data.ranks_at(4) for i, tag in enumerate(led.data.at(4, r).tags)
            for j, s in enumerate(tag.segments)]
    assert [tuple(r.values()) for r in t.to_pylist()] == want and {r[1] for r in want} == {0, 1}
    assert t.schema.field("sample_id").type == pa.int64() and t.schema.field("source").type == pa.string()
    with pytest.raises(LedgerError, match="no DP rank has a data-ledger row for step 9"):
        data_table(dump, 9)
    (dump / "ledger" / records.data_file(1)).write_bytes(
        b"".join((dump / "ledger" / records.data_file(1)).read_bytes().splitlines(keepends=True)[:3]))
    with pytest.raises(LedgerError, match=r"data_dp1.jsonl: no row for step 4, but the run had 2 DP ranks"):
        data_table(dump, 4)
