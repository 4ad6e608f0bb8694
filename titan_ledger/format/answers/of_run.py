"""A run's answers, read from its ledger: the record the trainer wrote, the one a rerun
wrote after it, or -- for a ledger written before answers -- the one the builder makes now.

Design decision: views ask here, never the reader's raw events, so that one rule says which
answer of a step stands: a rerun's (``rerun/step<T>.json``'s ``answer``, written when the
rerun proved something) over the trainer's (``spikes.jsonl``'s ``answer``; the last recorded
wins: a rewound launch answers a step again) over one built now from the step's recorded
event and proof by the same builder. What a rerun found is read against the step's own
proof once (:func:`rerun_finding`): a rerun that contradicts the proof at the alarm does
not override it (the proof executed the step itself, its masks against a control).
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from titan_ledger.format import records
from titan_ledger.format.answers import health
from titan_ledger.format.answers.build import RerunFinding, build
from titan_ledger.format.answers.causes import Knobs
from titan_ledger.format.answers.episodes import LEVEL, Episode, HorizonProof, episodes
from titan_ledger.format.answers.health import Health, Span
from titan_ledger.format.answers.records import Answer, Context
from titan_ledger.format.proofs import ProofRecord
from titan_ledger.format.reader import RunLedger

#: the signals the episodes read (the model's health, a shift's loss level)
HEALTH_KEYS = ("loss", "max_logit", "param_norm", "update_norm")


def context(led: RunLedger) -> Context:
    """The run's context for an answer built offline: the latest launch's settings
    (``knobs``), flags, working directory, interpreter and world size, the checkpoints on disk."""
    rows = led.launches()
    last = next((r for r in reversed(rows) if isinstance(r.get("argv"), list)), rows[-1] if rows else {})
    knobs = next((r.get("knobs") for r in reversed(rows) if r.get("knobs")), None)
    rules = led.spike_rules() or {}
    argv = last.get("argv") if isinstance(last.get("argv"), list) else []
    policy = next((argv[i + 1] for i in range(len(argv) - 2, -1, -1) if argv[i] == "--ledger.response.policy"), None)
    return Context(
        knobs=Knobs.of(knobs), dump=str(led.dump_folder),
        argv=tuple(last["argv"]) if isinstance(last.get("argv"), list) else None, cwd=str(last.get("cwd") or ""),
        python=str(last.get("python") or "python"), world_size=int(last.get("world_size") or 1),
        checkpoints=tuple(led.checkpoints()), checkpoint_folder=led.checkpoint_folder,
        loss_jump=float(rules.get("loss_jump", 0.05)), policy=policy)


def recorded(led: RunLedger) -> dict[int, dict[str, Any]]:
    """Every answer the trainer recorded, by the incident's step (:meth:`RunAnswers.recorded`)."""
    return RunAnswers(led).recorded()


def rerun_summary(led: RunLedger, step: int) -> dict[str, Any] | None:
    """``rerun/step<T>.json`` of the step (what ``replay rerun`` / ``diagnose --rerun``
    measured from a checkpoint), or None."""
    try:
        return json.loads(records.rerun_summary_file(led.folder, step).read_text())
    except (OSError, ValueError):
        return None


def contradicts(proof_verdict: str, rerun_cause: str | None) -> bool:
    """Whether a rerun's cause contradicts the in-step proof's verdict (pure): a proof that
    convicted data or hardware and a rerun that names anything else; a proof that found
    the step reproducible with its suspect data harmless (``not_data``, ``outlier``) and a
    rerun that names data or hardware. A rerun naming a cause that is not the data
    (LR, logits, ...) after a ``not_data`` proof says which -- no contradiction."""
    if proof_verdict in ("bad_data", "hardware"):
        return rerun_cause != proof_verdict
    return rerun_cause in ("bad_data", "hardware")


def rerun_finding(verdict: dict[str, Any], proof_verdict: str | None) -> RerunFinding | None:
    """What a rerun's verdict (its summary's ``verdict``) establishes (pure): proof where a
    variant removed a reproduced spike (bad data only by ``quarantine``, the documents alone
    masked; a ``skip`` shows "something in this step's data": evidence) or the step did not
    reproduce (hardware); None where it proved nothing or contradicts the proof at the alarm."""
    cause, by = verdict.get("cause"), verdict.get("removed_by")
    if not cause or (not verdict.get("proven") and verdict.get("certainty") != "evidence"):
        return None
    proven = (verdict.get("certainty") or "proven") == "proven" and not (cause == "bad_data" and by != "quarantine")
    if proof_verdict is not None and contradicts(proof_verdict, cause):
        return None
    if cause == "hardware":
        rule = "a rerun from the checkpoint (same data, same state) did not reproduce it"
    elif cause == "bad_data" and not proven:
        rule = (f"a rerun reproduced it and {by or 'skip'} removed it: something in this step's data "
                f"(not which documents: the quarantine variant names them)")
    else:
        rule = f"a rerun reproduced it and the {by or 'counterfactual'} variant removed it"
    return RerunFinding(cause, rule, proven)


class RunAnswers:
    """A run's answers and episodes, read once: the events, the rerun summaries and the
    horizon proofs are read on first use and kept (a view asks for many steps)."""

    def __init__(self, led: RunLedger):
        self.led = led
        self._log: records.LedgerFile | None | bool = False
        self._events: list[dict[str, Any]] | None = None
        self._ctx: Context | None = None
        self._cols: dict[str, Any] | None = None
        self._health: tuple[list[Span], int] | None = None
        self._recorded: dict[int, dict[str, Any]] | None = None

    @property
    def log(self) -> records.LedgerFile | None:
        """``spikes.jsonl``, read once."""
        if self._log is False:
            self._log = self.led.event_log()
        return self._log

    @property
    def events(self) -> list[dict[str, Any]]:
        if self._events is None:
            self._events = self.log.history if self.log is not None else []
            self._by_step: dict[int, list[dict[str, Any]]] = {}
            for e in self._events:
                if isinstance(e.get("step"), int):
                    self._by_step.setdefault(e["step"], []).append(e)
        return self._events

    def at(self, step: int) -> list[dict[str, Any]]:
        """The events recorded at ``step``, in order."""
        self.events  # noqa: B018 (indexes them)
        return self._by_step.get(step, [])

    @property
    def context(self) -> Context:
        if self._ctx is None:
            self._ctx = context(self.led)
        return self._ctx

    def steps(self) -> list[int]:
        """Every incident's step: an acting flag, a note its proof promoted, a stall."""
        return sorted({int(e["step"]) for e in self.events if "rules" in e and "step" in e}
                      | {int(e["step"]) for e in self.events if e.get("stall") and "step" in e}
                      | {int(e["answer"]["step"]) for e in self.events if isinstance(e.get("answer"), dict)})

    def incident(self, step: int) -> tuple[str, dict[str, Any], ProofRecord | None, str | None] | None:
        """The incident at ``step`` as recorded: (kind, event, proof, why not proven), or None."""
        here = self.at(step)
        flag = next((e for e in reversed(here) if "rules" in e), None)
        stall = next((e for e in reversed(here) if e.get("stall")), None)
        if flag is not None:
            p = flag.get("proof")
            return "spike", flag, ProofRecord.of(p) if p else None, (flag.get("proof_failed") or {}).get("error")
        if stall is not None:  # its proof rides in a forced proof's event a step or so later
            p = next((e["proof"] for e in reversed(self.events)
                      if (e.get("proof") or {}).get("stall", {}).get("step") == step), None)
            return "stall", stall, ProofRecord.of(p) if p else None, None
        return None

    def answer(self, step: int) -> Answer | None:
        """THE answer to the incident at ``step`` (the module docstring's rule); None when
        nothing flagged the step."""
        summary = rerun_summary(self.led, step)
        if summary is not None and isinstance(summary.get("answer"), dict):
            return Answer.of(summary["answer"])
        rec = self.recorded().get(step)
        if rec is not None and summary is None:
            return Answer.of(rec)
        incident = self.incident(step)
        if incident is None:
            return Answer.of(rec) if rec is not None else None
        kind, event, proof, unproven = incident
        found = rerun_finding(summary.get("verdict") or {}, proof.verdict if proof else None) if summary else None
        if rec is not None and (found is None or rec.get("cause")):  # a rerun adds a cause only where none was
            return Answer.of(rec)
        return build(step, kind, event, proof, self.context, unproven=unproven, rerun=found)

    def recorded(self) -> dict[int, dict[str, Any]]:
        """Every answer the trainer recorded, by the incident's step (the last for a step wins)."""
        if self._recorded is None:
            self._recorded = {int(e["answer"]["step"]): e["answer"] for e in self.events
                              if isinstance(e.get("answer"), dict) and "step" in e["answer"]}
        return self._recorded

    def rerun_answer(self, step: int, verdict: dict[str, Any]) -> Answer | None:
        """The answer a rerun writes beside its verdict: the step's recorded incident built
        again with what the rerun found (None: not an incident, or the rerun proved nothing new)."""
        incident = self.incident(step)
        if incident is None:
            return None
        kind, event, proof, unproven = incident
        found = rerun_finding(verdict, proof.verdict if proof else None)
        if found is None:
            return None
        return build(step, kind, event, proof, self.context, unproven=unproven, rerun=found)

    @property
    def columns(self) -> dict[str, Any]:  # (a ledger whose trainer did not record its health)
        """The signals the episodes read, as columns of the current trained history (the fast
        columnar read, once)."""
        if self._cols is None:
            self._cols, _ = self.led.signal_columns(HEALTH_KEYS)
        return self._cols

    def health(self) -> tuple[list[Span], int]:
        """The model's broken stretches and the run's last trained step: the spans the trainer
        recorded where every launch of the run recorded them (``spikes.jsonl``'s headers say
        so: the event log and the offset index, whatever the run's length), else one pass over
        the signals' columns (a ledger from before them)."""
        if self._health is None:
            end = self.led.last_signal_step() or 0
            if self._recorded_health():
                self._health = (health.from_segments([(int(s.header.extra.get("started_after_step") or 0), s.rows)
                                                      for s in self.log.segments]), end)
            else:
                cols = self.columns
                h = Health()
                rows = zip(cols["step"].tolist(), *(cols[k].tolist() for k in HEALTH_KEYS))
                for step, *vals in rows:
                    h.observe({"step": step, **dict(zip(HEALTH_KEYS, vals))})
                self._health = (h.current(), int(cols["step"][-1]) if len(cols["step"]) else end)
        return self._health

    def _recorded_health(self) -> bool:
        """Whether every launch of the run recorded its model's health (its header says so)."""
        segs = self.log.segments if self.log is not None else []
        return bool(segs) and all(s.header.extra.get(health.HEADER_KEY) for s in segs)

    def level(self, step: int) -> float | None:
        """The loss's median over the ``LEVEL`` trained steps from ``step`` over its median over
        the ``LEVEL`` before (None: too few of either): a change of level, or a spike. Reads
        those rows only (the offset index)."""
        rows = [r for r in self.led.signals_between(step - LEVEL, step + LEVEL - 1) if not r.get("skipped")]
        before = [r["loss"] for r in rows if r["step"] < step and _finite(r.get("loss"))]
        after = [r["loss"] for r in rows if r["step"] >= step and _finite(r.get("loss"))]
        if len(before) < LEVEL // 2 or len(after) < LEVEL // 2:
            return None
        b = statistics.median(before)
        return statistics.median(after) / b if b > 0 else None

    def proofs(self) -> dict[int, HorizonProof]:
        """The horizon proofs ``diagnose RUN --rerun`` recorded (``episodes.jsonl``), by onset;
        the last recorded for an onset wins."""
        path = self.led.folder / records.EPISODES_FILE
        if not path.is_file():
            return {}
        out = {}
        for row in records.read_ledger(path, records.EPISODES).history:
            if "onset" in row:
                p = HorizonProof.of(row)
                out[p.onset] = p
        return out

    def episodes(self) -> list[Episode]:
        """THE episodes of the run (:mod:`.episodes`)."""
        answers = [a for a in (self.answer(s) for s in self.steps()) if a is not None]
        spans, end = self.health()
        flags = {int(e["step"]): e for e in self.events if "rules" in e and "step" in e}
        return episodes(answers, spans, flags, end, self.context, self.proofs(), level=self.level)


def answer_at(led: RunLedger, step: int) -> Answer | None:
    """THE answer to the incident at ``step`` (:meth:`RunAnswers.answer`)."""
    return RunAnswers(led).answer(step)


def rerun_answer(led: RunLedger, step: int, verdict: dict[str, Any]) -> Answer | None:
    """:meth:`RunAnswers.rerun_answer`."""
    return RunAnswers(led).rerun_answer(step, verdict)


def episodes_of(led: RunLedger) -> list[Episode]:
    """THE episodes of a run (:meth:`RunAnswers.episodes`)."""
    return RunAnswers(led).episodes()


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

