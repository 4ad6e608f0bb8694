"""One live run per dump folder (titan_ledger.components.run.run_lock), with real processes:
a live holder refuses, a kill -9'd holder (reaped or a zombie) is taken over, a PID
that now belongs to a later process is not mistaken for the holder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from titan_ledger.components.run import run_lock
from titan_ledger.errors import ConfigError

HOLD = ("import sys, time; from titan_ledger.components.run import run_lock; "
        "run_lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)")


def _holder(folder):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "TORCHELASTIC_RUN_ID": "other-job"})
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_run_holds_the_folder_and_a_dead_one_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    p = _holder(tmp_path)
    try:
        lock = json.loads((tmp_path / run_lock.LOCK_FILE).read_text())
        assert lock["pid"] == p.pid and lock["job"] == "other-job"
        with pytest.raises(ConfigError, match=rf"another run is training there: PID {p.pid} .*kill {p.pid}"):
            run_lock.check(tmp_path)
        with pytest.raises(ConfigError, match="another run is training there"):
            run_lock.acquire(tmp_path)
        os.kill(p.pid, signal.SIGKILL)
        time.sleep(0.2)  # not reaped yet: a zombie is not a live holder
        assert run_lock.check(tmp_path).pid == p.pid  # stale
    finally:
        p.kill()
        p.wait()
    path, stale = run_lock.acquire(tmp_path)
    assert stale is not None and stale.pid == p.pid
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert run_lock.check(tmp_path) is None  # our own job
    run_lock.release(path)
    assert not path.exists()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    # the lock names this very PID but another start time: the process that took it is gone
    me = run_lock.me()
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps({
        "host": me.host, "pid": os.getpid(), "started": me.started - 1 if me.started else 0,
        "job": "old-job", "since": "yesterday"}))
    if not me.started:
        pytest.skip("no /proc start times here")
    assert run_lock.check(tmp_path).job == "old-job"


def test_another_hosts_lock_is_refused_with_the_removal_command(tmp_path):
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps({
        "host": "node-17", "pid": 4242, "started": 1.0, "job": "j", "since": "t"}))
    with pytest.raises(ConfigError, match=r"another host holds it|a run on another host .*rm "):
        run_lock.check(tmp_path)


def test_a_torn_lock_file_holds_nothing(tmp_path):
    (tmp_path / run_lock.LOCK_FILE).write_text('{"host": "vm", "pi')
    path, stale = run_lock.acquire(tmp_path)
    assert stale is not None and json.loads(path.read_text())["pid"] == os.getpid()
