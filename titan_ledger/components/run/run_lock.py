"""One live run per dump folder: ``<dump_folder>/.titan_ledger.lock``.

Design decision: the ledgers and checkpoints of a dump folder are appended by one
run at a time; a second launch into a folder whose first run is still training (its
torchrun killed, its ranks not) would interleave both runs' rows. Global rank 0
takes an exclusive lock file (created with ``O_EXCL``) before anything is written,
holding its host, PID, the process's start time (so a reused PID is not mistaken for
the holder) and the torchrun job id (so the ranks of one job on other nodes are one
holder); it is removed when the run ends. A second launch is refused with one line
naming the holder. A lock whose holder is dead (same host, PID gone, a zombie, or a
PID that now belongs to a later process) is stale -- a ``kill -9`` left it -- and is
taken over with a warning. A lock from another host cannot be checked from here: it
is refused with the command that removes it once the user knows that run is gone.
``python -m titan_ledger.launch`` makes the same check before any rank starts.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from titan_ledger.errors import ConfigError

LOCK_FILE = ".titan_ledger.lock"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float  # the process's start (seconds since boot, from /proc; 0 if unknown)
    job: str  # torchrun's run id (TORCHELASTIC_RUN_ID), else "pid<PID>"
    since: str  # when the lock was taken (local time, for the message)

    def describe(self) -> str:
        return f"PID {self.pid} on {self.host} (job {self.job}, since {self.since})"


def _proc_start(pid: int) -> float:
    """The start time of ``pid`` in clock ticks since boot (Linux /proc), 0 if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return float(fields[19])  # field 22 (starttime); fields here start at field 3 (state)
    except (OSError, ValueError, IndexError):
        return 0.0


def _alive(pid: int, started: float) -> bool:
    """The process that took the lock still runs: the PID exists, is no zombie, and
    (where /proc says) started when the holder did."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2:].split()[0] in ("Z", "X"):
            return False  # killed, not yet reaped
    except (OSError, ValueError):
        return True
    now = _proc_start(pid)
    return not (started and now and now != started)


def me() -> Holder:
    pid = os.getpid()
    job = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{pid}"
    return Holder(socket.gethostname(), pid, _proc_start(pid), job, time.strftime("%Y-%m-%d %H:%M:%S"))


def read(dump_folder: str | os.PathLike) -> Holder | None:
    path = Path(dump_folder) / LOCK_FILE
    try:
        d = json.loads(path.read_text())
        return Holder(str(d["host"]), int(d["pid"]), float(d.get("started", 0)), str(d.get("job", "")),
                      str(d.get("since", "?")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # unreadable (a write cut by kill -9): it holds nothing we can honour
        return Holder("?", -1, 0.0, "?", "?")


def check(dump_folder: str | os.PathLike) -> Holder | None:
    """Refuse (``ConfigError``) if another live run holds the folder; return a stale
    holder (to be taken over) or None. Writes nothing."""
    path = Path(dump_folder) / LOCK_FILE
    holder = read(dump_folder)
    if holder is None or holder.pid < 0:
        return holder
    mine = me()
    if holder.job == mine.job and holder.host == mine.host:
        return None  # this job's own lock (a relaunch of rank 0 in one job cannot happen; a re-check)
    if holder.host != mine.host:
        raise ConfigError(f"--dump_folder {dump_folder}: a run on another host holds it: "
                          f"{holder.describe()}; if that run is gone, remove {path} (rm {path}), or "
                          f"use another --dump_folder")
    if _alive(holder.pid, holder.started):
        raise ConfigError(f"--dump_folder {dump_folder}: another run is training there: "
                          f"{holder.describe()}; stop it first (kill {holder.pid}) or use another "
                          f"--dump_folder")
    return holder


def acquire(dump_folder: str | os.PathLike) -> tuple[Path, Holder | None]:
    """Take the lock (global rank 0, before the first write). Returns (lock path, the
    stale holder taken over or None); raises ``ConfigError`` if a live run holds it."""
    dump = Path(dump_folder)
    path = dump / LOCK_FILE
    mine = me()
    blob = json.dumps(asdict(mine)) + "\n"
    dump.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # create, or take over a stale one (a racing launch makes O_EXCL fail)
        stale = check(dump)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if stale is None and read(dump) is None:
                continue  # removed meanwhile: try again
            if stale is None:
                return path, None  # our own job's lock
            tmp = path.with_name(f"{LOCK_FILE}.{mine.pid}.tmp")
            tmp.write_text(blob)
            os.replace(tmp, path)
            now = read(dump)
            if now is not None and (now.host, now.pid) == (mine.host, mine.pid):
                return path, stale
            continue
        with os.fdopen(fd, "w") as f:
            f.write(blob)
        return path, stale
    raise ConfigError(f"--dump_folder {dump}: could not take {path} (another launch is racing for it); "
                      f"launch one run per dump folder")


def release(path: Path) -> None:
    """Remove the lock if it is still ours (a takeover by another launch is not undone)."""
    holder = read(path.parent)
    if holder is not None and (holder.host, holder.pid) == (socket.gethostname(), os.getpid()):
        try:
            path.unlink()
        except OSError:
            pass
