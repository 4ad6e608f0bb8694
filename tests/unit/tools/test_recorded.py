"""Tools take the run's settings from the ledger (issue 24, item 6): the world size the
launch log records is the default process count; the recorded flags (``argv``, when a
launch row holds them) are reused when none are given, and flags given anyway are
checked against them, one line naming the first setting that differs."""

from __future__ import annotations

import json

import pytest

from titan_ledger.errors import ConfigError
from titan_ledger.format import records
from titan_ledger.tools import replay
from titan_ledger.tools.recorded import launch_args

from ..bad_input_ledgers import make_run

CONFIG = "train_configs/debug_cpu.toml"
FLAGS = ["--job.config_file", CONFIG, "--training.steps", "14", "--ledger.spike.window", "8"]


def _launch_log(led, rows):
    (led / records.SEGMENTS_FILE).write_text(
        json.dumps({"schema": records.SEGMENTS.id}) + "\n" + "".join(json.dumps(r) + "\n" for r in rows))


def test_the_recorded_world_size_is_the_default_and_flags_are_still_needed_without_argv(tmp_path):
    dump = make_run(tmp_path / "run", dp=4)
    assert launch_args(dump, FLAGS, None) == (FLAGS, 4)  # a DP-4 run: no --nproc 4 needed
    assert launch_args(dump, FLAGS, 2)[1] == 2  # given: kept (the rerun's own check refuses it)
    with pytest.raises(ConfigError, match=r"needs the original run's training flags after `--`.*records the "
                                          r"launch's world size \(4\) and config digest \(d1\), not its flags"):
        launch_args(dump, [], None, what="the rerun")
    with pytest.raises(ConfigError, match="holds no run ledger"):
        launch_args(tmp_path / "fresh", [], None)
    assert launch_args(tmp_path / "fresh", FLAGS, None) == (FLAGS, 2)


def test_recorded_flags_are_reused_and_flags_given_anyway_are_checked(tmp_path):
    dump = tmp_path / "run"
    (dump / "ledger").mkdir(parents=True)
    argv = [*FLAGS, "--job.dump_folder", str(dump)]
    _launch_log(dump / "ledger", [{"run_id": "a", "seq": 1, "resumed_from": 0, "time": 1.0, "config_digest": "x",
                                   "world_size": 2, "dp_size": 2, "argv": argv, "step": 0}])
    assert launch_args(dump, [], None) == (FLAGS, 2)  # the dump folder is the tool's own
    assert launch_args(dump, FLAGS + ["--checkpoint.enable"], None) == (FLAGS + ["--checkpoint.enable"], 2)
    other = [*FLAGS[:3], "12", *FLAGS[4:]]
    with pytest.raises(ConfigError, match=r"give --training.steps 12, the run's launch \(segment 1 of .*segments"
                                          r"\.jsonl\) had 14: give the run's own flags, or none"):
        launch_args(dump, other, None)
    rc, out, err = _cli(replay.main, ["rerun", "--dump-folder", str(dump), "--step", "5", "--", *other])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "give --training.steps 12" in err, err


def _cli(main, argv):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()
