"""Adam's second moment's level from the signals rows: where v stands and where it stood.

Design decision: v's total over the parameters is an exponential average of the
(clipped) gradient's squared norm -- exactly, for the updates applied -- so its level
is a signal the written rows already carry, kept by the ledger (host floats,
checkpointed) like the other signals; the proof's optimizer-state test
(:mod:`titan_ledger.components.response.optimizer_state`) reads its ratio. It lived in
the response until issue 69: the ledger built a response object the prover asked back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AdamLevel:
    """The second moment's level, fast (Adam's ``beta2``) and slow (``horizon`` steps),
    as bias-corrected exponential averages of the clipped gradient's squared norm over
    the steps whose update was applied (pure host arithmetic)."""

    beta2: float = 0.95
    horizon: int = 1000
    fast: float = 0.0
    slow: float = 0.0
    n: int = 0

    def observe(self, row: dict) -> None:
        """One written signals row: a trained step whose update was applied moves v."""
        g = row.get("grad_norm_clipped")
        if row.get("skipped") or row.get("update_skipped") or not isinstance(g, (int, float)) \
                or not math.isfinite(g):
            return
        g2 = float(g) * float(g)
        slow = 1.0 - 1.0 / self.horizon
        self.fast = self.beta2 * self.fast + (1.0 - self.beta2) * g2
        self.slow = slow * self.slow + (1.0 - slow) * g2
        self.n += 1

    def ratio(self) -> float | None:
        """How far v's long-run level stands above where it is now (>= 0; None before any
        applied update)."""
        if self.n == 0:
            return None
        fast = self.fast / (1.0 - self.beta2 ** self.n)
        slow = self.slow / (1.0 - (1.0 - 1.0 / self.horizon) ** self.n)
        if fast <= 0.0:
            return math.inf if slow > 0.0 else 1.0
        return slow / fast

    def state_dict(self) -> dict:
        return {"beta2": self.beta2, "horizon": self.horizon, "fast": self.fast, "slow": self.slow, "n": self.n}

    def load_state_dict(self, s: dict) -> None:
        if s:  # the beta2 and horizon stay this launch's
            self.fast, self.slow, self.n = float(s["fast"]), float(s["slow"]), int(s["n"])
