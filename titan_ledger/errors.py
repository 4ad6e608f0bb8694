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
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_NEGATIVE = 1
EXIT_BAD_INPUT = 2


class TitanLedgerError(Exception):
    """Base class: a one-line message naming the file/key/flag and the fix."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(TitanLedgerError, ValueError):
    """A bad flag, TOML key or config value."""


class CorpusError(TitanLedgerError, ValueError):
    """A missing, cut or inconsistent corpus file (.bin/.idx/.jsonl)."""


class LedgerError(TitanLedgerError, ValueError):
    """Missing, torn, inconsistent or newer-schema ledger files."""


class DataStateError(TitanLedgerError, ValueError):
    """A checkpointed data position that does not fit this run's data."""


class SkipError(TitanLedgerError, ValueError):
    """A bad ``--ledger.skip.steps`` window, or a skip the loader cannot do."""


class PlanError(TitanLedgerError, ValueError):
    """A rollback that cannot be planned from what is on disk."""


class LedgerStop(TitanLedgerError):
    """Training stopped by the ledger (the recovery ladder): a report, exit 1."""

    exit_code = EXIT_NEGATIVE


def fail_line(prog: str, err: BaseException) -> str:
    """The one line a CLI prints for ``err``."""
    return f"{prog}: error: {err}"
