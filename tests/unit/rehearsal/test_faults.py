"""The bitflip fault on tensors (no processes): which element, which bit, how large; the per-step plan."""

from __future__ import annotations

import math

import pytest
import torch

from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.errors import ConfigError
from titan_ledger.rehearsal import faults
from titan_ledger.rehearsal.faults import parse_inject, parse_injects


def test_flip_value_is_an_involution_and_flips_one_bit():
    for v in (1e-3, -0.05, 2.5, 0.0):
        for bit in (23, 26, 30):
            f = faults.flip_value(v, bit)
            v32 = float(torch.tensor(v, dtype=torch.float32))
            assert faults.flip_value(f, bit) == v32
            a = torch.tensor([v], dtype=torch.float32).view(torch.int32).item()
            b = torch.tensor([f], dtype=torch.float32).view(torch.int32).item()
            assert bin((a ^ b) & 0xFFFFFFFF).count("1") == 1


def test_top_exponent_bit_of_zero_gives_two():
    assert faults.flip_value(0.0, 30) == 2.0
    assert faults.flip_value(1e-3, 30) > 1e35  # what a real top-bit flip does to a small gradient


def test_flip_tensor_prefers_a_large_finite_jump():
    torch.manual_seed(0)
    t = torch.randn(4096) * 1e-3
    t[::7] = 0.0  # gradients of tokens not in the batch are exactly 0
    before = t.clone()
    rec = faults.flip_tensor(t)
    changed = (t != before).nonzero().flatten().tolist()
    assert changed == [rec["index"]]
    assert rec["before"] == float(before[rec["index"]]) and rec["after"] == float(t[rec["index"]])
    assert 100 * before.abs().max() <= abs(rec["after"]) <= faults.LIMIT and math.isfinite(rec["after"])
    assert torch.linalg.vector_norm(t) > 10 * torch.linalg.vector_norm(before)
    assert math.isfinite(float(torch.linalg.vector_norm(t)))


def test_flip_tensor_without_a_finite_candidate_flips_the_top_bit_of_the_largest():
    t = torch.tensor([0.01, -0.05, 0.02])
    rec = faults.flip_tensor(t)
    assert rec["index"] == 1 and rec["bit"] == 30 and abs(rec["after"]) > 1e36


def test_flip_tensor_ignores_empty_and_integer_tensors():
    assert faults.flip_tensor(torch.zeros(0)) is None
    assert faults.flip_tensor(torch.zeros(3, dtype=torch.int64)) is None


def test_flip_largest_grad_picks_the_largest_shard_and_skips_empty_ones():
    a, b = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(5))
    c, d = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad, d.grad = torch.zeros(0), torch.full((5,), 1e-4), torch.full((3,), 1e-2)
    rec = faults.flip_largest_grad([("a", a), ("c", c), ("b", b), ("d", d)])
    assert rec["param"] == "d" and d.grad.abs().max() > 1.0 and b.grad.abs().max() == pytest.approx(1e-4)
    assert faults.flip_largest_grad([("a", a), ("c", c)]) is None


def test_parse_inject_accepts_bitflip_and_combinations():
    assert parse_inject("8:1:bitflip") == (8, 1, "bitflip")
    assert parse_inject("11:0:bitflip,8:1:repeat") == (8, 1, "repeat")  # the data kind is applied
    assert parse_injects("8:1:repeat,11:0:bitflip") == [(8, 1, "repeat"), (11, 0, "bitflip")]
    assert parse_injects("8:1:repeat,8:0:swap") == [(8, 1, "repeat"), (8, 0, "swap")]
    assert parse_inject("8:0:swap") == (8, 0, "swap")
    for bad in ("8:1:repeat,9:0:random", "8:1:flip", "8:1", "0:1:bitflip"):
        with pytest.raises(ConfigError):
            parse_injects(bad)


def test_rotate_takes_the_next_ranks_batch():
    assert [faults.rotate(["a", "b", "c"], r) for r in range(3)] == ["b", "c", "a"]
    assert [faults.rotate(["a", "b"], r) for r in range(2)] == ["b", "a"]


def _plan(t):
    return faults.plan(t, t.rec)


def _fake_trainer(spec, step=3, dp_rank=1, pp=False, inject=None, nondeterminism=0.0):
    from types import SimpleNamespace as NS

    model = torch.nn.Linear(4, 4)
    rehearsal = NS(inject=spec, die="", nondeterminism=nondeterminism)
    return NS(rec=StepRecord(step=step, start=0.0, inject=inject), config=NS(ledger=NS(rehearsal=rehearsal)), step=step,
              ledger=NS(topo=NS(dp_rank=dp_rank, rank=dp_rank)), model_parts=[model],
              parallel_dims=NS(pp_enabled=pp, get_mesh=lambda name: NS(get_group=lambda: f"group:{name}")))


def test_step_plan_swaps_every_microbatch_and_flips_after_the_first_backward_only(monkeypatch):
    """What LedgerTrainer.forward_backward_step does per microbatch: before_forward,
    torchtitan's forward/backward, after_backward."""
    swapped = []
    monkeypatch.setattr(faults, "swap_batches",
                        lambda d, l, g: (swapped.append(g) or {**d, "input": d["input"] + 1}, l + 1))
    t = _fake_trainer("3:1:bitflip,3:0:swap", inject="bitflip")
    plan = faults.plan(t, t.rec)
    assert t.rec.inject is None  # a fault is not a batch replacement
    assert plan.swap_group == "group:batch" and plan.bitflip
    flips = []
    for mb in range(3):  # three gradient-accumulation microbatches
        kwargs = {"input_dict": {"input": torch.zeros(2)}, "labels": torch.zeros(2), "global_valid_tokens": 4}
        faults.before_forward(plan, kwargs)
        assert float(kwargs["input_dict"]["input"][0]) == 1.0 and float(kwargs["labels"][0]) == 1.0
        for p in t.model_parts[0].parameters():
            p.grad = torch.full_like(p, 1e-3)
        faults.after_backward(t, plan)
        flips.append(max(float(p.grad.abs().max()) for p in t.model_parts[0].parameters()) > 0.01)
    assert swapped == ["group:batch"] * 3 and flips == [True, False, False]


def test_step_plan_is_per_step_rank_and_swap_refuses_pp():
    assert _plan(_fake_trainer("3:1:bitflip", step=4)) is None
    assert _plan(_fake_trainer("3:1:bitflip", dp_rank=0)) is None  # another rank's flip
    p = _plan(_fake_trainer("3:1:swap", dp_rank=0))  # swap: every rank, whatever the spec's
    assert p.swap_group is not None and not p.bitflip
    assert _plan(_fake_trainer("")) is None
    faults.before_forward(None, {})  # no plan: nothing to do
    assert _plan(_fake_trainer("3:0:bitflip", dp_rank=0, pp=True)).bitflip  # bitflip runs under PP
    with pytest.raises(RuntimeError, match="pipeline parallelism"):
        _plan(_fake_trainer("3:0:swap", pp=True))


def test_die_spec():
    from titan_ledger.rehearsal.faults import parse_die

    assert parse_die("") is None
    assert parse_die("5:1:SIGKILL") == (5, 1, "SIGKILL") and parse_die("2:0:exit3") == (2, 0, "exit3")
    for bad in ("5:1", "5:1:KILL", "0:1:SIGKILL", "5:-1:SIGKILL", "5:1:exitx", "a:1:SIGKILL"):
        with pytest.raises(ConfigError, match=r"--ledger.rehearsal.die .*STEP:RANK:HOW"):
            parse_die(bad)


def test_rehearsed_nondeterminism_jitters_every_gradient_by_its_size_and_differs_per_backward():
    """--ledger.rehearsal.nondeterminism X: each gradient scaled by 1 + X*u, |u| <= 1, one
    draw per parameter and backward, from the rank's own generator (the global RNG untouched)."""
    t = _fake_trainer("", nondeterminism=1e-3)
    lin = t.model_parts[0]
    base = [torch.ones_like(p) for p in lin.parameters()]
    seen = []
    rng = torch.get_rng_state()
    for _ in range(2):
        for p, b in zip(lin.parameters(), base):
            p.grad = b.clone()
        faults.after_backward(t, None)
        seen.append([p.grad.clone() for p in lin.parameters()])
    assert torch.equal(torch.get_rng_state(), rng)
    for grads in seen:
        for g in grads:
            assert (g - 1).abs().max() <= 1e-3 and (g - 1).abs().max() > 0
            assert torch.all(g == g.flatten()[0])  # one draw per parameter: a scale, not noise per element
    assert not torch.equal(seen[0][0], seen[1][0])  # the next backward differs
    off = _fake_trainer("")
    for p in off.model_parts[0].parameters():
        p.grad = torch.ones_like(p)
    faults.after_backward(off, None)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in off.model_parts[0].parameters())


def test_the_data_runs_out_from_the_rehearsed_step_on():
    """--ledger.rehearsal.data_end N: every fetch from step N on raises torchtitan's
    DataloaderExhaustedError (what a finite dataset's end raises); 0 is off; a negative
    step names the flag."""
    from types import SimpleNamespace as NS

    from torchtitan.components.dataloader import DataloaderExhaustedError

    from titan_ledger.components.ledger.sections import RehearsalConfig

    def at(step, end):
        return NS(step=step, config=NS(ledger=NS(rehearsal=NS(data_end=end))))

    faults.data_runs_out(at(15, 16))
    faults.data_runs_out(at(99, 0))
    for step in (16, 17):
        with pytest.raises(DataloaderExhaustedError):
            faults.data_runs_out(at(step, 16))
    with pytest.raises(ConfigError, match="--ledger.rehearsal.data_end"):
        RehearsalConfig(data_end=-1)


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_a_scaled_bitflip_moves_the_norm_by_about_its_factor_with_one_real_bit(factor):
    """``bitflip@F``: one bit of one element turned 0 -> 1, the one whose flip brings
    the gradient's norm closest to F x; replicated gradients are not candidates."""
    g = torch.Generator().manual_seed(0)
    ps = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate((300, 2000, 50))]
    for _, p in ps:
        p.grad = torch.randn(p.numel(), generator=g) * 1e-3
    before = [p.grad.clone() for _, p in ps]
    total_sq = sum(float(p.grad.double().square().sum()) for _, p in ps)
    rec = faults.flip_to_factor(ps, total_sq, factor)
    after_sq = sum(float(p.grad.double().square().sum()) for _, p in ps)
    reached = math.sqrt(after_sq / total_sq)
    assert reached == pytest.approx(factor, rel=0.002) and reached == pytest.approx(rec["factor"], rel=1e-6)
    changed = [(i, int(j)) for i, ((_, p), b) in enumerate(zip(ps, before)) for j in (p.grad != b).nonzero()]
    assert len(changed) == 1 and ps[changed[0][0]][0] == rec["param"] and changed[0][1] == rec["index"]
    old = torch.tensor([rec["before"]]).view(torch.int32)
    new = torch.tensor([rec["after"]]).view(torch.int32)
    assert int(old ^ new) == 1 << rec["bit"] and 0 <= rec["bit"] <= 30 and abs(rec["after"]) > abs(rec["before"])
    assert faults.flip_to_factor(ps, 0.0, factor) is None


def test_a_scaled_bitflip_passes_over_replicated_gradients_and_parses():
    class Replicated(torch.Tensor):  # the one attribute flip_to_factor reads of a DTensor
        placements = (torch.distributed.tensor.Replicate(),)

    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.ones(10).as_subclass(Replicated)
    assert faults.flip_to_factor([("p", p)], 10.0, 2.0) is None
    assert parse_injects("10:1:bitflip@2,8:0:repeat") == [(10, 1, "bitflip@2"), (8, 0, "repeat")]
    assert parse_inject("10:1:bitflip@1.5") == (10, 1, "bitflip@1.5") and faults.flip_factor("bitflip@1.5") == 1.5
    for bad in ("10:1:bitflip@1", "10:1:bitflip@x", "10:1:bitflip@inf", "10:1:bitflip@"):
        with pytest.raises(ConfigError, match="bitflip@F"):
            parse_injects(bad)
