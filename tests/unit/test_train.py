"""titan_ledger.train: one-line errors, a relaunch's lines, the run's steps (no processes).
The end-of-run summary: test_summary.py; the console: test_console.py."""

import logging
import types

import pytest

from titan_ledger import train
from titan_ledger.errors import ConfigError, TitanLedgerError


def test_main_turns_a_titan_ledger_error_into_one_line_and_exit_2(monkeypatch, capsys):
    def bad(argv):
        raise ConfigError("x.toml: [training] stepz: unknown key")

    monkeypatch.setattr(train, "run", bad)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        train.main(["--job.config_file", "x.toml"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "titan_ledger.train: error: x.toml: [training] stepz: unknown key\n"
    monkeypatch.setenv("RANK", "1")  # the other ranks exit the same way, silently
    with pytest.raises(SystemExit):
        train.main([])
    assert capsys.readouterr().err == ""


def test_main_uses_the_error_exit_code(monkeypatch, capsys):
    class Negative(TitanLedgerError):
        exit_code = 1

    monkeypatch.setattr(train, "run", lambda argv: (_ for _ in ()).throw(Negative("stopped")))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        train.main([])
    assert e.value.code == 1


def test_a_bad_input_error_is_said_by_rank_0_or_by_a_rank_left_alive(monkeypatch, capsys):
    # rank 0 says it at once; under torchrun another rank says it only if it is still alive
    # after the wait (torchrun stops every rank when rank 0 exits); elsewhere it stays silent
    monkeypatch.setattr(train, "SAY_ONCE_WAIT_S", 0.0)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for rank, torchrun, said in (("0", False, True), ("1", False, False), ("1", True, True)):
        monkeypatch.setenv("RANK", rank)
        if torchrun:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
        train._say_once("titan_ledger.train: error: x")
        assert (capsys.readouterr().err == "titan_ledger.train: error: x\n") is said, (rank, torchrun)


def test_a_plain_python_launch_is_one_line_naming_the_launcher(tmp_path, monkeypatch):
    """``python -m titan_ledger.train`` without torchrun: no LOCAL_RANK, one line, exit 2
    (torchtitan's own ``ValueError: LOCAL_RANK must be set`` traceback before)."""
    from helpers import CONFIGS, cli

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    rc, out, err = cli(train.main, ["--job.config_file", str(CONFIGS / "debug_cpu.toml"),
                                    "--parallelism.data_parallel_shard_degree", "-1",
                                    "--dump_folder", str(tmp_path / "run")])
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titan_ledger.train: error: LOCAL_RANK is not set"), err
    assert "python -m titan_ledger.launch --nproc 1" in lines[0] and "RANK=0 LOCAL_RANK=0" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written


# ---- a relaunch says what it changes (issue 70): config/launch_diff.py's lines, from the files

TOUR = ["--job.config_file", "train_configs/debug_cpu.toml", "--training.steps", "12", "--checkpoint.enable",
        "--checkpoint.interval", "4", "--ledger.spike.window", "8", "--ledger.rehearsal.inject", "8:1:repeat"]


def _recorded_run(dump, argv, cwd, checkpoints=(4, 8, 12)):
    """A dump folder as the tour's step 1 leaves it: the launch log's row with the flags
    (segments.jsonl, as ``records.append_segment`` writes it) and complete checkpoints."""
    import json

    from titan_ledger.format import records

    led = dump / "ledger"
    led.mkdir(parents=True)
    row = {"run_id": "a", "seq": 1, "resumed_from": 0, "time": 1.0, "config_digest": "d", "world_size": 2,
           "dp_size": 2, "argv": argv, "cwd": str(cwd), "step": 0}
    (led / records.SEGMENTS_FILE).write_text(json.dumps({"schema": records.SEGMENTS.id}) + "\n" + json.dumps(row) + "\n")
    for s in checkpoints:
        (dump / "checkpoint" / f"step-{s}").mkdir(parents=True)
        (dump / "checkpoint" / f"step-{s}" / ".metadata").write_bytes(b"")


@pytest.fixture
def rank0(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")


def test_a_rollback_relaunch_names_what_differs_what_is_expected_and_what_it_replaces(tmp_path, monkeypatch, rank0):
    from helpers import ROOT

    dump = tmp_path / "tour"
    _recorded_run(dump, [*TOUR, "--ledger.proof.scope", "off", "--job.dump_folder", "/moved/away"], ROOT)
    overlay = tmp_path / "rollback.toml"
    overlay.write_text("[checkpoint]\nload_step = 4\n\n[ledger.skip]\nsteps = [\"8\"]\n")
    config, _ = train.parse_flags([*TOUR, "--job.overlay", str(overlay), "--job.dump_folder", str(dump)])
    monkeypatch.chdir(tmp_path)  # launched from elsewhere: the recorded config file is the run's own directory's
    log = dump / "ledger" / "segments.jsonl"
    assert train.relaunch_report(config) == [
        ("warning", f"titan_ledger: relaunch: 1 setting differs from the run's recorded launch (segment 1 of {log}): "
                    "--ledger.proof.scope all (was off)"),
        ("info", "titan_ledger: relaunch: expected differences from it: --checkpoint.load_step 4 (was -1: a "
                 "rollback's checkpoint), --ledger.skip.steps 8 (was none: a rollback's skip window)"),
        ("info", "titan_ledger: this relaunch rewinds to step-4: checkpoints step-8, step-12 of the old trajectory "
                 "will be replaced as the run passes them")]


def test_a_comparison_that_fails_is_a_warning_not_a_failed_launch(tmp_path, rank0, caplog):
    from helpers import ROOT

    dump = tmp_path / "run"
    _recorded_run(dump, ["--job.config_file", "train_configs/gone.toml"], ROOT, checkpoints=())
    config, _ = train.parse_flags([*TOUR, "--job.dump_folder", str(dump)])
    caplog.set_level(logging.INFO, logger=train.log.name)
    train.say_relaunch(config)
    [rec] = caplog.records
    assert rec.levelno == logging.WARNING and rec.getMessage().startswith(
        "titan_ledger: relaunch: not compared with the run's recorded launch (ConfigError: "), rec.getMessage()
    assert rec.getMessage().endswith("; training goes on") and "gone.toml: no such config file" in rec.getMessage()
    caplog.clear()
    config.ledger.new_run = True  # the old run is moved aside: a new run, nothing to compare
    train.say_relaunch(config)
    assert not caplog.records


def test_an_empty_comm_traces_folder_is_removed_a_dump_is_kept(tmp_path):
    cfg = types.SimpleNamespace(dump_folder=str(tmp_path), comm=types.SimpleNamespace(save_traces_folder="comm_traces"))
    (tmp_path / "comm_traces").mkdir()
    train.drop_empty_traces(cfg)
    assert not (tmp_path / "comm_traces").exists()
    train.drop_empty_traces(cfg)  # gone already (another rank's): nothing to do
    (tmp_path / "comm_traces").mkdir()
    (tmp_path / "comm_traces" / "rank_0").write_text("flight recorder dump")
    train.drop_empty_traces(cfg)
    assert (tmp_path / "comm_traces" / "rank_0").exists()
