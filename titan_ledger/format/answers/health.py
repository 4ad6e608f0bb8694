"""The model's health, read from the signals every run records: when a run left its healthy
regime, and what showed it.

Design decision: every peer's spike rule is blind at the start of training (a z-score
needs a window of history; OLMo-core's skip-step waits 64 observations, Megatron's spiky-loss
check takes the first 100 values as its baseline), yet a new configuration's most common
failure is an LR that breaks the model in its first tens of steps -- the README's first
command at LR 0.05: the loss 8.06 -> 12 by step 8, the max attention logit 0.66 -> 1,006,
then a loss stuck near 6.6 where LR 0.005 reaches 5.76, and no spike rule fired. A broken
model needs no history to be seen: it is read against the model's own *first steps* and
its own *best*, with bars no healthy run comes near:

* ``logits``: the max attention logit past ``logit_rise`` x its level in the first steps
  and past ``logit_floor`` (a freshly initialised model's is ~1; Wortsman et al. 2023: runs
  whose logits passed 1e4 diverged; every clean run here stays under 100);
* ``loss``: the loss (a ``hold``-step median) ``loss_rise`` above its first steps' level --
  a model worse than at initialisation -- or, later, ``relapse`` above its own best window;
* ``update``: the update moving the parameters >= ``rel_update`` of their norm a step (the
  LR's fingerprint, :mod:`titan_ledger.components.detection.fingerprints`'s bar; without
  ``update_norm`` recorded, the param norm's own change >= ``rel_norm_change``, a lower bound).

Each holds ``hold`` steps in a row before it counts (one odd batch is not a broken model).
The model is *broken* from the first step its own signals show damage -- the logits' sign,
or the loss's beside the update's (a loss that rose alone is also what new data does: a
change of data kind is not a broken model) -- dated back to where the update's sign began if
it led into it (the LR moved the weights too far before the damage showed), and stays broken
until every damage sign has cleared for ``recover`` steps (the logits below ``logit_clear`` x
their bar). The reading streams (one row at a time,
O(1) state): the trainer keeps one live and records where a stretch opens and where it closes
(``spikes.jsonl``'s ``health`` events: :func:`from_segments`), so a view reads the spans, not the
run's rows; a ledger from before them is read in one pass over its rows (:func:`read`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Bars:
    early: int = 3  # the first trained steps: the model's own starting levels
    hold: int = 3  # a sign holds this many steps in a row before it counts
    logit_rise: float = 100.0  # the max attention logit past this many times its early level ...
    logit_floor: float = 300.0  # ... and past this
    logit_clear: float = 0.3  # ... cleared below this share of the bar
    loss_rise: float = 0.10  # the loss this much above its first steps' level
    relapse: float = 0.30  # or, later, this much above its best ``window``-step median
    window: int = 20
    rel_update: float = 0.01  # the update >= 1% of the parameter norm a step (the LR's fingerprint reads it too)
    rel_norm_change: float = 0.002  # ... or, without update_norm, the param norm moving >= 0.2% a step
    recover: int = 50  # broken until every damage sign has cleared for this many steps


@dataclass(frozen=True, slots=True)
class Sign:
    """One reading that left the healthy regime: which, from which step, its value there and the bar."""

    name: str  # logits | loss | update
    step: int
    value: float
    bar: float
    words: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "value": self.value, "bar": self.bar, "words": self.words}

    @classmethod
    def of(cls, d: dict[str, Any]) -> Sign:
        return cls(d["name"], int(d["step"]), float(d["value"]), float(d["bar"]), d.get("words", ""))


@dataclass(frozen=True, slots=True)
class Span:
    """A stretch of steps the model was broken: from ``onset`` to ``last`` (None: to the end)."""

    onset: int
    last: int | None
    signs: tuple[Sign, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.name for s in self.signs))

    def words(self) -> str:
        return "; ".join(s.words for s in self.signs)

    def to_json(self) -> dict[str, Any]:
        return {"onset": self.onset, "last": self.last, "signs": [s.to_json() for s in self.signs]}

    @classmethod
    def of(cls, d: dict[str, Any]) -> Span:
        return cls(int(d["onset"]), d.get("last"), tuple(Sign.of(s) for s in d.get("signs") or ()))


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


@dataclass
class _Streak:
    """A sign's run of steps in a row past its bar."""

    start: int | None = None
    count: int = 0
    first: tuple[float, float] | None = None  # (value, bar) at the streak's first step

    def see(self, step: int, hit: bool, value: float = math.nan, bar: float = math.nan) -> None:
        if hit:
            if self.count == 0:
                self.start, self.first = step, (value, bar)
            self.count += 1
        else:
            self.start, self.count, self.first = None, 0, None


@dataclass
class Health:
    """The streaming reading: ``observe(row)`` each trained row in step order; ``spans`` the
    broken stretches found so far (the last one open while ``broken``)."""

    bars: Bars = field(default_factory=Bars)
    spans: list[Span] = field(default_factory=list)
    _early_logit: list[float] = field(default_factory=list)
    _early_loss: list[float] = field(default_factory=list)
    _losses: list[float] = field(default_factory=list)  # the last ``hold`` losses
    _window: list[float] = field(default_factory=list)  # the current ``window`` losses
    _best: float | None = None  # the best window median
    _last_pn: tuple[int, float] | None = None
    _streaks: dict[str, _Streak] = field(default_factory=lambda: {k: _Streak() for k in ("logits", "loss", "update")})
    _open: dict[str, Any] | None = None  # the open span: onset, signs, the last damaged step
    _changed: list[tuple[str, Span]] = field(default_factory=list)  # since ``changes`` was last asked
    _update_what: str = "the update"  # what the update's sign reads: the update, or the param norm

    def observe(self, row: dict[str, Any]) -> Span | None:
        """One trained row; returns the span it opened (the model left health at its onset), else None."""
        step, loss = row.get("step"), row.get("loss")
        if row.get("skipped") or not isinstance(step, int) or not _finite(loss):
            return None
        b = self.bars
        if len(self._early_loss) < b.early:  # the model's own starting levels
            self._early_loss.append(loss)
            if _finite(row.get("max_logit")):
                self._early_logit.append(row["max_logit"])
            self._track_update(row)
            return None
        self._losses = (self._losses + [loss])[-b.hold:]
        loss_med = statistics.median(self._losses)
        self._window.append(loss)
        if len(self._window) == b.window:
            med = statistics.median(self._window)
            self._best = med if self._best is None else min(self._best, med)
            self._window = []
        start = statistics.median(self._early_loss)
        rose = loss_med >= (1 + b.loss_rise) * start
        relapsed = self._best is not None and loss_med >= (1 + b.relapse) * self._best
        self._streaks["loss"].see(step, rose or relapsed, loss_med,
                                  (1 + b.loss_rise) * start if rose else (1 + b.relapse) * (self._best or start))
        ml, bar = row.get("max_logit"), self.logit_bar()
        self._streaks["logits"].see(step, _finite(ml) and bar is not None and ml >= bar, ml if _finite(ml) else math.nan,
                                    bar if bar is not None else math.nan)
        self._track_update(row)
        return self._judge(step, ml, bar, start)

    def logit_bar(self) -> float | None:
        if not self._early_logit:
            return None
        return max(self.bars.logit_floor, self.bars.logit_rise * statistics.median(self._early_logit))

    def _track_update(self, row: dict[str, Any]) -> None:
        step, u, p = row["step"], row.get("update_norm"), row.get("param_norm")
        if _finite(u) and _finite(p) and p > 0:
            rel, bar, what = u / p, self.bars.rel_update, "the update"
        elif _finite(p) and self._last_pn is not None and self._last_pn[0] == step - 1 and self._last_pn[1] > 0:
            rel, bar, what = abs(p - self._last_pn[1]) / self._last_pn[1], self.bars.rel_norm_change, "the param norm"
        else:
            rel, bar, what = math.nan, math.nan, ""
        self._last_pn = (step, p) if _finite(p) else None
        self._streaks["update"].see(step, _finite(rel) and rel >= bar, rel, bar)
        self._update_what = what or self._update_what

    def _signs(self, start: float) -> list[Sign]:
        b, out = self.bars, []
        for name in ("loss", "logits", "update"):
            st = self._streaks[name]
            if st.count < b.hold or st.first is None:
                continue
            v, bar = st.first
            if name == "logits":
                words = (f"the max attention logit {_num(v)} at step {st.start}, "
                         f"{v / max(statistics.median(self._early_logit), 1e-12):,.0f}x its first steps' level")
            elif name == "loss":
                words = (f"the loss {v:.3g} at step {st.start}, above its first steps' {start:.3g}"
                         if v >= (1 + b.loss_rise) * start - 1e-12 else
                         f"the loss {v:.3g} at step {st.start}, {v / (self._best or v):.2f}x its best window")
            else:
                words = (f"{self._update_what} moving {v:.1%} of the parameters' norm a step "
                         f"from step {st.start} (the LR's fingerprint: >= {bar:.1%})")
            out.append(Sign(name, int(st.start), float(v), float(bar), words))
        return out

    def _judge(self, step: int, ml: Any, bar: float | None, start: float) -> Span | None:
        b = self.bars
        held = {k for k, v in self._streaks.items() if v.count >= b.hold}
        # the model's own signals must show it: a loss that rose alone is also what new data
        # does (docstrings, then tables: 4.4x the best window in one step, the model healthy)
        damaged = "logits" in held or {"loss", "update"} <= held
        if self._open is None:
            if not damaged:
                return None
            signs = self._signs(start)
            self._open = {"onset": min(s.step for s in signs), "signs": signs, "damaged": step}
            span = Span(self._open["onset"], None, tuple(signs))
            self._changed.append(("opened", span))
            return span
        # broken: clears only when every damage sign is gone (the logits well under their bar) for `recover` steps
        logits_clear = not (_finite(ml) and bar is not None and ml >= b.logit_clear * bar)
        if damaged or not logits_clear or self._streaks["loss"].count:
            self._open["damaged"] = step
            known = {s.name for s in self._open["signs"]}
            grown = [s for s in self._signs(start) if s.name not in known]
            if grown:  # a sign joined: the open stretch, as it now reads
                self._open["signs"] += grown
                self._changed.append(("grew", Span(self._open["onset"], None, tuple(self._open["signs"]))))
        elif step - self._open["damaged"] >= b.recover:
            self.spans.append(Span(self._open["onset"], self._open["damaged"], tuple(self._open["signs"])))
            self._open = None
            self._changed.append(("recovered", self.spans[-1]))
        return None

    def changes(self) -> list[tuple[str, Span]]:
        """What changed since the last call, in order -- ``opened``, ``grew`` (a sign joined the
        open stretch), ``recovered`` -- for the trainer to record (:func:`from_segments` reads them)."""
        out, self._changed = self._changed, []
        return out

    @property
    def broken_since(self) -> int | None:
        """The onset of the broken stretch the model is in now (None: healthy)."""
        return self._open["onset"] if self._open is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The reading's state, JSON-able (checkpointed with the ledger: a resumed run reads on)."""
        return {"spans": [s.to_json() for s in self.spans], "early_logit": self._early_logit,
                "early_loss": self._early_loss, "losses": self._losses, "window": self._window, "best": self._best,
                "last_pn": list(self._last_pn) if self._last_pn else None,
                "streaks": {k: [v.start, v.count, list(v.first) if v.first else None]
                            for k, v in self._streaks.items()},
                "open": None if self._open is None else {**self._open,
                                                         "signs": [x.to_json() for x in self._open["signs"]]}}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.spans = [Span.of(x) for x in s.get("spans") or []]
        self._early_logit, self._early_loss = list(s.get("early_logit") or []), list(s.get("early_loss") or [])
        self._losses, self._window, self._best = list(s.get("losses") or []), list(s.get("window") or []), s.get("best")
        self._last_pn = tuple(s["last_pn"]) if s.get("last_pn") else None
        for k, (start, count, first) in (s.get("streaks") or {}).items():
            self._streaks[k] = _Streak(start, count, tuple(first) if first else None)
        o = s.get("open")
        self._open = None if o is None else {**o, "signs": [Sign.of(x) for x in o["signs"]]}

    def current(self) -> list[Span]:
        """Every broken stretch so far, the open one last with ``last`` None."""
        out = list(self.spans)
        if self._open is not None:
            out.append(Span(self._open["onset"], None, tuple(self._open["signs"])))
        return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read(rows) -> list[Span]:
    """The broken stretches of a run's trained rows (an iterable, in step order; streamed)."""
    h = Health()
    for r in rows:
        h.observe(r)
    return h.current()


def from_segments(segments: list[tuple[int, list[dict[str, Any]]]]) -> list[Span]:
    """The broken stretches a trainer recorded, as they stand on the run's current timeline:
    ``segments`` is each launch's (or rewind's) ``(step it resumed after, its events)`` in
    order; a ``health`` event is a stretch as it read then (``recovered``: where it closed).
    A launch that resumed after step R rolled the reading back to R (its checkpoint holds it):
    a stretch that opened after R never happened, one that closed after R is open again."""
    out: dict[int, tuple[Span, int | None]] = {}  # onset -> (the stretch, the step its close was recorded at)
    for resumed, events in segments:
        out = {k: ((v, at) if at is None or at <= resumed else (Span(v.onset, None, v.signs), None))
               for k, (v, at) in out.items() if k <= resumed}
        for e in events:
            h = e.get("health")
            if isinstance(h, dict) and "onset" in h:
                span = Span.of(h)
                out[span.onset] = (span, int(e["step"])) if e.get("recovered") else \
                    (Span(span.onset, None, span.signs), None)
    return [out[k][0] for k in sorted(out)]


#: the ``spikes.jsonl`` header key that says its writer recorded the model's health (its events
#: are every span: a view need not read the rows), with the bars it read them by
HEADER_KEY = "health"


def header(bars: Bars | None = None) -> dict[str, Any]:
    """What a writer of ``health`` events puts in its header: the bars it reads by."""
    from dataclasses import asdict

    return {HEADER_KEY: asdict(bars or Bars())}

