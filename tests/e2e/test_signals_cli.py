"""The signals ledger through the real CLI: dashboards, non-finite loss, kill -9 + resume."""

import math
import time

import pytest

from helpers import (
    CONFIGS,
    explain,
    kill9_tree,
    read_tb,
    read_wandb_history,
    torchrun,
    torchrun_popen,
)
from titan_ledger.records import SIGNAL_KEYS, read_ledger

pytestmark = pytest.mark.slow

DASHBOARD_KEYS = {f"ledger/{k}" for k in SIGNAL_KEYS if k != "step"}


def test_nonfinite_row_on_disk_and_dashboards(tmp_path):
    """lr 1e12 blows the model up at step 2: the NaN row is written, then the run stops.

    Steps 1 and 2 also reach W&B (offline run file, read back) and TensorBoard
    under ``ledger/``.
    """
    proc = torchrun(["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "5",
                     "--optimizer.lr", "1e12", "--metrics.enable_wandb", "--metrics.enable_tensorboard",
                     "--dump_folder", str(tmp_path)])
    assert proc.returncode != 0, explain(proc)
    assert "loss is not finite (nan) at step 2" in proc.stdout + proc.stderr, explain(proc)
    ledger = read_ledger(tmp_path / "ledger" / "signals.jsonl")
    assert [r["step"] for r in ledger.history] == [1, 2]
    assert math.isfinite(ledger.history[0]["loss"]) and math.isnan(ledger.history[1]["loss"])

    wandb_rows = {r["_step"]: r for r in read_wandb_history(tmp_path) if "ledger/loss" in r}
    assert sorted(wandb_rows) == [1, 2]
    for step, row in wandb_rows.items():
        assert DASHBOARD_KEYS <= set(row), DASHBOARD_KEYS - set(row)
    assert wandb_rows[1]["ledger/loss"] == pytest.approx(ledger.history[0]["loss"], rel=1e-12)
    assert wandb_rows[1]["ledger/num_zeros"] == ledger.history[0]["num_zeros"]
    tb = read_tb(tmp_path, "ledger/grad_norm")
    assert tb[1] == pytest.approx(ledger.history[0]["grad_norm"], rel=1e-6)


def test_ledger_after_kill9_and_resume(tmp_path):
    """Kill -9 after step 4 (checkpoint at 3), resume: steps 4.. of the lost run are
    superseded history, the new rows continue from the checkpoint and equal an
    uninterrupted run's."""
    common = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "6",
              "--checkpoint.enable", "--checkpoint.interval", "3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    a = torchrun(common + ["--dump_folder", str(straight)])
    assert a.returncode == 0, explain(a)

    run = torchrun_popen(common + ["--dump_folder", str(resumed)])
    signals = resumed / "ledger" / "signals.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        if signals.exists() and any(r["step"] == 4 for r in read_ledger(signals).history):
            break
        time.sleep(0.05)
    kill9_tree(run.pid)
    run.wait()
    lost = read_ledger(signals)
    assert 4 in [r["step"] for r in lost.history] and lost.torn_lines <= 1

    c = torchrun(common + ["--dump_folder", str(resumed)])
    assert c.returncode == 0, explain(c)
    led = read_ledger(signals)
    assert [r["step"] for r in led.history] == [1, 2, 3, 4, 5, 6]
    assert led.segments[-1].header["resumed_from"] == 3
    assert {r["step"] for r in led.superseded} >= {4}
    ref = read_ledger(straight / "ledger" / "signals.jsonl").by_step()
    for row in led.history:
        for key in SIGNAL_KEYS:
            if key not in ("step_time_s", "data_loading_s"):
                assert row[key] == ref[row["step"]][key], (row["step"], key)
