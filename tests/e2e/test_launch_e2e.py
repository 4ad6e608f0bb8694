"""The launcher and the training entry as a user meets them: every refusal is ONE stderr
line and exit 2, before any rank starts, with nothing written into the dump folder;
``launch --help`` is help (exit 0). ``--help`` and a refusal by ``train`` run as real
processes (a launch refusal does in test_preflight_e2e.py), a live run's lock is held by
another process; the other refusals call the entries' ``main`` in this process (``helpers.launch_here``,
``train_refused_here``; a fresh interpreter imports torch and torchtitan for ~10 s)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import CONFIGS, launch_here, train_refused_here

pytestmark = pytest.mark.slow  # each case imports torch + torchtitan in a fresh process (~5 s)

DEBUG = str(CONFIGS / "debug_cpu.toml")


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _one_line(p, prog, *needles):
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith(f"titan_ledger.{prog}: error: "), p.stderr
    assert "Traceback" not in p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_launch_help_is_help():
    p = _run("titan_ledger.launch", "--help")
    assert p.returncode == 0 and "--nproc N" in p.stdout and not p.stderr.strip()
    assert p.stdout.startswith("usage: python -m titan_ledger.launch [--nproc N] [--print]")  # the options first
    assert "--print, --dry-run" in p.stdout.split("\n\n``python")[0]


def test_a_second_launch_into_a_live_runs_folder_is_refused(tmp_path):
    dump = tmp_path / "run"
    hold = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from titan_ledger.components.run import run_lock; "
         "run_lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(dump)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "TORCHELASTIC_RUN_ID": "first-run"})
    try:
        assert hold.stdout.readline().strip() == "held"
        before = _files(dump)
        p = launch_here("--job.config_file", DEBUG, "--job.dump_folder", dump)
        _one_line(p, "launch", "another run is training there", f"PID {hold.pid}")
        assert _files(dump) == before  # nothing written by the refused launch
    finally:
        hold.kill()
        hold.wait()


def test_a_dump_folder_that_is_a_file_and_a_binary_config_are_one_line(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    _one_line(launch_here("--job.config_file", DEBUG, "--job.dump_folder", f / "run"), "launch", str(f),
              "give a folder path")
    binary = tmp_path / "x.toml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    _one_line(launch_here("--job.config_file", binary), "launch", str(binary), "not a text file")
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing yet\n")
    _one_line(_run("titan_ledger.train", "--job.config_file", str(empty)), "train", "holds no settings")


def test_train_without_torchrun_on_a_two_process_world(tmp_path):
    p = train_refused_here("--job.config_file", DEBUG, "--job.dump_folder", tmp_path / "d", WORLD_SIZE="2")
    _one_line(p, "train", "RANK and LOCAL_RANK are not", "titan_ledger.launch --nproc 2")
    assert not (tmp_path / "d").exists()


def test_a_missing_tokenizer_folder_is_one_line_before_the_ranks(tmp_path):
    """torchtitan's tokenizer raises a FileNotFoundError naming no file, on every rank, after
    the process group; ``train.check_files`` names the flag first."""
    none = tmp_path / "no_tokenizer"
    p = launch_here("--job.config_file", DEBUG, "--job.dump_folder", tmp_path / "d", "--hf_assets_path", none)
    _one_line(p, "launch", f"--hf_assets_path {none}: no such folder")
    assert not (tmp_path / "d").exists()
