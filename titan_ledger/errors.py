"""One error hierarchy for titan_ledger.

Design decision: every error a user can cause (a bad flag, TOML key, corpus file,
ledger file, skip window, rollback plan) is a ``TitanLedgerError`` whose message is
one line naming the file, key or flag and what to do. Library code raises; only
the entry points (``train.main``, each tool's ``main``) turn it into one line on
stderr and an exit code, so no library function calls ``sys.exit`` and tests can
call every CLI in-process. Exit codes, the same for every tool:

  0  success (a ``check`` that found the runs equal, a ``diagnose`` that ran)
  1  the command ran and its answer is negative (``replay check``: different;
     ``replay inject``: the spike was not shown); training stopped by the ledger
  2  bad input: a flag, TOML key, corpus, ledger or dump folder (this module)
  3  the disk filled while training (``titan_ledger.components.run.disk_space``): free
     space and relaunch the same command
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_NEGATIVE = 1
EXIT_BAD_INPUT = 2
EXIT_DISK_FULL = 3


class TitanLedgerError(Exception):
    """Base class: a one-line message naming the file/key/flag and the fix."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(TitanLedgerError, ValueError):
    """A bad flag, TOML key or config value."""


class CorpusError(TitanLedgerError, ValueError):
    """A missing, cut or inconsistent corpus file (.bin/.idx/.jsonl)."""


class LedgerError(TitanLedgerError, ValueError):
    """Missing, torn, inconsistent or newer-schema ledger files."""


class LedgerCorrupt(LedgerError):
    """A ledger file that is there but cannot be trusted: a line that is not a ledger row
    (named ``FILE:LINE``), or a file of another run. A tool that goes on without a
    missing ledger (a report section, rollback's earlier skips) still stops at this."""


class DataStateError(TitanLedgerError, ValueError):
    """A checkpointed data position that does not fit this run's data."""


class SkipError(TitanLedgerError, ValueError):
    """A bad ``--ledger.skip.steps`` window, or a skip the loader cannot do."""


class PlanError(TitanLedgerError, ValueError):
    """A rollback that cannot be planned from what is on disk."""


class LedgerWarning(UserWarning):
    """A ledger problem a tool reads past: a torn last line (kill -9 mid-write), skipped.
    Library code ``warnings.warn``s it; each tool's entry point prints the run's
    warnings as ONE line, ``titan_ledger.<tool>: warning: ...``, on stderr
    (``tools.cli.run_tool``)."""


class ProofFailure(RuntimeError):
    """A proof that cannot be completed (components.response): an execution past its
    deadline (``--ledger.proof.timeout``) or not finite where the step was. It
    never leaves the response: the step is decided as it would be without the proof, and
    its event records why."""


class LedgerStop(TitanLedgerError):
    """Training stopped by the ledger (the recovery ladder): a report, exit 1."""

    exit_code = EXIT_NEGATIVE


class NonFiniteLoss(RuntimeError):
    """torchtitan's "Loss is not finite ... Stopping training." (a ``RuntimeError`` as
    there), raised by its own type so that ``Recovery.settling`` makes a deferred decision
    and writes its row before the stop, as the step would have."""


def fail_line(prog: str, err: BaseException) -> str:
    """The one line a CLI prints for ``err``."""
    return f"{prog}: error: {err}"


#: What to do about each filesystem error, by class (the path comes from the error).
_OS_HINTS: tuple[tuple[type[OSError], str], ...] = (
    (FileNotFoundError, "no such file or folder"),
    (NotADirectoryError, "a file stands where a folder is needed (a part of this path is a file); "
                         "give a folder path"),
    (IsADirectoryError, "is a folder; give a file path"),
    (PermissionError, "permission denied; choose a path you can write, or fix its owner/mode"),
    (FileExistsError, "already exists"),
)


def os_error_line(err: OSError) -> str | None:
    """A filesystem error (one that names its path) as the one-line form, or None for an
    error that names no path (not a bad input the user can fix by a path: let it surface).

    Design decision: one mapping for every entry point (``train.main``, every tool's
    ``cli.run_tool``) instead of a try/except per call site: whatever opens the file,
    the user sees which path and what is wrong with it."""
    path = getattr(err, "filename", None)
    if not path:
        return None
    path2 = getattr(err, "filename2", None)
    what = next((hint for cls, hint in _OS_HINTS if isinstance(err, cls)), None)
    if what is None:
        what = (err.strerror or type(err).__name__).lower()
    return f"{path}{' -> ' + str(path2) if path2 else ''}: {what}"


def python_command(exe: str | None = None) -> str:
    """How a printed next command names the interpreter (``exe``: a run's own, from its
    launch header; default: this one): ``python`` when that is the one on PATH (an
    activated venv), else its path, relative to the working directory when it lies below
    it (``.venv/bin/python``). A fresh clone that follows the README without activating
    the venv would otherwise run the system Python, which has no torch."""
    import os
    import shutil
    import sys

    exe = os.path.abspath(exe or sys.executable)
    on_path = shutil.which("python")
    if on_path and os.path.abspath(on_path) == exe:
        return "python"
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else exe
