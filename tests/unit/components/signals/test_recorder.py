"""SignalRecorder in-process: rows, the device->host discipline, (one process; the multi-rank
cost test is tests/multiproc/test_recorder_costs.py)."""

from __future__ import annotations

import math
import time

import torch

from titan_ledger.components.signals.recorder import SLOTS, NonFiniteRow, SignalRecorder, check_finite, reduced_slots
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.sums import ParamPlan
from titan_ledger.components.signals.topology import Topology
from titan_ledger.format import records
from titan_ledger.format.signal_columns import BY_NAME, COLUMNS


def _write(rec, block):
    """What Ledger.drain does with the recorder's part of a completed step."""
    for done in rec.completed(block):
        rec.write(done)
        check_finite(done.row, rec.path)


def _recorder(topo, model, per_layer=False):
    plan = ParamPlan.build(model.named_parameters(), topo.world, 1,
                           None if not per_layer else None)
    return SignalRecorder(topo, device=torch.device("cpu"), plan=plan, attn=[], per_layer=per_layer,
                          max_logit=True, max_norm=1.0, global_batch=8, seq_len=4)


def test_rows_from_a_single_process(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    rec = _recorder(Topology.single(), model)
    rec.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
    gn = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    red = rec.reduce(local_loss_sum=torch.tensor(6.0), local_tokens=4, grad_norm=gn)
    assert float(red.loss) == 1.5
    rec.queue(StepRecord(step=1, start=time.perf_counter(), lr=0.1), red.vector, None)
    _write(rec, block=False)
    rec.close()
    row = records.read_ledger(tmp_path / "signals.jsonl", records.SIGNALS).history[0]
    assert list(row) == list(records.SIGNAL_KEYS)  # the table's keys, in its order (the bytes on disk)
    _typed_as_declared(row)
    assert row["loss"] == 1.5 and row["loss_max_rank"] == 0 and row["consumed_tokens"] == 4
    assert row["consumed_samples"] == 8 and row["grad_norm"] == float(gn)
    assert math.isclose(row["grad_norm_clipped"], min(1.0, float(gn)), rel_tol=1e-6)  # clip coef has eps 1e-6
    assert row["num_zeros"] == sum(int((p.grad == 0).sum()) for p in model.parameters())
    assert math.isclose(row["param_norm"], float(torch.cat([p.detach().flatten() for p in model.parameters()]).norm()),
                        rel_tol=1e-6)
    assert row["max_logit"] == float("-inf")  # no attention recorders in this model
    assert records.read_ledger(tmp_path / "rank0.jsonl", records.RANK).history == [{"step": 1, "loss": 1.5, "tokens": 4}]


def _typed_as_declared(row: dict) -> None:
    """Every value of the row has its column's declared type, or is null where it may be."""
    for k, v in row.items():
        c = BY_NAME[k]
        assert (v is None and c.null) or type(v) is c.type or (c.type is float and type(v) is int), (k, v, c)


def test_the_reduced_vector_is_the_named_slots_and_a_window_row_the_tables_keys(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    rec = _recorder(Topology.single(), model)
    rec.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
    gn = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    v = rec.reduce(local_loss_sum=torch.tensor(6.0), local_tokens=4, grad_norm=gn, masked_tokens=1).vector.tolist()
    assert len(v) == 2 + len(SLOTS)  # loss and tokens of the one DP rank, the slots (no per-layer, no documents)
    s = reduced_slots(v, 1)
    assert (s["grad_norm"], s["consumed_tokens"], s["masked_tokens"]) == (float(gn), 4.0, 1.0)
    assert s["num_zeros"] == sum(int((p.grad == 0).sum()) for p in model.parameters())
    assert math.isclose(s["param_sq"], sum(float(p.detach().double().square().sum()) for p in model.parameters()),
                        rel_tol=1e-6)  # (summed in the parameters' float32)
    assert math.isnan(s["qk_clip_heads"]) and s["logz_tokens"] == 0.0  # QK-clip off, no log Z measured
    rec.record_skip(first=2, last=5, n_samples=32, lr=0.1, step_start=time.perf_counter(), skip_lr="freeze")
    rec.close()
    (window,) = records.read_ledger(tmp_path / "signals.jsonl", records.SIGNALS).history
    assert list(window) == [*records.SIGNAL_KEYS, *(c.name for c in COLUMNS if c.window)]
    _typed_as_declared(window)


def test_a_nonfinite_loss_is_written_then_stops(tmp_path):
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    rec = _recorder(Topology.single(), model)
    rec.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
    red = rec.reduce(local_loss_sum=torch.tensor(float("nan")), local_tokens=2, grad_norm=torch.tensor(1.0))
    rec.queue(StepRecord(step=3, start=time.perf_counter(), lr=0.1), red.vector, None)
    try:
        _write(rec, block=True)
        raise AssertionError("a NaN loss must stop training")
    except NonFiniteRow as e:
        assert "step 3" in str(e)
    rec.close()
    assert math.isnan(records.read_ledger(tmp_path / "signals.jsonl").history[0]["loss"])



def test_per_layer_norms_are_pre_clip_although_read_after_the_clip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    (model(torch.randn(8, 3)) * 50).sum().backward()
    pre = {n: float(p.grad.double().norm()) for n, p in model.named_parameters()}
    plan = ParamPlan.build(model.named_parameters(), 1, 1)
    plan = ParamPlan.build(model.named_parameters(), 1, 1, plan.groups)
    rec = SignalRecorder(Topology.single(), device=torch.device("cpu"), plan=plan, attn=[], per_layer=True,
                         max_logit=False, max_norm=1.0, global_batch=8, seq_len=4)
    rec.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as the trainer does
    assert float(gn) > 10  # the clip is active
    red = rec.reduce(local_loss_sum=torch.tensor(1.0), local_tokens=1, grad_norm=gn)
    rec.queue(StepRecord(step=1, start=time.perf_counter(), lr=0.1), red.vector, None)
    _write(rec, block=True)
    rec.close()
    row = records.read_ledger(tmp_path / "signals.jsonl").history[0]
    per_layer = row[records.PER_LAYER_KEY]
    for group in ("0", "1"):
        want = math.sqrt(sum(v * v for n, v in pre.items() if n.startswith(group + ".")))
        assert math.isclose(per_layer[group], want, rel_tol=1e-5), (group, per_layer[group], want)
    assert math.isclose(row["grad_norm"], math.sqrt(sum(v * v for v in pre.values())), rel_tol=1e-5)


def test_a_step_a_proof_trained_with_a_mask_records_what_trained(tmp_path):
    """Issue 68: a step whose proof applied its masked update records the applied
    execution's loss, grad norm and masked tokens (the first execution's stay in the proof),
    and the run's consumed tokens count what trained, this step's and every later one's."""
    import json

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    rec = _recorder(Topology.single(), model)
    rec.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
    gn = torch.tensor(8.0)
    step = StepRecord(step=1, start=time.perf_counter())
    rec.queue(step, rec.reduce(local_loss_sum=torch.tensor(40.0), local_tokens=20, grad_norm=gn).vector, None)
    # the proof masked 6 of the 20 label tokens; the masked execution's loss 1.5, grad norm 0.5
    step.trained = {"loss_by_dp": [21.0], "tok_by_dp": [14.0], "grad_norm": 0.5, "grad_norm_clipped": 0.5,
                    "masked_tokens": 6}
    rec.untrain(6)
    nxt = StepRecord(step=2, start=time.perf_counter())
    rec.queue(nxt, rec.reduce(local_loss_sum=torch.tensor(20.0), local_tokens=20, grad_norm=gn).vector, None)
    _write(rec, True)
    rec.close()
    rows = [json.loads(x) for x in (tmp_path / records.SIGNALS_FILE).read_text().splitlines()[1:]]
    assert (rows[0]["loss"], rows[0]["grad_norm"], rows[0]["masked_tokens"]) == (1.5, 0.5, 6)
    assert rows[0]["consumed_tokens"] == 14 and rows[1]["consumed_tokens"] == 34  # 20 + 20 - 6
    assert rows[1]["loss"] == 1.0 and rows[1]["masked_tokens"] == 0
