"""Device backend selection: stock CUDA, or the CPU rehearsal backend.

Design decision: torchtitan 0.3.0 binds ``device_type``/``device_module`` at import
time (``from torchtitan.tools.utils import device_type`` in a dozen modules) and
falls back to ``"cuda"`` when no accelerator exists. The only hook-free way to make
it CPU-aware is to patch ``torchtitan.tools.utils`` *before* any other torchtitan
module is imported. :func:`install` does exactly that, once per process, and every
titan_ledger entry point calls it before importing torchtitan.

The other two CPU gaps are handled where torchtitan has a seam:

* attention: :mod:`titan_ledger.attention` replaces FlexAttention (no CPU
  backward) in the model config, see :func:`adapt_config`;
* FSDP reductions: torchtitan sets FSDP's divide factor to 1, which FSDP2 runs as ``ReduceOp.PREMUL_SUM``; gloo has none, so the model's
  ``parallelize_fn`` is wrapped to switch every FSDP module to sum reduction with
  a post-division (numerically the same average), see :func:`_sum_reduction`.

On a CUDA machine with ``device="auto"`` none of this is active.
"""

from __future__ import annotations

import os
import platform
import sys
import types
from dataclasses import replace

ENV_VAR = "TITAN_LEDGER_DEVICE"

_installed: str | None = None


def resolve(device: str | None = None) -> str:
    """Turn ``auto``/None (or the ``TITAN_LEDGER_DEVICE`` env var) into cpu|cuda."""
    device = device or os.environ.get(ENV_VAR) or "auto"
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(
            f"device {device!r} is not one of auto, cpu, cuda "
            f"(set --ledger.device or {ENV_VAR})"
        )
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def installed() -> str | None:
    """The backend installed in this process, or None."""
    return _installed


def ensure_installed() -> str:
    """Install the default backend unless an entry point already chose one."""
    return _installed if _installed is not None else install()


def check(requested: str) -> None:
    """Fail if the config's ``ledger.device`` disagrees with the installed backend."""
    if requested != "auto" and requested != _installed:
        raise ValueError(
            f"--ledger.device {requested} was requested, but this process runs the "
            f"{_installed!r} backend (chosen before torchtitan was imported). Launch "
            f"through `python -m titan_ledger.train`, or set {ENV_VAR}={requested}."
        )


def install(device: str | None = None) -> str:
    """Select the backend for this process; must run before torchtitan modules import.

    Idempotent for the same choice; asking for another backend after one is
    installed is an error, since torchtitan has already bound the first one.
    """
    global _installed
    chosen = resolve(device)
    if _installed is not None:
        if chosen != _installed:
            raise RuntimeError(
                f"titan_ledger backend already installed as {_installed!r}; cannot "
                f"switch to {chosen!r} in the same process"
            )
        return _installed
    if chosen == "cpu":
        bound = [
            m
            for m in sys.modules
            if m.startswith("torchtitan.") and m not in _EARLY_TORCHTITAN_MODULES
        ]
        if bound:
            raise RuntimeError(
                "the CPU backend must be installed before torchtitan modules are "
                f"imported (already imported: {', '.join(sorted(bound)[:5])})"
            )
        import torchtitan.tools.utils as tt_utils

        tt_utils.device_type = "cpu"
        tt_utils.device_module = _cpu_device_module()
    _installed = chosen
    return chosen


# Importing torchtitan.tools.utils pulls these in; none of them binds device_type.
_EARLY_TORCHTITAN_MODULES = {
    "torchtitan.tools",
    "torchtitan.tools.utils",
    "torchtitan.tools.logging",
    "torchtitan.observability",
    "torchtitan.observability.structured_logger",
}


def _cpu_device_module() -> types.ModuleType:
    """A ``torch.cpu`` look-alike with the CUDA-module calls torchtitan makes."""
    import torch

    mod = types.ModuleType("titan_ledger_cpu_device")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def _noop(*args, **kwargs):
        return None

    def _no_memory_history(*args, **kwargs):
        raise RuntimeError(
            "memory snapshots need CUDA; set --profiler.no-enable-memory-snapshot on CPU"
        )

    mod.__dict__.update(
        is_available=lambda: True,
        device_count=lambda: 1,  # one "device" per process: get_local_device -> cpu:0
        current_device=lambda: 0,
        set_device=_noop,
        synchronize=_noop,
        empty_cache=_noop,
        reset_peak_memory_stats=_noop,
        memory_stats=lambda *a, **k: {},
        get_device_name=lambda *a, **k: platform.processor() or platform.machine() or "cpu",
        get_device_properties=lambda *a, **k: types.SimpleNamespace(
            name="cpu", total_memory=total
        ),
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        memory=types.SimpleNamespace(
            _record_memory_history=_no_memory_history, _snapshot=_no_memory_history
        ),
    )
    # Anything else (Stream, Event, ...) falls through to torch.cpu.
    mod.__getattr__ = lambda name: getattr(torch.cpu, name)  # type: ignore[attr-defined]
    return mod


def adapt_config(config) -> None:
    """Rewrite a Trainer config in place for the installed backend (CPU only).

    Swaps every FlexAttention/Varlen inner attention for the CPU masked attention,
    wraps ``parallelize_fn`` so FSDP reduces with SUM (gloo), and turns off the
    GPU-only features (CUDA graphs, compile, mixed-precision casts to bf16 that
    CPU matmuls do not need).
    """
    if _installed != "cpu":
        return
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    from titan_ledger.attention import CpuAttention

    spec = config.model_spec
    if spec is None:
        raise ValueError("config.model_spec is not set; build configs via a config function")
    model_cfg = spec.model
    for cls in (FlexAttention.Config, VarlenAttention.Config):
        for _fqn, _cfg, parent, attr in list(model_cfg.traverse(cls)):
            if parent is not None:
                if isinstance(parent, list):
                    parent[attr] = CpuAttention.Config()
                else:
                    setattr(parent, attr, CpuAttention.Config())
    fn = spec.parallelize_fn
    if not getattr(fn, "_titan_ledger_sum_reduction", False):
        spec = replace(spec, parallelize_fn=_sum_reduction(fn))
    config.model_spec = spec
    config.training.disable_cuda_graphs = True
    config.compile.enable = False


def _sum_reduction(parallelize_fn):
    """Wrap ``parallelize_fn``: FSDP modules reduce with SUM + post-divide (gloo)."""

    def wrapped(model, *args, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, *args, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return model

    wrapped._titan_ledger_sum_reduction = True  # type: ignore[attr-defined]
    return wrapped


def use_max_logit_attention(config) -> None:
    """GPU: swap FlexAttention for ``LedgerFlexAttention`` (Flex ``max_scores``)."""
    from torchtitan.models.common.attention import FlexAttention

    from titan_ledger.attention import LedgerFlexAttention

    model_cfg = config.model_spec.model
    for _fqn, cfg, parent, attr in list(model_cfg.traverse(FlexAttention.Config)):
        if parent is None or isinstance(cfg, LedgerFlexAttention.Config):
            continue
        if cfg.kernel_options.get("BACKEND") == "FLASH":
            raise ValueError(
                "--ledger.max_logit needs FlexAttention's Triton backend: torch 2.14 cannot "
                "return max scores with BACKEND='FLASH' (attn_backend 'flex_flash'). Use "
                "attn_backend 'flex' or set --ledger.no_max_logit."
            )
        new = LedgerFlexAttention.Config(block_size=cfg.block_size, kernel_options=cfg.kernel_options)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)


def uses_cpu_attention(model_config) -> bool:
    from titan_ledger.attention import CpuAttention

    return any(True for _ in model_config.traverse(CpuAttention.Config))
