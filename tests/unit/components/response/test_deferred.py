"""Deferred decisions (``[ledger.response] defer``), the pure and in-process parts: the
device-side update guard (fused AdamW's ``found_inf``), rows that wait for their
decision, the checksum a deferred proof compares, the re-armed faults, the late mask,
and which steps decide in the step. The end-to-end exactness (a deferred run equals the
in-step run bit for bit) is tests/e2e/test_proof_e2e.py's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from doubles import HostDouble, LedgerDouble
from helpers import run_facts

from titan_ledger.components.detection.guard import SpikeGuard
from titan_ledger.components.detection.spikes import STAT_KEYS, SpikeDetector
from titan_ledger.components.prevention.optimizer import group_lr
from titan_ledger.components.response.first_execution import _per_param_sq, _per_param_sum
from titan_ledger.components.response.recovery import Recovery
from titan_ledger.components.signals.recorder import SignalRecorder
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.sums import ParamPlan
from titan_ledger.components.signals.topology import Topology
from titan_ledger.format import records
from titan_ledger.rehearsal import faults


def _adamw(held: float | None):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    for _ in range(2):  # a state that is not the initial one
        p.grad = torch.randn(16)
        opt.step()
    before = (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone(),
              opt.state[p]["step"].clone())
    p.grad = torch.randn(16)
    opt.found_inf = torch.tensor(held) if held is not None else None
    opt.step()
    after = (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"])
    return before, after


def test_a_held_update_leaves_parameters_moments_and_step_count_and_a_released_one_is_the_plain_update():
    before, after = _adamw(1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    _, released = _adamw(0.0)
    _, plain = _adamw(None)
    assert all(torch.equal(a, b) for a, b in zip(released, plain))  # bit for bit: the guard costs no rounding
    assert float(plain[3]) == 3.0


def test_the_guard_holds_on_an_acting_flag_and_on_a_note_only_when_notes_are_proven():
    guard = SpikeGuard(Topology.single(), SpikeDetector.Config(), "none")
    stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
    guard.last_stats = stats
    assert float(guard.hold(acting=True, notes=True)) == 0.0
    stats[STAT_KEYS.index("note")] = 1.0
    assert float(guard.hold(acting=True, notes=False)) == 0.0
    assert float(guard.hold(acting=True, notes=True)) == 1.0
    stats[0] = 1.0
    assert float(guard.hold(acting=True, notes=False)) == 1.0
    assert guard.hold(acting=True, notes=False).dtype == torch.float32  # what found_inf takes


def _recorder(tmp_path):
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    topo = Topology.single()
    rec = SignalRecorder(topo, device=torch.device("cpu"), plan=ParamPlan.build(model.named_parameters(), 1, 1),
                         attn=[], per_layer=False, max_logit=False, max_norm=1.0, global_batch=8, seq_len=4)
    rec.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
    gn = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return rec, gn


def test_a_deferred_steps_rows_wait_for_its_decision_and_the_later_ones_behind_it(tmp_path):
    rec, gn = _recorder(tmp_path)
    steps = [StepRecord(step=s, start=time.perf_counter()) for s in (1, 2, 3)]
    steps[1].decided = False
    for s in steps:
        red = rec.reduce(local_loss_sum=torch.tensor(4.0), local_tokens=4, grad_norm=gn)
        stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        stats[STAT_KEYS.index("n")] = s.step
        rec.queue(s, red.vector, stats)
    assert [d.rec.step for d in rec.completed(block=True)] == [1]  # step 2 undecided: 3 waits too
    assert rec.host_stats(steps[1])[STAT_KEYS.index("n")] == 2.0  # its own copy, read on the host
    steps[1].decided = True
    assert [d.rec.step for d in rec.completed(block=False)] == [2, 3]
    assert rec.host_stats(steps[1]) is None  # written: nothing queued any more


def test_the_checksum_sees_any_changed_gradient_value_a_flipped_sign_included():
    torch.manual_seed(0)
    grads = [torch.randn(64, 8), None, torch.randn(5)]
    sq, sm = _per_param_sq(grads, "cpu"), _per_param_sum(grads, "cpu")
    assert sq[1] == 0 and sm[1] == 0 and sq.dtype == sm.dtype == torch.float64
    assert torch.allclose(sq[0], grads[0].double().square().sum())
    for change in (lambda g: g.__setitem__((3, 1), -g[3, 1]),  # a sign: the square cannot see it
                   lambda g: g.__setitem__((0, 0), torch.nextafter(g[0, 0], torch.tensor(10.0)))):  # one ulp
        g2 = [grads[0].clone(), None, grads[2]]
        change(g2[0])
        assert not (torch.equal(_per_param_sq(g2, "cpu"), sq) and torch.equal(_per_param_sum(g2, "cpu"), sm))
    assert torch.equal(_per_param_sq([g.clone() if g is not None else None for g in grads], "cpu"), sq)


def test_a_discarded_first_execution_rearms_the_steps_one_time_fault():
    f = faults.StepFaults(bitflip=True, planned_bitflip=True)
    f.bitflip = False  # the first backward flipped its bit
    faults.rearm(f)
    assert f.bitflip is True
    f.bitflip = False  # the second execution flipped it again; a third is rearmed alike
    faults.rearm(f)
    assert f == faults.StepFaults(bitflip=True, planned_bitflip=True)
    group = object()  # a step (or DP rank) with faults but no bitflip planned gets none
    other = faults.StepFaults(swap_group=group)
    faults.rearm(other)
    assert other == faults.StepFaults(swap_group=group) and other.bitflip is False
    assert faults.rearm(None) is None  # a step without faults: nothing to rearm, and no error


def test_documents_a_deferred_proof_convicted_are_masked_in_the_next_steps_batches_as_the_fetch_would():
    from titan_ledger.components.ledger.ledger import Ledger
    from titan_ledger.data.layout import RowTag, Segment

    ledger = Ledger(Ledger.Config())
    tags = [RowTag(0, "s", (Segment(7, 0, 3), Segment(9, 0, 5))), RowTag(1, "s", (Segment(9, 5, 13),)),
            RowTag(2, "s", (Segment(4, 0, 8),))]
    labels = [torch.arange(16).view(2, 8), torch.arange(8).view(1, 8)]
    rec = StepRecord(step=5, start=0.0, tags=tags, batches=[[({}, labels[0])], [({}, labels[1])]],
                     masked={"quarantine": [[2, 0]]})
    ledger.remask(rec, [("s", 9), ("s", 4)])  # doc 4: quarantined already (row 2)
    assert rec.masked["quarantine"] == [[0, 1], [1, 0], [2, 0]]  # row order, the earlier mask kept, once
    assert labels[0][0, :3].tolist() == [0, 1, 2] and (labels[0][0, 3:] == -100).all()
    assert (labels[0][1] == -100).all()
    assert rec.masked_tokens == 13 + 8
    # a step whose fetch masked repeats only: the quarantine key goes first, as the fetch writes it
    rec = StepRecord(step=6, start=0.0, tags=tags, batches=[[({}, torch.arange(16).view(2, 8))]],
                     masked={"repetition": [[1, 0]]})
    ledger.remask(rec, [("s", 7)])
    assert list(rec.masked) == ["quarantine", "repetition"] and rec.masked["quarantine"] == [[0, 0]]


def _trainer(*, first_ckpt=False, log=False, more=True, ckpt=None, validate=None, window_next=False, fused=True, defer=True,
             prove="acting", action="none", snapshots=0):
    from titan_ledger.components.response.config import ProofConfig, ResponseConfig, SnapshotsConfig

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], fused=fused)
    ledger_cfg = Recovery.Config(response=ResponseConfig(policy="act", defer=defer, action=action),
                                 proof=ProofConfig(scope=prove), snapshots=SnapshotsConfig(every=snapshots))
    cfg = SimpleNamespace(
        ledger=ledger_cfg,
        checkpoint=SimpleNamespace(enable=ckpt is not None, interval=ckpt or 1, enable_first_step_checkpoint=first_ckpt),
        validator=SimpleNamespace(enable=validate is not None), training=SimpleNamespace(disable_cuda_graphs=True))
    guard = SimpleNamespace(detector=object())  # (rules run: a flag can exist)
    ledger = LedgerDouble(guard=guard, windows=[(11, 11)] if window_next else [])
    return HostDouble(config=cfg, ledger=ledger, optimizers=SimpleNamespace(optimizers=[opt]),
                      metrics_processor=SimpleNamespace(should_log=lambda s: log),
                      should_continue_training=lambda: more,
                      validator=SimpleNamespace(should_validate=lambda s: s % (validate or 1) == 0))


def _recovery(t):
    return t.config.ledger.build(host=t, ledger=t.ledger, facts=run_facts(t))


@pytest.mark.parametrize("kw,defers", [
    ({}, True),
    ({"log": True}, True),  # a logging step defers too (its row is written a step later)
    ({"more": False}, False),  # the last step: nothing after it to decide behind
    ({"ckpt": 5}, False),  # step 10 is a checkpoint step: the checkpoint must hold the decided update
    ({"ckpt": 3}, True),
    ({"ckpt": 3, "first_ckpt": True, "step": 1}, False),  # --checkpoint.enable_first_step_checkpoint
    ({"ckpt": 3, "step": 1}, True),
    ({"validate": 2}, False),  # validation reads the parameters
    ({"window_next": True}, False),  # the next step is skipped: nothing to decide behind
    ({"fused": False}, False),  # no found_inf: the host reads the flag in the step
    ({"defer": False}, False),
    ({"prove": "off"}, False),  # a flag changes nothing: nothing to decide at all
    ({"prove": "off", "action": "skip_update"}, True),
    ({"snapshots": 5}, False),  # a host snapshot is taken after step 10's decided update
    ({"snapshots": 3}, True),
])
def test_which_steps_defer_their_decision(kw, defers):
    step = kw.pop("step", 10)
    assert _recovery(_trainer(**kw)).defers(step) is defers


def test_a_dropped_step_gives_back_what_its_fetch_added_to_torchtitans_throughput_metrics():
    """A rollback decided a step late drops the step it was decided in: in the step, the
    rollback ran before that step's fetch, so its batches are not in the tokens and fetch
    times the next log line divides by its interval."""
    t = _trainer(action="rollback")
    t.metrics_processor.ntokens_since_last_log = 1000 + 2 * 256
    t.metrics_processor.data_loading_times = [0.1, 0.2, 0.01, 0.02]
    t.step, t.step_record = 12, None
    rec = StepRecord(step=12, start=0.0)
    rec.fetched, rec.batches = [256, 256], [[("batch", "labels")]]
    t.step_record = rec
    _recovery(t)._drop(rec)
    assert t.metrics_processor.ntokens_since_last_log == 1000
    assert t.metrics_processor.data_loading_times == [0.1, 0.2]
    assert t.ledger.discards == 1 and t.step_record is None and rec.batches is None


@pytest.mark.parametrize("prove,action,holds", [
    ("off", "none,skip_update", False),  # the first flag gets `none`: its update is applied, so not held
    ("off", "skip_update,none", True),
    ("acting", "none,skip_update", True),  # a proof decides first: held
])
def test_a_deferred_flag_holds_its_update_only_when_its_decision_can_withhold_it(prove, action, holds):
    from titan_ledger.components.detection.guard import SpikeGuard
    from titan_ledger.components.detection.spikes import SpikeDetector

    t = _trainer(prove=prove, action=action)
    t.device = torch.device("cpu")
    guard = SpikeGuard(Topology.single(), SpikeDetector.Config(), "none")
    guard.last_stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
    guard.last_stats[0] = 1.0  # an acting rule fired
    t.ledger.guard = guard
    t.ledger.last_execution = (None, 0, None)
    t.model_parts = []
    r = _recovery(t)
    rec = StepRecord(step=10, start=0.0)
    r._defer(rec, forced=False)
    assert r.held.holds is holds and r.pending is rec and rec.decided is False
    assert float(t.optimizers.optimizers[0].found_inf) == float(holds)


def test_an_optimizer_step_hook_keeps_decisions_in_the_step():
    """A hook on the optimizers container (torchtitan registers MoE load balancing's
    expert-bias update as one) runs on a held optimizers.step() too: such a run decides in
    the step."""
    t = _trainer(action="skip_update")
    assert _recovery(t).defers(10)
    opt = t.optimizers.optimizers[0]
    container = torch.optim.Optimizer([torch.nn.Parameter(torch.zeros(1))], {})
    container.optimizers = [opt]
    container.register_step_pre_hook(lambda *a, **k: None)
    t.optimizers = container
    assert not _recovery(t).defers(10)


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_a_late_update_is_applied_at_the_flagged_steps_learning_rate_a_tensor_one_included(tensor_lr):
    """The schedule moved on while the update was held: the late update uses the saved
    LR, and the live one is put back. A tensor LR (filled in place by the scheduler) is
    saved as a device copy, not a reference that the scheduler would overwrite."""
    def opt_at(lr):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8))
        opt = torch.optim.AdamW([p], lr=torch.tensor(lr) if tensor_lr else lr, fused=True)
        p.grad = torch.randn(8)
        return p, opt

    p, opt = opt_at(0.1)
    t = _trainer(action="skip_update")
    t.optimizers = SimpleNamespace(optimizers=[opt], step=opt.step)
    saved = [[group_lr(g) for g in opt.param_groups]]
    if tensor_lr:
        opt.param_groups[0]["lr"].fill_(0.5)  # the scheduler's next value, in place
    else:
        opt.param_groups[0]["lr"] = 0.5
    _recovery(t)._apply_late(StepRecord(step=4, start=0.0), saved)
    ref, ref_opt = opt_at(0.1)
    ref_opt.step()
    assert torch.equal(p, ref) and t.ledger.updates == 1
    assert float(opt.param_groups[0]["lr"]) == 0.5
