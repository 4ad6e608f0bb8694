"""Starting and killing training processes: one ``torchrun`` launch of
``titan_ledger.train`` (optionally SIGKILLed, the whole tree, when a step starts).

Design decision: ``replay`` (resume, inject, drill) and ``rerun`` both launch
training; the launch lives here, below both, so neither tool imports the other for
it (no import cycles among the tools, enforced by import-linter).

``TITAN_LEDGER_TORCHRUN`` (a command line, split as a shell would) replaces
``python -m torch.distributed.run`` in these launches: a site's wrapper, or the test
suite's warm launcher (``tests/warm_launch.py``), which takes torchrun's arguments.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from titan_ledger.errors import TitanLedgerError
from titan_ledger.format import records


class ReplayError(TitanLedgerError):
    """A drill/resume/inject run that could not do what was asked (its log is named)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TORCHRUN_ENV = "TITAN_LEDGER_TORCHRUN"


def torchrun_prefix() -> list[str]:
    """The command a launch starts with: ``$TITAN_LEDGER_TORCHRUN`` or this Python's torchrun."""
    given = os.environ.get(TORCHRUN_ENV, "").strip()
    return shlex.split(given) if given else [sys.executable, "-m", "torch.distributed.run"]


def train_cmd(nproc: int, dump: Path, train_args: list[str]) -> list[str]:
    return [*torchrun_prefix(), "--nproc_per_node", str(nproc),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{_free_port()}",
            "-m", "titan_ledger.train", *train_args, "--job.dump_folder", str(dump)]


def kill9_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every descendant at once (torchrun puts ranks in their own sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


def _ledger_reached(path: Path, start: int, step: int) -> bool:
    """Has a row covering ``step`` been appended to ``path`` after byte ``start``?"""
    return any(r["step"] <= step <= r.get("last_step", r["step"]) for r in records.rows_after(path, start))


def run_training(nproc: int, dump: Path, train_args: list[str], log: Path, env=None,
                 kill_at: int | None = None, timeout: float = 3600) -> dict:
    """One torchrun launch; with ``kill_at`` SIGKILL the whole tree when step ``kill_at`` starts."""
    dump.mkdir(parents=True, exist_ok=True)
    watch = dump / records.LEDGER_FOLDER / records.data_file(0)
    start = watch.stat().st_size if watch.exists() else 0
    t0 = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(train_cmd(nproc, dump, train_args), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
        killed = False
        while proc.poll() is None:
            if kill_at is not None and _ledger_reached(watch, start, kill_at):
                kill9_tree(proc.pid)
                killed = True
                break
            if time.monotonic() - t0 > timeout:
                kill9_tree(proc.pid)
                raise ReplayError(f"training did not finish in {timeout} s; log: {log}")
            time.sleep(0.02)
        rc = proc.wait()
    return {"returncode": rc, "killed": killed, "seconds": round(time.monotonic() - t0, 1)}
