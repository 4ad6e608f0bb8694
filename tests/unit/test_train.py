"""titan_ledger.train: end-of-run summary, console rank filter, one-line errors (no processes)."""

import logging
import os
import types

import pytest

from titan_ledger import train
from titan_ledger.errors import ConfigError, TitanLedgerError
from titan_ledger.format.records import DATA, SIGNALS, SPIKES, RecordWriter


def _write(path, schema, rows, **header):
    w = RecordWriter(path, {"schema": schema, "run_id": "r1", "resumed_from": 0, "seq": 1, **header})
    for r in rows:
        w.write(r)
    w.close()


def _tiny_ledger(dump, *, spike_at=None, dp=2, steps=3):
    led = dump / "ledger"
    _write(led / "signals.jsonl", SIGNALS.id,
           [{"step": s, "loss": 8.0, "spike": s == spike_at} for s in range(1, steps + 1)])
    for r in range(dp):
        _write(led / f"data_dp{r}.jsonl", DATA.id,
               [{"step": s, "skipped": False, "rows": [[s * 10 + r, 0, [[1, 0, 5]]]]}
                for s in range(1, steps + 1)], dp_rank=r)
    if spike_at is not None:
        _write(led / "spikes.jsonl", SPIKES.id, [{"step": spike_at, "rules": ["zscore"]}])
    return led


def test_run_summary_counts_rows_spikes_checkpoints_and_names_commands(tmp_path):
    _tiny_ledger(tmp_path, spike_at=2)
    for step in (2, 3):
        (tmp_path / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").write_text("")
    (tmp_path / "checkpoint" / "step-9").mkdir()  # no .metadata: incomplete, not listed
    text = train.run_summary(tmp_path, "ledger")
    assert f"the ledger is in {tmp_path / 'ledger'}" in text
    assert "signals      3 rows, steps 1-3" in text
    assert "1 flagged: steps 2" in text
    assert "data ledger  steps 1-3 on each of 2 DP ranks" in text
    _tiny_ledger(tmp_path / "one", dp=1)
    assert "data ledger  steps 1-3 (data_dp0.jsonl)" in train.run_summary(tmp_path / "one")
    assert "step-2, step-3" in text and "step-9" not in text
    assert f"python -m titan_ledger.plot {tmp_path} -o {tmp_path / 'signals.png'}" in text  # into the dump folder
    assert f"python -m titan_ledger.diagnose {tmp_path}" in text
    assert f"python -m titan_ledger.lookup {tmp_path} --step 2" in text  # the spike
    assert f"python -m titan_ledger.report {tmp_path} --step 2 -o {tmp_path / 'incident-step2.html'}" in text
    assert f"python -m titan_ledger.export {tmp_path} -o {tmp_path / 'export'}" in text


def test_run_summary_counts_notes_proofs_and_what_the_response_held_back(tmp_path):
    """Under the default policy (observe) a proof's verdict changes nothing: the summary
    says how many proofs would have acted, beside the notes and the response's events."""
    led = _tiny_ledger(tmp_path)
    _write(led / "spikes.jsonl", SPIKES.id, [
        {"step": 2, "rules": ["ratio"], "proof": {"verdict": "bad_data", "applied": "original",
                                                   "would_apply": "masked", "held_back": "observe"}},
        {"step": 3, "notes": ["doc_low"], "proof": {"verdict": "outlier", "applied": "original"}},
        {"step": 3, "notes": ["grad_jump"], "proof": {"verdict": "optimizer_state", "applied": "original"}},
        {"step": 4, "no_tokens": True, "masked": ["quarantine"]},
        {"step": 5, "response_failure": {"where": "snapshot", "error": "MemoryError"}}])
    text = train.run_summary(tmp_path, "ledger")
    assert "  notes        2 recorded, never acted on" in text
    assert ("  proofs       3: 1 bad_data, 1 outlier, 1 optimizer_state; 1 held back (would have acted: "
            "--ledger.response.policy observe)") in text
    assert ("  response     1 failure(s) inside the response, training went on; 1 step(s) consumed untrained "
            "(every label masked)") in text


def test_run_summary_without_spikes_or_checkpoints_and_uneven_ranks(tmp_path):
    led = _tiny_ledger(tmp_path, steps=4)
    _write(led / "data_dp2.jsonl", DATA.id, [{"step": 1, "skipped": False, "rows": []}], dp_rank=2)
    text = train.run_summary(tmp_path, "ledger")
    assert "spikes       none flagged" in text
    assert "checkpoints  none" in text
    assert "dp0: 4, dp1: 4, dp2: 1" in text
    assert f"titan_ledger.lookup {tmp_path} --step 4" in text  # the last step
    assert "--ledger-folder" not in text


def test_run_summary_of_an_empty_folder_and_another_ledger_folder(tmp_path):
    text = train.run_summary(tmp_path, "led2")
    assert "signals      none" in text and "data ledger  none" in text
    assert "--ledger-folder led2" in text


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
    monkeypatch.delenv(train.LOG_RANKS_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert train.console_ranks(_cfg(pp, schedule)) == {rank}


def test_log_ranks_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(train.LOG_RANKS_ENV, "all")
    assert train.console_ranks(_cfg()) is None
    monkeypatch.setenv(train.LOG_RANKS_ENV, "0, 1")
    assert train.console_ranks(_cfg()) == {0, 1}
    monkeypatch.setenv(train.LOG_RANKS_ENV, "zero")
    with pytest.raises(ConfigError, match="TITAN_LEDGER_LOG_RANKS='zero'"):
        train.console_ranks(_cfg())
    monkeypatch.delenv(train.LOG_RANKS_ENV)
    assert train.console_ranks(_cfg(mode="fake_backend")) is None  # one process: all of it


def test_configure_console_keeps_warnings_on_other_ranks(monkeypatch):
    monkeypatch.delenv(train.LOG_RANKS_ENV, raising=False)
    monkeypatch.setenv("LOG_RANK", "")
    monkeypatch.setenv("WORLD_SIZE", "2")
    root = logging.getLogger()
    old = root.level, train.log.level
    try:
        train.configure_console(_cfg(), rank=1)
        assert root.level == logging.WARNING and train.log.level == logging.WARNING
        train.configure_console(_cfg(pp=2), rank=1)  # PP: rank 1 logs the loss
        assert root.level == logging.INFO and train.log.level == logging.WARNING
        assert os.environ["LOG_RANK"] == "1"  # torchtitan's PP "loss is not visible" check
        train.configure_console(_cfg(), rank=0)
        assert root.level == logging.INFO and train.log.level == logging.INFO
    finally:
        root.setLevel(old[0])
        train.log.setLevel(old[1])


def test_noise_filter_drops_only_known_messages():
    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(last_save_in_hf=False))
    f = train._DropNoise([p for p, when in train._NOISE if when(cfg)])

    def rec(msg):
        return logging.LogRecord("root", logging.WARNING, __file__, 1, msg, None, None)

    assert not f.filter(rec("Error running lspci: [Errno 2] No such file or directory: 'lspci', x"))
    assert not f.filter(rec("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config"))
    assert not f.filter(rec("initial_load_model_only=True has no effect without an initial_load_path."))
    assert f.filter(rec("ENV[TORCH_NCCL_DUMP_ON_TIMEOUT] = 0 will be overridden to 1 based on job config"))
    assert f.filter(rec("Warmup (2) + decay (2) steps exceed total steps (3). Adjusting decay steps to 1."))


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


def test_printed_commands_name_the_interpreter_that_runs(monkeypatch, tmp_path):
    """The summary's next commands run as printed: ``python`` when it is this interpreter,
    else this interpreter's path (relative below the working directory)."""
    import sys

    from titan_ledger.errors import python_command

    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert python_command() == ".venv/bin/python"
    assert ".venv/bin/python -m titan_ledger.diagnose" in train.run_summary(tmp_path)
    monkeypatch.setenv("PATH", str(venv))  # the venv activated
    assert python_command() == "python"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # not below: the absolute path
    monkeypatch.setenv("PATH", "/nonexistent")
    assert python_command() == str(venv / "python")


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
        train.quiet_run(cfg)
        c = Color()
        root.warning("%sstep: %2d  %sloss: %8.5f%s", c.red, 1, c.green, 8.06102, c.reset)
        for _ in range(2):
            dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "step-4"))
    assert to_file.stream.getvalue() == "step:  1  loss:  8.06102\n"
    assert to_tty.stream.getvalue() == "\x1b[31mstep:  1  \x1b[32mloss:  8.06102\x1b[39m\n"
    assert not [w for w in seen if "Detected an existing checkpoint" in str(w.message)], [str(w.message) for w in seen]


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
