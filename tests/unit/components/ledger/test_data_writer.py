"""DataLedgerWriter in-process: one row per step, one row per skipped window, one
writer per DP group."""

from __future__ import annotations

from types import SimpleNamespace

from titan_ledger.components.ledger.data_writer import DataLedgerWriter
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.topology import Topology
from titan_ledger.data.layout import RowTag, Segment
from titan_ledger.format import records
from titan_ledger.format.data_reader import DataLedger


class _Loader:
    mbs = 2

    def header(self):
        return {"source_kind": "text", "mbs": 2, "seq_len": 4, "fingerprint": "f"}


def test_rows_and_windows_read_back(tmp_path):
    w = DataLedgerWriter(Topology(world=2, rank=1, dp_size=2, dp_rank=1, dp_rank_of=(0, 1)), _Loader(),
                         global_batch=4, skip_lr="freeze", tokenizer="tok")
    w.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0, extra={"dp_size": 2}), [(3, 4)])
    tags = [RowTag(2, "c4", (Segment(7, 0, 4),)), RowTag(3, "c4", (Segment(7, 4, 8),))]
    w.record(StepRecord(step=1, start=0.0, tags=tags))
    w.record(StepRecord(step=2, start=0.0, tags=tags, inject="repeat"))
    w.record_skip(first=3, last=4, info=SimpleNamespace(position_before=8, position_after=16, tags=None))
    w.close()
    assert w.rows_written == 3
    led = DataLedger(tmp_path)
    assert led.ids_at(1, 1) == (2, 3) and led.ids_at(4, 1) == (14, 15)
    assert led.header()["skip_steps"] == [[3, 4]] and led.header()["tokenizer"] == "tok"


def test_only_the_first_stage_tp0_rank_writes(tmp_path):
    w = DataLedgerWriter(Topology(world=2, rank=1, tp_rank=1, dp_rank_of=(0, 0)), _Loader(), global_batch=4,
                         skip_lr="freeze", tokenizer="tok")
    w.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0), [])
    w.record(StepRecord(step=1, start=0.0))
    w.close()
    assert not any(tmp_path.iterdir())
