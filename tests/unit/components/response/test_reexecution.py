"""titan_ledger.components.response.reexecution: one way to execute a step again. An
extra execution (the proof's) and a replacing one (the redo) each put back what the
module docstring's table lists, on a fake trainer around a real model (no processes)."""

from __future__ import annotations

import torch
from doubles import HostDouble, LedgerDouble
from helpers import run_facts

from titan_ledger.components.response.reexecution import Reexecution, expert_counts
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.rehearsal import faults


def _moe():
    """torchtitan's own MoE layer (qwen3's debug MoE config), on the CPU."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    model = qwen3_moe_debug().model_spec.model
    layer = model.layers[0] if isinstance(model.layers, list) else model.layers
    torch.manual_seed(0)
    return layer.moe.build(), model.dim


class _Trainer(HostDouble):
    """What ``Reexecution`` touches of a ``LedgerTrainer``: ``execute`` runs a forward and
    backward, counts tokens as torchtitan does and refills a per-step accumulator."""

    def __init__(self, model, x):
        super().__init__()
        self.model_parts, self.x = [model], x
        self.device = torch.device("cpu")
        self.step_record = "the trainer's own"
        self.ntokens_seen = 7
        self.seen_records, self.discarded = [], 0
        self.accumulator = 0  # (per-document sums, log Z, max logits)
        self.ledger = LedgerDouble(discard_step_state=self._discard)  # (a part the test counts itself)
        self.ready()

    def _discard(self):
        self.discarded += 1
        self.accumulator = 0

    def execute(self, groups, need_loss):
        self.seen_records.append(self.step_record)
        self.ntokens_seen += 16
        self.accumulator += 1
        torch.rand(3)  # a draw from the RNG (dropout would make one)
        loss = self.model_parts[0](self.x).square().sum()
        loss.backward()
        return loss.detach(), None, 16, 16


def test_an_extra_execution_puts_back_everything_it_touched():
    torch.manual_seed(0)
    t = _Trainer(torch.nn.Linear(4, 2), torch.randn(3, 4))
    rec = StepRecord(step=5, start=0.0)
    rec.faults = faults.StepFaults(bitflip=False, planned_bitflip=True)  # the first execution flipped its bit
    t.execute(None, True)
    first = [p.grad for p in t.model_parts[0].parameters()]
    first_values = [g.clone() for g in first]
    rng = torch.get_rng_state()
    with Reexecution(t, t.ledger, run_facts(t), rec, replaces=False) as again:
        again.run(None)
        again.run(None)
        grads = [p.grad for p in t.model_parts[0].parameters()]
    assert t.seen_records[1:] == [rec, rec]  # the hooks saw the executed step
    assert t.step_record == "the trainer's own" and t.ntokens_seen == 7 + 16
    assert torch.equal(torch.get_rng_state(), rng)
    assert t.discarded == 2 and t.accumulator == 0  # what each extra execution refilled, drained after it
    assert rec.faults.bitflip is False  # a transient fault happens in the first execution only
    # fresh gradients each time: the first execution's, kept by reference, are untouched
    assert all(g is not g0 for g, g0 in zip(grads, first))
    assert all(torch.equal(g0, v) for g0, v in zip(first, first_values))
    assert all(torch.equal(g, v) for g, v in zip(grads, first_values))  # (not accumulated: the same values)


def test_a_replacing_execution_drains_the_replaced_one_first_and_rearms_its_faults():
    torch.manual_seed(0)
    t = _Trainer(torch.nn.Linear(4, 2), torch.randn(3, 4))
    rec = StepRecord(step=6, start=0.0)
    rec.faults = faults.StepFaults(bitflip=False, planned_bitflip=True)
    t.step_record = rec  # a redo runs inside its own step
    t.execute(None, True)
    with Reexecution(t, t.ledger, run_facts(t), rec, replaces=True) as again:
        assert t.discarded == 1 and t.accumulator == 0  # the replaced execution's accumulators
        assert rec.faults.bitflip is True  # the replaced execution never happened
        out = again.run(None)
    assert out[2] == 16 and t.accumulator == 1  # the replacing execution's stand
    assert t.step_record is rec and t.ntokens_seen == 7 + 16  # the first execution's count stands


def test_an_extra_execution_takes_its_moe_routing_counts_back_out():
    """MoE load balancing turns the forward's routing counts (tokens_per_expert_E) into
    the expert-bias update at optimizers.step(): a proof's extra execution of the step
    must leave the counts the first execution left, or it leaves a trace."""
    moe, dim = _moe()
    moe.train()
    t = _Trainer(moe, torch.randn(2, 8, dim))
    t.execute(None, True)  # the step's first execution
    (counts,) = expert_counts([moe])
    first = counts.clone()
    assert first.sum() > 0
    with Reexecution(t, t.ledger, run_facts(t), StepRecord(step=3, start=0.0), replaces=False) as again:
        again.run(None)
        assert not torch.equal(counts, first)  # (the counts do move with every forward)
    assert torch.equal(counts, first) and t.ntokens_seen == 7 + 16
