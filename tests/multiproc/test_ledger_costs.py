"""Ledger.record's cost on real gloo ranks: two collectives, no host reads.

Each rank shards a small model with FSDP2, runs a backward, and calls
``Ledger.record`` with every collective and every tensor->host read counted
(``item``, ``tolist``, ``__float__``, ``__int__``, ``__bool__``, ``cpu``, ``numpy``).
On CUDA a host read is a blocking synchronisation; the GPU script
``bench/device/check_flex_max_logit.py`` checks the same with
``torch.cuda.set_sync_debug_mode("error")``.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port

pytestmark = pytest.mark.slow

HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_ledger import ledger as ledger_mod
    from titan_ledger.ledger import Ledger
    from titan_ledger.signals import ParamPlan

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 8)).sum().backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()

    led = Ledger(Ledger.Config(per_layer=True))
    led.enabled, led.device, led.world, led.rank = True, torch.device("cpu"), world, rank
    led.dp_size, led.dp_rank, led.max_norm, led.owns_loss, led.global_batch = world, rank, 1.0, True, 8
    led.owns_tokens = True
    led._cuda, led._attn = False, []
    led.plan = ParamPlan.build(model.named_parameters(), world, 1)
    led._consumed_tokens = torch.zeros((), dtype=torch.float64)

    calls = {"all_reduce": 0, "other_collectives": 0, "host_reads": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*a, **k):
        calls["all_reduce"] += 1
        return real_all_reduce(*a, **k)

    saved = {n: getattr(torch.Tensor, n) for n in HOST_READS}

    def counting(name):
        def f(self, *a, **k):
            calls["host_reads"] += 1
            return saved[name](self, *a, **k)
        return f

    ledger_mod.dist.all_reduce = counting_all_reduce
    for n in HOST_READS:
        setattr(torch.Tensor, n, counting(n))
    try:
        led.record(step=1, local_loss_sum=torch.tensor(2.0 + rank), local_tokens=torch.tensor(4),
                   grad_norm=grad_norm, lr=1e-3, step_start=time.perf_counter(), data_loading_s=0.0)
    finally:
        ledger_mod.dist.all_reduce = real_all_reduce
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
    pending = led._pending[0]
    if rank == 0:
        out.put((calls, [t.tolist() for t in pending.host]))
    dist.destroy_process_group()


def test_record_is_two_collectives_and_no_host_reads():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    calls, host = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    assert calls == {"all_reduce": 2, "other_collectives": 0, "host_reads": 0}, calls
    packed_sum, packed_max, extra = host
    assert packed_sum[:2] == [2.0, 3.0]  # loss sums by DP rank, one from each rank
    assert packed_sum[2:4] == [4.0, 4.0]  # tokens by DP rank
    assert extra[2] == 8.0  # consumed tokens on device
