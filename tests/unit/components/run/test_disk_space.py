"""``components.disk_space``: what a run will write, against the free space (issue 37)."""

from types import SimpleNamespace

import torch

from titan_ledger.components.run import disk_space
from titan_ledger.components.run.disk_space import Estimate, checkpoints_held, estimate, shortfall
from titan_ledger.components.signals.topology import Topology


def test_checkpoints_held_at_the_peak():
    assert checkpoints_held(0, 20, 10, 10, 0) == 2  # steps 10 and 20
    assert checkpoints_held(0, 25, 10, 10, 0) == 3  # 10, 20 and the last step
    assert checkpoints_held(0, 100, 10, 3, 0) == 4  # keep 3, the 4th written before the oldest goes
    assert checkpoints_held(0, 100, 10, 0, 0) == 10  # keep_latest_k 0 keeps all
    assert checkpoints_held(30, 50, 10, 0, 3) == 5  # a resume at 30: 3 there, 40 and 50 to come
    assert checkpoints_held(50, 50, 10, 0, 5) == 5  # nothing left to train
    assert checkpoints_held(0, 25, 0, 0, 0) == 1  # no interval: the last step's alone
    assert checkpoints_held(0, 5, 10, 0, 0) == 1  # shorter than the interval: the last step's
    # counted, not listed (a 10^9-step config built 2 x 10^8 step numbers: 18 GB, 28 s)
    assert checkpoints_held(0, 10**12, 5, 0, 0) == 2 * 10**11


def test_estimate_and_the_warning():
    est = estimate(param_bytes=25_000_000, optimizer_states=2, start_step=0, steps=20, interval=10,
                   keep_latest_k=10, existing=0, checkpoints_on=True, world=2, dp=2)
    per_step = 2 * disk_space.LEDGER_BYTES_PER_STEP_PER_DP_RANK + disk_space.SIGNALS_BYTES_PER_STEP + \
        2 * disk_space.STRUCTURED_LOG_BYTES_PER_STEP_PER_RANK
    assert est == Estimate(75_000_000, 2, per_step, 20) and est.total == 150_000_000 + 20 * per_step
    assert shortfall(est, est.total, "/d") is None
    line = shortfall(est, 100_000_000, "/d")
    assert line.startswith("titan_ledger: warning: /d has 100.0 MB free but this run will need about 151.")
    assert "2 checkpoint(s) of 75.0 MB held at once" in line and "--job.dump_folder" in line
    assert shortfall(est, 100_000_000, "/d", already=75_000_000) is None  # one checkpoint is already there
    off = estimate(25_000_000, 2, 0, 20, 10, 10, 0, False, 2, 2)
    assert off.checkpoints == 0 and off.total == 20 * per_step


def test_rank0_warns_with_its_model_and_folder(tmp_path):
    """The seam on a real model and a real folder: a run too long for any disk warns."""
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 fp32 parameters
    ck = SimpleNamespace(enable=True, folder="checkpoint", interval=10, keep_latest_k=0)
    trainer = SimpleNamespace(
        ledger=SimpleNamespace(topo=Topology(world=2, rank=0, dp_size=2)), model_parts=[model],
        optimizers=SimpleNamespace(optimizers=[torch.optim.AdamW(model.parameters())]), step=1,
        config=SimpleNamespace(checkpoint=ck, dump_folder=str(tmp_path / "run"), training=SimpleNamespace(steps=10**9)))
    line = disk_space.warn_at_start(trainer)
    assert line is not None and f"{tmp_path / 'run'} has " in line and "checkpoint(s) of 12.0 MB" in line, line
    trainer.config.training.steps = 2
    assert disk_space.warn_at_start(trainer) is None  # 1 checkpoint of 12 MB fits
    trainer.ledger.topo = Topology(world=2, rank=1, dp_size=2)
    trainer.config.training.steps = 10**9
    assert disk_space.warn_at_start(trainer) is None  # rank 0 says it, once


def test_the_launcher_estimates_from_the_config_alone(tmp_path, monkeypatch):
    """Before any rank starts: the model built on the meta device gives the checkpoint the
    trainer measures on its live parameters (debug_cpu: 74.0 MB, AdamW's two moments)."""
    from titan_ledger import train

    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    config, _ = train.load_config(["--job.config_file", "train_configs/debug_cpu.toml", "--checkpoint.enable",
                           "--checkpoint.interval", "5", "--job.dump_folder", str(tmp_path / "run"),
                           "--training.steps", str(10**9)], files=False)
    line = disk_space.warn_before_launch(config, world=2)
    assert line is not None and "checkpoint(s) of 74.0 MB held at once" in line, line
    config.training.steps = 10
    assert disk_space.warn_before_launch(config, world=2) is None  # 3 x 74 MB: fits this disk


# ---- a full disk: /dev/full answers every write(2) with a real ENOSPC


def test_a_ledger_line_that_hits_a_full_disk_names_its_file():
    import errno

    import pytest

    from titan_ledger.format.records import SIGNALS, Header, RecordWriter

    with pytest.raises(OSError) as got:
        RecordWriter("/dev/full", Header(schema=SIGNALS.id, run_id="r"))
    assert got.value.errno == errno.ENOSPC and got.value.filename == "/dev/full"


def test_the_first_full_disk_log_call_raises_and_the_rest_are_silent(capsys):
    import errno
    import logging

    import pytest

    disk_space.guard_logging()
    disk_space.guard_logging()  # idempotent
    log = logging.getLogger("titan_ledger.test_full_disk")
    handler = logging.FileHandler("/dev/full")
    log.addHandler(handler)
    log.propagate = False
    saved = list(disk_space._seen_full)
    disk_space._seen_full.clear()
    try:
        with pytest.raises(OSError) as got:
            log.warning("first")
        assert got.value.errno == errno.ENOSPC and got.value.filename == "/dev/full"
        for i in range(50):
            log.warning("again %d", i)  # no "--- Logging error ---" per call
        assert "Logging error" not in capsys.readouterr().err
        assert disk_space.enospc_of(RuntimeError("wrapped")) is None
        wrapped = RuntimeError("in a step")
        wrapped.__context__ = got.value
        assert disk_space.enospc_of(wrapped) is got.value
        ckpt = RuntimeError("CheckpointException")
        ckpt.failures = {1: (got.value, "traceback")}  # DCP's per-rank failures
        assert disk_space.enospc_of(ckpt) is got.value
    finally:
        log.removeHandler(handler)
        try:
            handler.close()  # its buffer still cannot be flushed (logging.shutdown ignores that too)
        except OSError:
            pass
        disk_space._seen_full[:] = saved


def test_the_full_disk_line(tmp_path):
    import errno
    import os

    line = disk_space.full_disk_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x.jsonl")))
    assert line.startswith(f"disk full: could not write {tmp_path / 'x.jsonl'} (filesystem ")
    assert " free of " in line and "--job.dump_folder" in line and "relaunch the same command" in line
    nameless = disk_space.full_disk_line(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert nameless.startswith(f"disk full: could not write a file in {tmp_path} (filesystem ")
