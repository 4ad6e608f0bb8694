"""The stall rule: a run that stops learning or slowly diverges, which no spike rule sees.

Design decision: Wortsman et al. 2023 (arXiv 2309.14322) study *slow divergence*, not
spikes: attention logits grow past 10^4 and the loss stops falling, over hundreds of
steps, every step within its neighbours' noise. Measured on the tiny model (LR 0.1, no
weight decay, 1,000 steps): the loss's 50-step median stops improving at 6.28 by step
150 while the max attention logit climbs from 2e3 to 5.8e4; with QK-norm the same run
goes on learning. So this rule compares the loss with *its own past*, window by window,
on the host, from the rows the run writes anyway (no device work): the median of each
``window`` steps against the best (lowest) window median so far --

* ``diverging``: ``rise_windows`` windows in a row at least ``rise`` above the best
  (the loss climbing back);
* ``stalled``: ``patience`` windows in a row without improving on the best by
  ``min_gain``, *and* the attention logits past ``logit_bar`` (Wortsman's "logits past
  10^4 diverge"): a plateau alone is also what convergence looks like (a memorised
  text sits at loss 0.007), so a flat loss flags only with the mechanism beside it.

A flag is one event (``{"step", "stall": {...}}`` in spikes.jsonl) with the windows'
medians, the best and the logits; it is not repeated until the loss improves again.
Pure (host floats), checkpointed with the ledger.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from titan_ledger.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class StallConfig:
    enable: bool = True
    """Watch the loss's trend for a stall or a slow divergence (``components.detection.stall``)."""

    window: int = 50
    """Steps per window; each window's median loss is compared with the best so far."""

    patience: int = 4
    """``stalled``: this many windows in a row without improving on the best by ``min_gain``."""

    min_gain: float = 0.01
    """``stalled``: a window improves when its median is below the best by this much (relative)."""

    logit_bar: float = 1e4
    """``stalled`` flags only with the max attention logit's window median at or past this
    (Wortsman et al.: runs whose logits passed 1e4 diverged); ``diverging`` needs none."""

    rise: float = 0.05
    """``diverging``: a window's median this much above the best (relative)."""

    rise_windows: int = 2
    """``diverging``: this many windows in a row past ``rise``."""

    def __post_init__(self) -> None:
        if self.window < 2 or self.patience < 1 or self.rise_windows < 1 or not (self.min_gain >= 0) \
                or not (self.rise > 0) or not (self.logit_bar > 0):
            raise ConfigError(f"--ledger.stall: window {self.window} (>= 2), patience {self.patience} (>= 1), "
                              f"rise_windows {self.rise_windows} (>= 1), min_gain {self.min_gain} (>= 0), rise "
                              f"{self.rise} and logit_bar {self.logit_bar} (> 0)")


@dataclass
class StallWatch:
    """Feeds on written signals rows (:meth:`observe`); returns a stall event when the
    rule fires."""

    config: StallConfig
    losses: list[float] = field(default_factory=list)  # the current window's
    logits: list[float] = field(default_factory=list)
    medians: list[list] = field(default_factory=list)  # [last step, median loss, median max logit] per window
    best: float | None = None
    flat: int = 0  # windows in a row without improving
    high: int = 0  # windows in a row past the rise
    flagged: bool = False  # a flag stands until the loss improves again
    best_step: int | None = None  # where the best window ended: the onset of a stall that follows

    def observe(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """One written row (a trained step); at a window's end, the rule."""
        loss = row.get("loss")
        if row.get("skipped") or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            return None
        self.losses.append(float(loss))
        ml = row.get("max_logit")
        if isinstance(ml, (int, float)) and math.isfinite(ml):
            self.logits.append(float(ml))
        if len(self.losses) < self.config.window:
            return None
        med = statistics.median(self.losses)
        logit = statistics.median(self.logits) if self.logits else None
        self.losses, self.logits = [], []
        self.medians = [*self.medians[-(self.config.patience + self.config.rise_windows + 4):],
                        [int(row["step"]), med, logit]]
        return self._judge(int(row["step"]), med, logit)

    def _judge(self, step: int, med: float, logit: float | None) -> dict[str, Any] | None:
        cfg = self.config
        if self.best is None or med < self.best * (1 - cfg.min_gain):
            self.best, self.flat, self.high, self.flagged = med, 0, 0, False
            self.best_step = step
            return None
        self.best = min(self.best, med)
        self.flat += 1
        self.high = self.high + 1 if med >= self.best * (1 + cfg.rise) else 0
        kind = None
        if self.high >= cfg.rise_windows:
            kind = "diverging"
        elif self.flat >= cfg.patience and logit is not None and logit >= cfg.logit_bar:
            kind = "stalled"
        if kind is None or self.flagged:
            return None
        self.flagged = True
        n = cfg.patience if kind == "stalled" else cfg.rise_windows
        return {"step": step, "stall": {
            "kind": kind, "best": round(self.best, 6), "windows": [[s, round(m, 6), None if lg is None else round(lg, 3)]
                                                                  for s, m, lg in self.medians[-(n + 1):]],
            "window": cfg.window, "max_logit": None if logit is None else round(logit, 3),
            "since": step - self.flat * cfg.window}}

    def state_dict(self) -> dict:
        return {"losses": self.losses, "logits": self.logits, "medians": self.medians, "best": self.best,
                "flat": self.flat, "high": self.high, "flagged": self.flagged, "best_step": self.best_step}

    def load_state_dict(self, s: dict) -> None:
        if s:
            self.losses, self.logits = list(s.get("losses", [])), list(s.get("logits", []))
            self.medians, self.best = [list(m) for m in s.get("medians", [])], s.get("best")
            self.flat, self.high, self.flagged = int(s.get("flat", 0)), int(s.get("high", 0)), bool(s.get("flagged"))
            self.best_step = s.get("best_step")


def describe_stall(ev: dict[str, Any]) -> str:
    """A stall event in one line (console, W&B alert, ``diagnose``)."""
    st = ev["stall"]
    trend = ", ".join(f"{m:.4g}" for _, m, _ in st["windows"])
    if st["kind"] == "diverging":
        what = f"the loss is climbing back: {st['window']}-step medians {trend} against the best {st['best']:.4g}"
    else:
        what = (f"the loss stopped improving at {st['best']:.4g} (medians {trend} since step {st['since']}) while "
                f"the max attention logit stands at {st['max_logit']:.3g}: attention-logit growth stalls training "
                f"(Wortsman et al.); QK-norm (--model.qk_norm) or QK-clip prevents it")
    return f"STALL at step {ev['step']} ({st['kind']}): {what}"
