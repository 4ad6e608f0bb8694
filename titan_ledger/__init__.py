"""titan_ledger: stability signals and a replayable data ledger on torchtitan 0.3.0.

Importing the package does not import torchtitan: the device backend has to be
chosen first (see :mod:`titan_ledger.rehearsal.backend`). ``titan_ledger.LedgerTrainer``
is resolved lazily and installs the default backend if none was chosen.
"""

__all__ = ["LedgerTrainer"]


def __getattr__(name: str):
    if name == "LedgerTrainer":
        from titan_ledger.trainer import LedgerTrainer

        return LedgerTrainer
    raise AttributeError(f"module 'titan_ledger' has no attribute {name!r}")
