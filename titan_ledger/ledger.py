"""The ``[ledger]`` config section: everything titan_ledger adds to a torchtitan run.

Design decision: one Configurable component, ``Ledger``, owns the ``ledger``
section, following torchtitan's pattern (a nested ``@dataclass(kw_only=True,
slots=True) Config`` whose attribute docstrings become ``--help``). The trainer
builds it once; the signal, data and spike features hang their settings and
state here, so ``LedgerTrainer`` stays a thin seam over torchtitan's ``Trainer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.config import Configurable


class Ledger(Configurable):
    """Run-level ledger settings and state (filled by the signals/data features)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        device: Literal["auto", "cpu", "cuda"] = "auto"
        """
        Compute backend. ``auto`` uses CUDA when a GPU is visible and otherwise the
        CPU rehearsal backend (gloo collectives, CPU masked attention, FSDP sum
        reduction). ``cpu`` forces the rehearsal backend on a GPU machine. It is
        read before torchtitan is imported, so set it in the TOML ``[ledger]``
        section or as ``--ledger.device`` on the ``titan_ledger.train`` command line
        (or with the ``TITAN_LEDGER_DEVICE`` environment variable).
        """

    def __init__(self, config: Config) -> None:
        self.config = config
