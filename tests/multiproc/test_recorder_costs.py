"""SignalRecorder on real gloo ranks: one collective per step, no host reads, and the
gradient signals equal to the unsharded values.

``record``'s cost is the product's promise (no blocking device->host copy, one
collective): every collective and every tensor->host read (``item``, ``tolist``,
``__float__``, ``__int__``, ``__bool__``, ``cpu``, ``numpy``) is counted around it.
On CUDA a host read is a blocking synchronisation; ``bench/device/run.sh`` checks the
same with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from titan_ledger.components.signals.recorder import SLOTS, SignalRecorder, reduced_slots
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.sums import ParamPlan
from titan_ledger.components.signals.topology import Topology

pytestmark = pytest.mark.slow

HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_ledger.components.signals import recorder as recorder_mod

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 8)).sum().backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()
    topo = Topology(world=world, rank=rank, dp_size=world, dp_rank=rank, dp_rank_of=tuple(range(world)),
                    loss_rank_of_dp=tuple(range(world)))
    plan = ParamPlan.build(model.named_parameters(), world, 1)
    groups = plan.groups
    plan = ParamPlan.build(model.named_parameters(), world, 1, groups)
    rec = SignalRecorder(topo, device=torch.device("cpu"), plan=plan, attn=[], per_layer=True,
                         max_logit=True, max_norm=1e9, global_batch=8, seq_len=4)  # grads not clipped here
    calls = {"collectives": 0, "host_reads": 0}
    names = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast", "reduce_scatter_tensor")
    real = {n: getattr(recorder_mod.dist, n) for n in names}

    def counting_collective(n):
        def f(*a, **k):
            calls["collectives"] += 1
            return real[n](*a, **k)
        return f

    saved = {n: getattr(torch.Tensor, n) for n in HOST_READS}

    def counting(name):
        def f(self, *a, **k):
            calls["host_reads"] += 1
            return saved[name](self, *a, **k)
        return f

    for n in names:
        setattr(recorder_mod.dist, n, counting_collective(n))
    for n in HOST_READS:
        setattr(torch.Tensor, n, counting(n))
    try:
        red = rec.reduce(local_loss_sum=torch.tensor(2.0 + rank), local_tokens=4, grad_norm=grad_norm)
        rec.queue(StepRecord(step=1, start=time.perf_counter(), lr=1e-3), red.vector, None)
    finally:
        for n, f in real.items():
            setattr(recorder_mod.dist, n, f)
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
    # the unsharded reference of the gradient signals
    full = {n: (p.grad.full_tensor(), p.full_tensor()) for n, p in model.named_parameters()}
    ref = {"zeros": sum(int((g == 0).sum()) for g, _ in full.values()),
           "param_sq": sum(float(p.detach().double().square().sum()) for _, p in full.values()),
           "grad_sq": sum(float(g.double().square().sum()) for g, _ in full.values())}
    if rank == 0:
        out.put((calls, red.vector.tolist(), float(red.loss), ref))
    dist.destroy_process_group()


def test_record_is_one_collective_and_no_host_reads_on_gloo_ranks():
    from helpers import spawn_gloo

    calls, v, loss, ref = spawn_gloo(_worker)
    assert calls == {"collectives": 1, "host_reads": 0}, calls
    assert v[:2] == [2.0, 3.0]  # loss sums by DP rank, one from each rank
    assert v[2:4] == [4.0, 4.0]  # tokens by DP rank
    assert loss == 5.0 / 8.0
    s = reduced_slots(v, 2)  # the named slots (their order is the table's)
    assert s["num_zeros"] == ref["zeros"] and math.isclose(s["param_sq"], ref["param_sq"], rel_tol=1e-6)
    assert s["max_logit"] == float("-inf") and s["consumed_tokens"] == 8.0
    # no loss of ours here: log Z not measured
    assert s["masked_tokens"] == 0.0 and (s["logz_sq"], s["logz_sum"], s["logz_max"], s["logz_tokens"]) == \
        (0.0, 0.0, float("-inf"), 0.0)
    assert math.isnan(s["qk_clip_heads"]) and math.isnan(s["qk_clip_eta_min"])  # QK-clip: off
    per_layer = v[4 + len(SLOTS):]
    assert math.isclose(sum(per_layer), ref["grad_sq"], rel_tol=1e-6)  # per-layer grad sums of squares
    assert math.isclose(s["grad_norm"], math.sqrt(ref["grad_sq"]), rel_tol=1e-5)
