"""Spike rules: a z-score rule and a ratio-to-median rule over a sliding window.

Design decision: the rules are tensor math on values that are already reduced
(global loss, global pre-clip grad norm), so every rank computes the same flag
on its own device, with no collective and no host read. The same class runs
offline over a ledger's rows (CPU tensors, identical code), which is how
``replay drill`` and ``diagnose`` find spikes in a finished run.

Rules (each can be switched off):

* z-score (OLMo-core's SkipStep rule): ``value - mean > k * std`` over the last
  ``window`` accepted steps (current step excluded), active once ``window/2``
  steps are in the window. Applied to loss and grad norm.
* ratio (the design article §2.7 / §4.5): grad norm > ``ratio`` x the window's
  median grad norm *and* loss > (1 + ``loss_jump``) x the window's median loss.
* a non-finite loss or grad norm is always a spike.

A flagged step's values do not enter the window, so one spike does not widen
the baseline that should catch the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.config import Configurable

from titan_ledger.errors import ConfigError

RULES = ("zscore_loss", "zscore_grad_norm", "ratio", "non_finite")
#: layout of the stats vector ``SpikeDetector.step`` returns (all float64)
STAT_KEYS = ("flag", *RULES, "loss_mean", "loss_std", "loss_median", "grad_norm_mean",
             "grad_norm_std", "grad_norm_median", "n")


class SpikeDetector(Configurable):
    """On-device sliding-window spike rules over (loss, grad_norm)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enable: bool = True
        """Run the spike rules every step (results in signals.jsonl ``spike`` and spikes.jsonl)."""

        window: int = 128
        """Steps in the sliding window (OLMo-core: 128). Rules start after window/2 steps."""

        zscore: float = 6.0
        """z-score rule: value - mean > zscore * std (0 disables it)."""

        ratio: float = 3.0
        """Ratio rule: grad norm > ratio x window median (0 disables it)..."""

        loss_jump: float = 0.10
        """...and loss > (1 + loss_jump) x window median loss."""

        def __post_init__(self) -> None:
            # checked when the config is parsed, before any process group exists
            if self.window < 2:
                raise ConfigError(f"--ledger.spike.window must be >= 2, got {self.window}")
            for name in ("zscore", "ratio", "loss_jump"):
                if getattr(self, name) < 0:
                    raise ConfigError(f"--ledger.spike.{name} must be >= 0 (0 switches the rule off), "
                                      f"got {getattr(self, name)}")

    def __init__(self, config: Config, device: torch.device | str = "cpu") -> None:
        self.config = config
        w = int(config.window)
        self.hist = torch.zeros(2, w, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self._arange = torch.arange(w, device=device)

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Judge this step (0-d tensors) and update the window. Returns STAT_KEYS values."""
        c = self.config
        w = self.hist.shape[1]
        v = torch.stack([loss.double().reshape(()), grad_norm.double().reshape(())])
        n = torch.clamp(self.count, max=w)
        valid = self._arange < n
        nf = n.clamp(min=1).double()
        masked = torch.where(valid, self.hist, torch.zeros_like(self.hist))
        mean = masked.sum(1) / nf
        var = (torch.where(valid, self.hist - mean[:, None], torch.zeros_like(self.hist)) ** 2).sum(1) / nf
        std = var.sqrt()
        median = torch.where(valid, self.hist, torch.full_like(self.hist, float("nan"))).nanmedian(1).values
        active = n >= (w // 2)
        finite = torch.isfinite(v)
        z = (v - mean > c.zscore * std) & active & finite if c.zscore > 0 else torch.zeros(2, dtype=torch.bool, device=v.device)
        if c.ratio > 0:
            ratio = active & (v[1] > c.ratio * median[1]) & (v[0] > (1 + c.loss_jump) * median[0])
        else:
            ratio = torch.zeros((), dtype=torch.bool, device=v.device)
        non_finite = ~finite.all()
        flag = z.any() | ratio | non_finite
        # accepted steps enter the window; a flagged one does not
        idx = self.count % w
        col = self.hist[:, idx]
        self.hist[:, idx] = torch.where(flag, col, v)
        self.count = self.count + (~flag).long()
        return torch.stack([flag.double(), z[0].double(), z[1].double(), ratio.double(),
                            non_finite.double(), mean[0], std[0], median[0], mean[1], std[1],
                            median[1], n.double()])

    def state_dict(self) -> dict[str, Any]:
        return {"hist": self.hist.tolist(), "count": int(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        hist = torch.tensor(state["hist"], dtype=torch.float64, device=self.hist.device)
        if hist.shape != self.hist.shape:  # window changed: keep the most recent values
            return
        self.hist = hist
        self.count = torch.tensor(int(state["count"]), device=self.count.device)


def describe(stats: list[float]) -> dict[str, Any]:
    """STAT_KEYS values (host floats) -> an event dict (rules that fired by name)."""
    d = dict(zip(STAT_KEYS, stats))
    return {"rules": [r for r in RULES if d[r]], **{k: d[k] for k in STAT_KEYS[1 + len(RULES):]}}


def detect_offline(rows: list[dict], config: "SpikeDetector.Config") -> list[dict]:
    """Run the rules over ledger rows (trained steps only), as the trainer would have."""
    det = SpikeDetector(config)
    events = []
    for r in rows:
        if r.get("skipped") or r.get("loss") is None:
            continue
        stats = det.step(torch.tensor(float(r["loss"]), dtype=torch.float64),
                         torch.tensor(float(r["grad_norm"]), dtype=torch.float64)).tolist()
        if stats[0]:
            events.append({"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"],
                           **describe(stats)})
    return events
