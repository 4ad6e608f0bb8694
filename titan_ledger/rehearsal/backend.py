"""Device backend selection: stock CUDA, or the CPU rehearsal backend.

Design decision: torchtitan 0.3.0 binds ``device_type``/``device_module`` at import
time (``from torchtitan.tools.utils import device_type`` in a dozen modules) and
falls back to ``"cuda"`` when no accelerator exists. The only hook-free way to make
it CPU-aware is to patch ``torchtitan.tools.utils`` *before* any other torchtitan
module is imported. :func:`install` does exactly that, once per process, and every
titan_ledger entry point calls it before importing torchtitan.

The other two CPU gaps are handled where torchtitan has a seam:

* attention: :func:`titan_ledger.components.signals.attention.adapt_config` replaces
  FlexAttention (no CPU backward) in the model config and applies the reduction below;
* FSDP reductions: torchtitan sets FSDP's divide factor to 1, which FSDP2 runs as ``ReduceOp.PREMUL_SUM``; gloo has none, so the model's
  ``parallelize_fn`` is wrapped to switch every FSDP module to sum reduction with
  a post-division (numerically the same average), see :func:`sum_reduction`.

On a CUDA machine with ``device="auto"`` none of this is active.
"""

from __future__ import annotations

import os
import platform
import sys
import types

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
        reset_peak_memory_stats=_noop,  # (the process's peak resident memory cannot be reset)
        memory_stats=resident_memory_stats,
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


def resident_memory_stats(*args, **kwargs) -> dict[str, int]:
    """CHANGED from torchtitan on CPU: the process's resident memory under the keys of
    ``torch.cuda.memory_stats`` that torchtitan's ``DeviceMemoryMonitor.get_peak_stats``
    (``components/metrics.py``) reads; with none it reads -1 bytes and every step line says
    ``memory: -0.00GiB(-0.00%)``. ``reserved_bytes.all.peak`` (the step line's
    ``memory``) is the process's peak resident memory (``ru_maxrss``: what the rank needed,
    as a GPU's peak reserved memory is), ``active_bytes.all.peak`` its resident memory now
    (``/proc/self/statm``; the peak where there is no /proc); against the machine's memory
    (``get_device_properties().total_memory``) for the percentages. No allocator: no
    retries, no OOMs counted."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        now = peak
    return {"active_bytes.all.peak": now, "reserved_bytes.all.peak": max(peak, now),  # (statm counts a page or two more)
            "num_alloc_retries": 0, "num_ooms": 0}


def sum_reduction(parallelize_fn):
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
