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
from typing import Any

from titan_ledger.format import records
from titan_ledger.format.answers.build import RerunFinding, build
from titan_ledger.format.answers.causes import Knobs
from titan_ledger.format.answers.records import Answer, Context
from titan_ledger.format.proofs import ProofRecord
from titan_ledger.format.reader import RunLedger


def context(led: RunLedger) -> Context:
    """The run's context for an answer built offline: the latest launch's settings
    (``knobs``), flags, working directory, interpreter and world size, the checkpoints on disk."""
    rows = led.launches()
    last = next((r for r in reversed(rows) if isinstance(r.get("argv"), list)), rows[-1] if rows else {})
    knobs = next((r.get("knobs") for r in reversed(rows) if r.get("knobs")), None)
    rules = led.spike_rules() or {}
    return Context(
        knobs=Knobs.of(knobs), dump=str(led.dump_folder),
        argv=tuple(last["argv"]) if isinstance(last.get("argv"), list) else None, cwd=str(last.get("cwd") or ""),
        python=str(last.get("python") or "python"), world_size=int(last.get("world_size") or 1),
        checkpoints=tuple(led.checkpoints()), checkpoint_folder=led.checkpoint_folder,
        loss_jump=float(rules.get("loss_jump", 0.05)))


def recorded(led: RunLedger) -> dict[int, dict[str, Any]]:
    """Every answer the trainer recorded, by the incident's step (a stall's answer rides in
    its forced proof's event); the last recorded for a step wins."""
    out: dict[int, dict[str, Any]] = {}
    for e in led.events():
        a = e.get("answer")
        if isinstance(a, dict) and "step" in a:
            out[int(a["step"])] = a
    return out


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


def _incident(led: RunLedger, step: int) -> tuple[str, dict[str, Any], ProofRecord | None, str | None] | None:
    """The incident at ``step`` as recorded: (kind, event, proof, why not proven), or None."""
    events = led.events()
    flag = next((e for e in reversed(events) if int(e.get("step", -1)) == step and "rules" in e), None)
    stall = next((e for e in reversed(events) if int(e.get("step", -1)) == step and e.get("stall")), None)
    if flag is not None:
        p = flag.get("proof")
        return "spike", flag, ProofRecord.of(p) if p else None, (flag.get("proof_failed") or {}).get("error")
    if stall is not None:
        p = next((e["proof"] for e in reversed(events) if (e.get("proof") or {}).get("stall", {}).get("step") == step),
                 None)
        return "stall", stall, ProofRecord.of(p) if p else None, None
    return None


def answer_at(led: RunLedger, step: int) -> Answer | None:
    """THE answer to the incident at ``step`` (the module docstring's rule); None when
    nothing flagged the step."""
    summary = rerun_summary(led, step)
    if summary is not None and isinstance(summary.get("answer"), dict):
        return Answer.of(summary["answer"])
    rec = recorded(led).get(int(step))
    if rec is not None and summary is None:
        return Answer.of(rec)
    incident = _incident(led, step)
    if incident is None:
        return Answer.of(rec) if rec is not None else None
    kind, event, proof, unproven = incident
    found = rerun_finding(summary.get("verdict") or {}, proof.verdict if proof else None) if summary else None
    if rec is not None and (found is None or rec.get("cause")):  # a rerun adds a cause only where none was
        return Answer.of(rec)
    return build(step, kind, event, proof, context(led), unproven=unproven, rerun=found)


def rerun_answer(led: RunLedger, step: int, verdict: dict[str, Any]) -> Answer | None:
    """The answer a rerun writes beside its verdict: the step's recorded incident built again
    with what the rerun found (None: not an incident, or the rerun proved nothing new)."""
    incident = _incident(led, step)
    if incident is None:
        return None
    kind, event, proof, unproven = incident
    found = rerun_finding(verdict, proof.verdict if proof else None)
    if found is None:
        return None
    return build(step, kind, event, proof, context(led), unproven=unproven, rerun=found)
