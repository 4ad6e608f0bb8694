"""Deprecated location: the data ledger reader is :class:`titan_ledger.reader.DataLedger`
(read through :class:`titan_ledger.reader.RunLedger`). Kept one release for imports."""

from titan_ledger.errors import LedgerError  # noqa: F401
from titan_ledger.reader import DataLedger, StepData  # noqa: F401
