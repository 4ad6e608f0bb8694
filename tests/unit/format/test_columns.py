"""Column reads for plot (titan_ledger.format.columns): the fast path and the exact path agree,
and both apply the one supersession rule."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from titan_ledger.errors import LedgerWarning
from titan_ledger.format import columns, records

KEYS = ("loss", "grad_norm")


def _signals(path, torn=False, nan=False):
    w = records.RecordWriter(path, {"schema": records.SIGNALS.id, "run_id": "a", "resumed_from": 0, "seq": 1})
    for s in range(1, 11):
        row = {k: None for k in records.SIGNAL_KEYS}
        row.update(step=s, loss=float(s), grad_norm=1.0, skipped=False, lr=1e-3)
        if nan and s == 9:
            row["loss"] = float("nan")
        w.write(row)
    w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": 11, "last_step": 14, "skipped": True})
    w.close()
    w = records.RecordWriter(path, {"schema": records.SIGNALS.id, "run_id": "b", "resumed_from": 6, "seq": 2})
    for s in range(7, 9):
        row = {k: None for k in records.SIGNAL_KEYS}
        row.update(step=s, loss=100.0 + s, grad_norm=2.0, skipped=False, lr=1e-3)
        w.write(row)
    w.close()
    if torn:
        with open(path, "ab") as f:
            f.write(b'{"step": 9, "lo')


@pytest.mark.parametrize("variant", ["plain", "torn", "nan"])
def test_fast_and_exact_agree_and_drop_superseded_rows(tmp_path, variant):
    p = tmp_path / "signals.jsonl"
    _signals(p, torn=variant == "torn", nan=variant == "nan")
    # a torn last line is reported (LedgerWarning) by the exact read, which the fast path defers to
    warns = pytest.warns(LedgerWarning, match="signals.jsonl:16: torn last line skipped") \
        if variant == "torn" else contextlib.nullcontext()
    own = (*KEYS, "skipped", "last_step")
    with warns:
        exact = columns.trained_columns(columns._exact_table(p, ("step", *own)), KEYS)
        got = columns.read_columns(p, KEYS)
    assert list(exact[0]["step"]) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert exact[0]["loss"][-1] == 108.0 and exact[1] == []  # the window was in the lost run
    assert all(np.array_equal(got[0][k], exact[0][k], equal_nan=True) for k in exact[0]) and got[1] == exact[1]
    if variant != "torn":  # a non-finite value stays on the fast path
        fast = columns.trained_columns(columns._arrow_table(p, ("step", *own)), KEYS)
        assert all(np.array_equal(fast[0][k], exact[0][k], equal_nan=True) for k in exact[0])


def test_newer_schema_is_refused_by_the_fast_path_too(tmp_path):
    p = tmp_path / "signals.jsonl"
    records.RecordWriter(p, {"schema": "titan_ledger.signals/9", "run_id": "a"}).close()
    with pytest.raises(records.LedgerError, match="newer"):
        columns.read_columns(p, KEYS)
