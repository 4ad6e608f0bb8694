"""The CPU rehearsal backend: device patch, config adaptation (no processes)."""

import pytest

from titan_ledger import config_registry
from titan_ledger.components.signals import attention
from titan_ledger.components.signals.attention import CpuAttention
from titan_ledger.rehearsal import backend


def test_torchtitan_sees_cpu_everywhere():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils

    assert backend.installed() == "cpu"
    for mod in (tt_utils, dist_utils, parallel_dims, metrics):
        assert mod.device_type == "cpu", mod.__name__
    assert dist_utils.device_module.device_count() == 1
    assert dist_utils.device_module.get_device_properties(0).total_memory > 0


def test_torchtitans_memory_monitor_reads_the_process_resident_memory_on_cpu():
    """The step line's ``memory`` (torchtitan's ``DeviceMemoryMonitor``, through the CPU
    device module): this process's peak resident memory, never -1 bytes (``-0.00GiB``)."""
    import resource
    import sys

    from torchtitan.components.metrics import DeviceMemoryMonitor

    stats = DeviceMemoryMonitor("cpu").get_peak_stats()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    assert 0.5 * rss <= stats.max_reserved_gib * 2**30 <= 2 * rss and 0 < stats.max_reserved_pct < 100
    assert 0 < stats.max_active_gib <= stats.max_reserved_gib
    assert (stats.num_alloc_retries, stats.num_ooms) == (0, 0)


def test_cannot_switch_backend_after_install():
    with pytest.raises(RuntimeError, match="already installed as 'cpu'"):
        backend.install("cuda")
    assert backend.install("cpu") == "cpu"


def test_check_names_the_flag():
    backend.check("auto")
    backend.check("cpu")
    with pytest.raises(ValueError, match="--ledger.device cuda"):
        backend.check("cuda")


def test_adapt_config_swaps_attention_and_reduction():
    config = config_registry.llama3_8b()
    attention.adapt_config(config)
    inner = [c for _, c, _, _ in config.model_spec.model.traverse(CpuAttention.Config)]
    assert len(inner) == 32  # one per layer of the 8B model
    fn = config.model_spec.parallelize_fn
    assert fn._titan_ledger_sum_reduction
    attention.adapt_config(config)  # idempotent: no double wrapping
    assert config.model_spec.parallelize_fn is fn
    assert config.training.disable_cuda_graphs and not config.compile.enable
    assert attention.uses_cpu_attention(config.model_spec.model)


def test_config_build_makes_a_ledger_trainer():
    from titan_ledger.trainer import LedgerTrainer

    config = config_registry.debug_cpu()
    assert type(config) is LedgerTrainer.Config
    assert LedgerTrainer.Config._owner is LedgerTrainer
    assert config.ledger.device == "auto"
    # every Trainer field survives the re-homing, with the same values
    base = config_registry.llama3.llama3_debugmodel()
    # the optimizer config is re-homed too (LedgerOptimizers adds the weight-decay presets):
    # every torchtitan field the same, the preset off
    import dataclasses

    from titan_ledger.components.prevention.optimizer import LedgerOptimizers

    assert type(config.optimizer) is LedgerOptimizers.Config and config.optimizer.no_decay == "none"
    assert all(getattr(config.optimizer, f.name) == getattr(base.optimizer, f.name)
               for f in dataclasses.fields(type(base.optimizer)))
    assert config.lr_scheduler == base.lr_scheduler
