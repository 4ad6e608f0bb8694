"""The signals ledger through the real CLI: a non-finite loss, W&B and TensorBoard.

(kill -9 + resume of the signals ledger: ``test_resume.py``.)
"""

import math

import pytest
from helpers import (
    CONFIGS,
    explain,
    read_tb,
    read_wandb_history,
    signals_ledger,
    torchrun,
)

from titan_ledger.format.signal_columns import COLUMNS

pytestmark = pytest.mark.slow


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
    ledger = signals_ledger(tmp_path)
    assert [r["step"] for r in ledger.history] == [1, 2]
    assert math.isfinite(ledger.history[0]["loss"]) and math.isnan(ledger.history[1]["loss"])

    # every key with a value reaches the dashboards; QK-clip's and the update norm are null when off
    assert all(r[c.name] is None for r in ledger.history for c in COLUMNS if c.off)
    dashboard_keys = {f"ledger/{c.name}" for c in COLUMNS if c.dashboard and not c.off}  # (the table's)
    # the W&B step (_step) is an event counter; the training step is train/step
    wandb_rows = {r.get("train/step", r["_step"]): r for r in read_wandb_history(tmp_path) if "ledger/loss" in r}
    assert sorted(wandb_rows) == [1, 2]
    for step, row in wandb_rows.items():
        assert dashboard_keys <= set(row), dashboard_keys - set(row)
    assert wandb_rows[1]["ledger/loss"] == pytest.approx(ledger.history[0]["loss"], rel=1e-12)
    assert wandb_rows[1]["ledger/num_zeros"] == ledger.history[0]["num_zeros"]
    tb = read_tb(tmp_path, "ledger/grad_norm")
    assert tb[1] == pytest.approx(ledger.history[0]["grad_norm"], rel=1e-6)
