"""FSDP2 over gloo with the rehearsal's SUM reduction equals unsharded gradients.

gloo has no PREMUL_SUM, which FSDP2 uses once torchtitan sets the divide factor to
1 (the loss is already normalised by global tokens); ``backend.sum_reduction``
switches every FSDP module to SUM + post-divide. Two real gloo processes each take
half of a batch; the unsharded reference takes the whole batch in one process.
Both variants (with and without the wrapper) run in one pair of processes.
"""

import os

import pytest
import torch
import torch.distributed as dist
from helpers import spawn_gloo

pytestmark = pytest.mark.slow


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_ledger.rehearsal.backend import sum_reduction

    mesh = init_device_mesh("cpu", (world,))

    def parallelize(model):
        # as torchtitan does: shard, then no FSDP division (the loss is already
        # normalised by the global token count), i.e. PREMUL_SUM(1.0)
        from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        disable_fsdp_gradient_division(model)
        return model

    results = {}
    for force_sum in (True, False):  # the failing variant last
        model = (sum_reduction(parallelize) if force_sum else parallelize)(_model())
        x, y = _batch()
        part = slice(rank * 3, rank * 3 + 3)
        try:
            # local sum / global count, torchtitan's normalisation
            (torch.nn.functional.mse_loss(model(x[part]), y[part], reduction="sum") / y.numel()).backward()
            # plain lists: a tensor in a Queue is shared by fd and dies with this process
            results[force_sum] = ("ok", {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()})
        except Exception as e:
            results[force_sum] = ("error", repr(e))
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    """{force_sum: ("ok", grads) or ("error", repr)} from two gloo processes."""
    return spawn_gloo(_worker)


def test_sum_reduction_matches_unsharded_average(results):
    status, grads = results[True]
    assert status == "ok", grads
    model = _model()
    x, y = _batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(torch.tensor(grads[name]), p.grad, rtol=1e-5, atol=1e-6)


def test_default_reduction_is_what_gloo_lacks(results):
    """Without the wrapper FSDP2 asks gloo for PREMUL_SUM: why the wrapper exists."""
    status, detail = results[False]
    assert status == "error" and "PREMUL_SUM" in detail, detail
