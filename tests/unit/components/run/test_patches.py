"""titan_ledger.components.run.patches: each torchtitan global is swapped for the call
only and put back on exit, an error included."""

from __future__ import annotations

import time

import pytest

from titan_ledger.components.run import patches
from titan_ledger.rehearsal import backend


def test_the_final_sleep_is_skipped_on_the_cpu_for_the_call_only():
    backend.ensure_installed()
    import torchtitan.trainer as tt

    assert backend.installed() == "cpu" and tt.time is time
    with patches.no_final_sleep_on_cpu():
        t0 = time.perf_counter()
        tt.time.sleep(5)  # torchtitan's `time.sleep(2)` after the last step
        assert time.perf_counter() - t0 < 1 and tt.time.perf_counter() > 0  # the rest of `time` is time's
    assert tt.time is time
    with pytest.raises(RuntimeError), patches.no_final_sleep_on_cpu():
        raise RuntimeError("training stopped")
    assert tt.time is time


def test_a_dry_run_builds_on_meta_for_the_call_only():
    backend.ensure_installed()
    import torchtitan.tools.utils as tt_utils

    before = tt_utils.device_type
    with pytest.raises(RuntimeError), patches.meta_materialization():
        assert tt_utils.device_type == "meta"
        raise RuntimeError("the build failed")
    assert tt_utils.device_type == before
