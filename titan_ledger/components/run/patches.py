"""The two torchtitan 0.3.0 module globals titan_ledger swaps for one call only.

Design decision: a patch of a torchtitan global is a last resort (no hook exists), so
every swap for a call lives in this file, as a context manager that restores the
global on exit, and each names the torchtitan spot it changes (``CHANGED spot``).
``LedgerTrainer`` enters them around ``Trainer.__init__`` (dry run) and
``Trainer.train`` (CPU). The only other torchtitan globals we set are the CPU
rehearsal backend's ``device_type``/``device_module``, bound once for the process
before torchtitan binds them (``rehearsal/backend.py``: a device, not a call).
"""

from __future__ import annotations

import contextlib
import time

from titan_ledger.rehearsal import backend


@contextlib.contextmanager
def no_final_sleep_on_cpu():
    """On the CPU rehearsal backend, skip the 2 s that rank 0 of torchtitan 0.3.0's
    ``Trainer.train`` sleeps after the last step ("for other ranks to complete"): on CPU
    nothing is in flight, and every launch of the test suite paid them (a CPU launch of a
    few steps takes 15-20 s).
    torchtitan has no hook for it: its module's ``time`` is swapped for the call only
    (CHANGED spot: ``torchtitan/trainer.py`` ``time.sleep(2)``); on CUDA nothing changes."""
    import torchtitan.trainer as tt

    if backend.installed() != "cpu" or getattr(tt, "time", None) is not time:
        yield
        return

    class _Time:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds):
            pass

    tt.time = _Time()
    try:
        yield
    finally:
        tt.time = time


@contextlib.contextmanager
def meta_materialization():
    """Dry run: build every shard on the meta device instead of allocating it.

    torchtitan's fake backend moves no data, so real weights would only cost time
    (initialising 70B / 64 ranks of fp32 takes many minutes on a CPU). Trainer
    reads ``utils.device_type`` when it picks the init device; pointing it at
    "meta" for the duration of ``__init__`` keeps every other step real: meshes,
    TP/FSDP/PP wrapping, init functions, optimizer, dataloader, checkpointer.
    """
    import torchtitan.tools.utils as tt_utils

    saved = tt_utils.device_type
    tt_utils.device_type = "meta"
    try:
        yield
    finally:
        tt_utils.device_type = saved
