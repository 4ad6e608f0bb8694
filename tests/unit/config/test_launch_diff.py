"""Two launches of one run compared (issue 70): what a relaunch changed (each expected
difference with why), the checkpoints a rewind replaces, a launch with nothing left to
train -- the pure lines, and two launches parsed through the entry point's own parse
(``train.parse_flags``; no processes)."""

from __future__ import annotations

import json

import pytest

from titan_ledger import train
from titan_ledger.config.launch_diff import (
    config_diff,
    expected_diff,
    nothing_left_line,
    relaunch_lines,
    rewind_line,
    rooted,
    saves,
    settings,
    strip_recorded,
    value,
)

TOUR = ["--job.config_file", "train_configs/debug_cpu.toml", "--training.steps", "12", "--checkpoint.enable",
        "--checkpoint.interval", "4", "--ledger.spike.window", "8", "--ledger.rehearsal.inject", "8:1:repeat"]


def test_strip_and_root_a_recorded_launch():
    assert strip_recorded(["--a", "1", "--job.dump_folder", "/x", "--dump_folder=/y", "--b"]) == ["--a", "1", "--b"]
    argv = ["--job.config_file", "c.toml", "--job.overlay=o.toml", "--job.overlay", "/abs/p.toml", "--x", "rel"]
    assert rooted(argv, "/run/here") == ["--job.config_file", "/run/here/c.toml", "--job.overlay=/run/here/o.toml",
                                         "--job.overlay", "/abs/p.toml", "--x", "rel"]
    assert rooted(argv, None) == argv  # no recorded working directory: as recorded


def test_volatile_settings_are_expected_not_differences():
    a = {"training": {"steps": 14, "seq_len": 256}, "dump_folder": "/a", "checkpoint": {"load_step": 8},
         "ledger": {"skip": {"steps": ["9"]}}}
    b = {"training": {"steps": 12, "seq_len": 256}, "dump_folder": "/b", "checkpoint": {"load_step": -1},
         "ledger": {"skip": {"steps": []}}}
    assert config_diff(a, b) == [("training.steps", 14, 12)]
    # the dump folder is each launch's own: neither a difference nor an expected one
    assert expected_diff(a, b) == [("checkpoint.load_step", 8, -1), ("ledger.skip.steps", ["9"], [])]
    assert (value([]), value(["8", "9-10"]), value(None), value(True), value(-1)) == ("none", "8 9-10", "none",
                                                                                    "true", "-1")
    assert value("/a/quarantine/file/" + "x" * 60 + ".jsonl") == "/a/quarantine/file/" + "x" * 60 + ".jsonl"
    assert value("x" * 200) == "x" * 157 + "..."  # (a model spec's repr: cut)


def test_relaunch_lines_one_line_each():
    then = {"training": {"steps": 12}, "ledger": {"rehearsal": {"inject": "8:1:repeat"}, "skip": {"steps": []}},
            "checkpoint": {"load_step": -1}}
    now = {"training": {"steps": 12}, "ledger": {"rehearsal": {"inject": "10:1:repeat"}, "skip": {"steps": ["8"]}},
           "checkpoint": {"load_step": 4}}
    lines = relaunch_lines(now, then, seq=2, log="/r/ledger/segments.jsonl", world_now=2, world_then=2)
    assert lines == [
        ("warning", "titan_ledger: relaunch: 1 setting differs from the run's recorded launch (segment 2 of "
                    "/r/ledger/segments.jsonl): --ledger.rehearsal.inject 10:1:repeat (was 8:1:repeat)"),
        ("info", "titan_ledger: relaunch: expected differences from it: --checkpoint.load_step 4 (was -1: a "
                 "rollback's checkpoint), --ledger.skip.steps 8 (was none: a rollback's skip window)")]
    # the world size is a difference of its own; only expected ones: the recorded launch is named there
    lines = relaunch_lines({**then, "checkpoint": {"load_step": 4}}, then, seq=1, log="L", world_now=4, world_then=2)
    assert [lvl for lvl, _ in lines] == ["warning", "info"]
    assert lines[0][1].endswith("1 setting differs from the run's recorded launch (segment 1 of L): world size 4 "
                                "(was 2)")
    only = relaunch_lines({**then, "checkpoint": {"load_step": 4}}, then, seq=1, log="L")
    assert only == [("info", "titan_ledger: relaunch: expected differences from the run's recorded launch "
                             "(segment 1 of L): --checkpoint.load_step 4 (was -1: a rollback's checkpoint)")]
    assert relaunch_lines(then, then, seq=3, log="L") == [
        ("info", "titan_ledger: relaunch: the settings of the run's recorded launch (segment 3 of L)")]
    many = {"training": {f"k{i}": i for i in range(10)}}
    line = relaunch_lines(many, {"training": {}}, seq=1, log="L")[0][1]
    assert "10 settings differ from" in line and line.endswith("--training.k7 7 (was none), and 2 more")


def test_the_checkpoints_a_rewind_replaces():
    assert saves(4, 12, 4) == [8, 12] and saves(4, 10, 4) == [8, 10] and saves(12, 12, 4) == []
    assert rewind_line(4, [4, 8, 12], 12, 4) == (
        "titan_ledger: this relaunch rewinds to step-4: checkpoints step-8, step-12 of the old trajectory will be "
        "replaced as the run passes them")
    assert rewind_line(4, [4, 8, 10], 12, 4) == (  # step-10 is not saved again: not replaced
        "titan_ledger: this relaunch rewinds to step-4: checkpoint step-8 of the old trajectory will be replaced "
        "as the run passes it")
    assert rewind_line(-1, [4, 8, 12], 12, 4) is None  # the latest: nothing newer
    assert rewind_line(12, [4, 8, 12], 12, 4) is None


def test_nothing_left_to_train():
    assert nothing_left_line(12, 12) == (
        "titan_ledger: the run already reached step 12 of 12; nothing trained; to train again with these flags use "
        "a new --dump_folder, to go on raise --training.steps")
    assert "reached step 20, past --training.steps 12;" in nothing_left_line(20, 12)


@pytest.fixture
def ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")


def test_two_launches_parsed_by_the_entry_points_own_parse(tmp_path, ranks):
    """The tour's step 1 and its rollback relaunch (step 4's overlay, proof at the alarm left on):
    what the relaunch says, from the configs ``train.parse_flags`` builds."""
    overlay = tmp_path / "rollback.toml"
    overlay.write_text("[checkpoint]\nload_step = 4\n\n[ledger.skip]\nsteps = [\"8\"]\n")
    then, _ = train.parse_flags([*TOUR, "--ledger.proof.scope", "off", "--job.dump_folder", str(tmp_path)])
    now, _ = train.parse_flags([*TOUR, "--job.overlay", str(overlay), "--job.dump_folder", str(tmp_path)])
    lines = relaunch_lines(settings(now), settings(then), seq=1, log="L")
    assert lines == [
        ("warning", "titan_ledger: relaunch: 1 setting differs from the run's recorded launch (segment 1 of L): "
                    "--ledger.proof.scope all (was off)"),
        ("info", "titan_ledger: relaunch: expected differences from it: --checkpoint.load_step 4 (was -1: a "
                 "rollback's checkpoint), --ledger.skip.steps 8 (was none: a rollback's skip window)")]
    # one owner of the comparable form: the ledger's config digest serializes the same JSON
    from titan_ledger.components.run.run_folder import config_digest, config_json

    assert settings(now) == json.loads(config_json(now)) and len(config_digest(now)) == 16


def test_a_launch_recorded_before_a_rename_is_read_in_todays_spelling():
    """A run recorded ``--ledger.on_spike.prove`` (issue 69 renamed it ``--ledger.proof.scope``):
    every reuse of its flags -- the relaunch comparison, ``replay rerun``, ``diagnose --rerun``
    -- goes through ``strip_recorded``, which reads them in today's spelling (``format.spellings``; the trainer
    refuses the old one)."""
    old = ["--job.config_file", "a.toml", "--ledger.on_spike.prove", "all", "--job.dump_folder", "/r",
           "--ledger.on_spike.no_defer", "--ledger.snapshots.max_proofs=3"]
    assert strip_recorded(old) == ["--job.config_file", "a.toml", "--ledger.proof.scope", "all",
                                   "--ledger.response.no_defer", "--ledger.window.max_proofs=3"]
