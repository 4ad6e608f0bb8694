"""titan_ledger.console: which ranks log, the noise filter, colour codes (no processes)."""

import logging
import os
import types

import pytest

from titan_ledger import console
from titan_ledger.errors import ConfigError


def _cfg(pp=1, schedule="1F1B", mode="default"):
    return types.SimpleNamespace(
        comm=types.SimpleNamespace(mode=mode),
        parallelism=types.SimpleNamespace(pipeline_parallel_degree=pp,
                                          pipeline_parallel_schedule=schedule))


@pytest.mark.parametrize("pp,schedule,world,rank", [
    (1, "1F1B", 4, 0),                 # FSDP / TP: rank 0
    (2, "1F1B", 2, 1),                 # PP 2: the last stage holds the loss
    (2, "Interleaved1F1B", 8, 4),      # PP 2 x DP 4: first rank of the last stage
    (2, "ZBVZeroBubble", 2, 0),        # V schedule: loss on rank 0
])
def test_console_rank_is_torchtitans_metrics_rank(monkeypatch, pp, schedule, world, rank):
    monkeypatch.delenv(console.LOG_RANKS_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert console.console_ranks(_cfg(pp, schedule)) == {rank}


def test_log_ranks_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(console.LOG_RANKS_ENV, "all")
    assert console.console_ranks(_cfg()) is None
    monkeypatch.setenv(console.LOG_RANKS_ENV, "0, 1")
    assert console.console_ranks(_cfg()) == {0, 1}
    monkeypatch.setenv(console.LOG_RANKS_ENV, "zero")
    with pytest.raises(ConfigError, match="TITAN_LEDGER_LOG_RANKS='zero'"):
        console.console_ranks(_cfg())
    monkeypatch.delenv(console.LOG_RANKS_ENV)
    assert console.console_ranks(_cfg(mode="fake_backend")) is None  # one process: all of it


def test_configure_console_keeps_warnings_on_other_ranks(monkeypatch):
    monkeypatch.delenv(console.LOG_RANKS_ENV, raising=False)
    monkeypatch.setenv("LOG_RANK", "")
    monkeypatch.setenv("WORLD_SIZE", "2")
    root = logging.getLogger()
    old = root.level, console.log.level
    try:
        console.configure_console(_cfg(), rank=1)
        assert root.level == logging.WARNING and console.log.level == logging.WARNING
        console.configure_console(_cfg(pp=2), rank=1)  # PP: rank 1 logs the loss
        assert root.level == logging.INFO and console.log.level == logging.WARNING
        assert os.environ["LOG_RANK"] == "1"  # torchtitan's PP "loss is not visible" check
        console.configure_console(_cfg(), rank=0)
        assert root.level == logging.INFO and console.log.level == logging.INFO
    finally:
        root.setLevel(old[0])
        console.log.setLevel(old[1])


def test_noise_filter_drops_only_known_messages():
    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(last_save_in_hf=False))
    f = console._DropNoise([p for p, when in console._NOISE if when(cfg)])

    def rec(msg):
        return logging.LogRecord("root", logging.WARNING, __file__, 1, msg, None, None)

    assert not f.filter(rec("Error running lspci: [Errno 2] No such file or directory: 'lspci', x"))
    assert not f.filter(rec("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config"))
    assert not f.filter(rec("initial_load_model_only=True has no effect without an initial_load_path."))
    assert f.filter(rec("ENV[TORCH_NCCL_DUMP_ON_TIMEOUT] = 0 will be overridden to 1 based on job config"))
    assert f.filter(rec("Warmup (2) + decay (2) steps exceed total steps (3). Adjusting decay steps to 1."))


def test_console_output_that_is_not_a_terminal_has_no_colour_codes_and_dcp_rewrites_say_nothing(tmp_path, monkeypatch):
    """The step line's colours (torchtitan's ``Color``) are stripped for a file or a pipe and
    kept for a terminal; torch's DCP "Detected an existing checkpoint" warning is folded into
    the relaunch's one line (a real ``dcp.save`` twice into one folder)."""
    import io
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torchtitan.tools.utils import Color

    class Tty(io.StringIO):
        def isatty(self):
            return True

    to_file, to_tty = logging.StreamHandler(io.StringIO()), logging.StreamHandler(Tty())
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [to_file, to_tty])
    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(last_save_in_hf=False))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet_run(cfg)
        c = Color()
        root.warning("%sstep: %2d  %sloss: %8.5f%s", c.red, 1, c.green, 8.06102, c.reset)
        for _ in range(2):
            dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "step-4"))
    assert to_file.stream.getvalue() == "step:  1  loss:  8.06102\n"
    assert to_tty.stream.getvalue() == "\x1b[31mstep:  1  \x1b[32mloss:  8.06102\x1b[39m\n"
    assert not [w for w in seen if "Detected an existing checkpoint" in str(w.message)], [str(w.message) for w in seen]
