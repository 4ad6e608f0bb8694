"""What bounds an automatic action: the quarantine's size, and the circuit breaker (pure).

Design decision: every anchor's automatic action is one step withheld (Megatron's rerun
machine, OLMo-core's skip-step optimizer); a quarantine removes data for the rest of a
run, and actions taken in a loop can thrash a run they were meant to save. So under
``--ledger.response.policy act`` two bounds stand between a verdict and what it changes,
both pure bookkeeping here, unit-tested without processes; ``Recovery`` asks them:

* :func:`quarantine_coverage` -- how much of the data a conviction's documents are: their
  tokens, their share of the corpus and, read ahead in the corpus's order, of the next
  1,000 steps, and whether a step would be left with no token. Past
  ``--ledger.conviction.max_share`` (1%) or at an emptied step the quarantine is
  refused: the verdict stands, and the ladder decides the step.
* :class:`Breaker` -- more than ``[ledger.breaker] actions`` actions within its ``window`` steps
  pause acting (the response observes) until a window passes without one. Checkpointed
  with the ladder, so a resumed run pauses where the uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Coverage:
    """How much of the data a quarantine of ``documents`` would mask."""

    documents: list[list]  # [[source, doc], ...]
    tokens: int | None  # their tokens together in the corpus (None: a document's size unknown)
    longest: int | None  # the largest one's tokens
    share: float | None  # of the corpus's tokens (None: the corpus's size unknown)
    step_tokens: int  # tokens a step trains on (global batch x seq_len)
    ahead: dict | None = None  # the next steps read ahead (``LedgerDataLoader.upcoming``; None: not readable)
    refused: str | None = None  # why the quarantine is not applied (None: it is)

    def to_json(self) -> dict[str, Any]:
        out = {"documents": self.documents, "tokens": self.tokens, "longest": self.longest,
               "share": None if self.share is None else round(self.share, 8), "step_tokens": self.step_tokens}
        if self.ahead is not None:  # (the per-step lists cut: a record, not a dump)
            out["ahead"] = {**{k: v for k, v in self.ahead.items() if k != "with"}, "empty": self.ahead["empty"][:10]}
        if self.refused:
            out["refused"] = self.refused
        return out

    def describe(self) -> str:
        named = ", ".join(f"{s}:{d}" for s, d in self.documents[:4]) + (" ..." if len(self.documents) > 4 else "")
        size = f"{self.tokens} tokens" if self.tokens is not None else "size unknown"
        share = f", {self.share:.3%} of the corpus" if self.share is not None else ""
        ahead = ""
        if self.ahead is not None and self.ahead["total"]:
            ahead = f", {self.ahead['tokens'] / self.ahead['total']:.3%} of the next {self.ahead['steps']} steps"
        return f"{named} ({size}{share}{ahead})"


def quarantine_coverage(documents: list[tuple[str, int]], sizes: dict[tuple[str, int], int | None],
                        shares: dict[tuple[str, int], float | None], step_tokens: int,
                        max_share: float, ahead: dict | None = None,
                        lone_doc_step: int | None = None) -> Coverage:
    """The coverage of quarantining ``documents`` and whether the bound refuses it.
    ``sizes``: each one's tokens in the corpus; ``shares``: its share of the corpus;
    ``ahead``: the next steps read ahead in the corpus's order (an indexed corpus:
    ``LedgerDataLoader.upcoming``) -- refused when a step of them would be left with no
    token, or their share of those steps' tokens passes ``max_share``; without it (a text
    or hf source), refused when one document holds ``lone_doc_step`` tokens or more (the
    tokens a step holds that one document could fill: a DP-1 step's; None: at DP >= 2
    each rank streams its own documents, one cannot fill a step). Refused as well: a
    corpus share past ``max_share``, or a document whose size is unknown (its bound
    cannot be checked)."""
    docs = sorted(documents)
    known = [sizes.get(d) for d in docs]
    tokens = sum(known) if all(n is not None for n in known) else None
    longest = max((n for n in known if n is not None), default=None)
    share_parts = [shares.get(d) for d in docs]
    share = sum(share_parts) if share_parts and all(x is not None for x in share_parts) else None
    cov = Coverage([[s, int(d)] for s, d in docs], tokens, longest, share, int(step_tokens), ahead)
    if any(n is None for n in known):
        cov.refused = "a convicted document cannot be read back from the corpus: its size is unknown"
    elif ahead is not None and ahead["empty"]:
        cov.refused = (f"masking them would leave {len(ahead['empty'])} of the next {ahead['steps']} steps with "
                       f"nothing to train on")
    elif ahead is not None and ahead["total"] and ahead["tokens"] / ahead["total"] > max_share:
        cov.refused = (f"they are {ahead['tokens'] / ahead['total']:.3%} of the next {ahead['steps']} steps' tokens, "
                       f"more than --ledger.conviction.max_share {max_share:g}")
    elif ahead is None and lone_doc_step is not None and longest is not None and longest >= lone_doc_step:
        cov.refused = (f"a convicted document holds {longest} tokens, a whole step's {lone_doc_step} or more: "
                       f"masking it could leave a step with nothing to train on")
    elif share is not None and share > max_share:
        cov.refused = (f"the convicted documents are {share:.3%} of the corpus, more than "
                       f"--ledger.conviction.max_share {max_share:g}")
    return cov


@dataclass
class Breaker:
    """At most ``limit`` automatic actions within any ``window`` steps: the action that
    would exceed it is not taken and acting pauses until ``window`` steps pass without
    one (:meth:`allows`); ``events`` holds what a pause and a resumption record."""

    limit: int
    window: int
    steps: list[int] = field(default_factory=list)  # the steps of the recent actions
    paused_at: int | None = None
    events: list[dict] = field(default_factory=list)  # taken by the caller (spikes.jsonl)

    def _recent(self, step: int) -> list[int]:
        return [s for s in self.steps if step - s < self.window]

    def allows(self, step: int) -> bool:
        """Whether an action may be taken at ``step`` (asked before taking it). A pause
        starts at the action that would exceed the limit, and ends at the first step
        asked a whole window after the last action taken."""
        self.steps = self._recent(step)
        if self.paused_at is not None:
            if self.steps:
                return False
            self.events.append({"step": step, "breaker": "resumed", "paused_at": self.paused_at})
            self.paused_at = None
        if len(self.steps) >= self.limit:
            self.paused_at = step
            self.events.append({"step": step, "breaker": "paused", "actions": list(self.steps),
                                "limit": self.limit, "window": self.window})
            return False
        return True

    def tick(self, step: int) -> None:
        """A step starts: a pause whose window has passed without an action ends here (the
        resumption is recorded even when no action follows)."""
        if self.paused_at is not None and not self._recent(step):
            self.steps = []
            self.events.append({"step": step, "breaker": "resumed", "paused_at": self.paused_at})
            self.paused_at = None

    def record(self, step: int) -> None:
        """An action was taken at ``step``."""
        self.steps.append(step)

    @property
    def paused(self) -> bool:
        return self.paused_at is not None

    def take_events(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), "paused_at": self.paused_at}

    def load_state_dict(self, s: dict) -> None:
        if s:
            self.steps, self.paused_at = [int(x) for x in s.get("steps", [])], s.get("paused_at")
