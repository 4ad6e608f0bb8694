"""What a proof at the alarm measured: one owner for the verdicts, its runs as rows and its
line in words.

Design decision: the proof record (the ``proof`` of a ``spikes.jsonl`` event) is
written by :mod:`titan_ledger.components.response.prover` (with the window proof of
:mod:`titan_ledger.components.response.window_proof`) and read by every view through
:class:`Proof` -- the in-step verdict, every execution and window re-run as one typed row
-- which must not import torch. What the incident's *answer* is (its one cause, how it
was established, the fix) is not derived here: :mod:`titan_ledger.format.answers` builds
it once from this record, and every view renders that; a proof's own line
(:func:`describe_proof`) is what it measured, for a note's proof and the page's proof table.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Finding(StrEnum):
    """A proof's verdict (its ``verdict`` field), worst first. A ``StrEnum``: the record
    on disk holds the plain string, and a member equals it, so readers of old records and
    the response layer's comparisons agree."""

    HARDWARE = "hardware"  # the executions of one batch disagree: a fault, not the data
    BAD_DATA = "bad_data"  # the update is normal without documents it is abnormal with
    OPTIMIZER_STATE = "optimizer_state"  # normal from the same gradients under a healthy Adam state
    NOT_DATA = "not_data"  # reproducible, abnormal, and no data explains it
    OUTLIER = "outlier"  # the data stood out, the update was normal


class Applied(StrEnum):
    """Which execution's update a proof applied (its ``applied`` field)."""

    ORIGINAL = "original"  # the first execution's
    SAME = "same"  # a repeat's (the first was faulty)
    MASKED = "masked"  # the suspect's data masked
    CONTROL = "control"  # the control's data masked (it was the control's data)
    NONE = "none"  # no update: no two executions agreed


#: the verdicts, worst first
VERDICTS = tuple(Finding)
#: the verdicts that act on a note (``[ledger.proof] scope = "all"``)
HARMFUL = (Finding.HARDWARE, Finding.BAD_DATA)


#: why a verdict that calls for an action did not act (a proof's ``held_back``): the proof's
#: line says it in full, an answer's "done" line briefly (``held_back_words(key, brief=True)``)
HELD_BACK = {
    "observe": ("--ledger.response.policy observe", "--ledger.response.policy observe"),
    "quarantine_bound": ("the quarantine bound", "the quarantine bound"),
    "fragile": ("a run already fragile", "a fragile run"),  # (records before the prover said not_data there)
    "breaker": ("the circuit breaker", "the circuit breaker"),
    "novelty": ("no control of the same novelty (decided in the step: the next step's data not fetched yet)",
                "no control of the same novelty (decided in the step)"),
    "unhealthy": ("a model that had left its healthy regime (a conviction needs a healthy state: none was tested)",
                  "a broken model (the conviction needs a healthy state)"),
}


def held_back_words(key: str, brief: bool = False) -> str:
    """Why a verdict did not act, in words (:data:`HELD_BACK`; an unknown key as itself)."""
    row = HELD_BACK.get(key)
    return key if row is None else row[1 if brief else 0]


@dataclass(kw_only=True, slots=True)
class ProofRecord:
    """A proof as the response writes it: the prover fills what it measured, ``Recovery``
    what it decided (the policy, the window proof, what a bound held back), each by name;
    :meth:`to_json` gives the ``proof`` of the step's ``spikes.jsonl`` event, which every
    reader parses back as :class:`Proof`. The fields' order is the record's key order."""

    verdict: Finding
    applied: Applied  # the update the step trains with (the verdict's, unless held back)
    why: str
    acting: bool  # an acting flag's proof (else a note's, or a forced one)
    executions: list[dict[str, Any]]  # every execution of the step, the first one first
    seconds: float = 0.0
    optimizer: dict[str, Any] | None = None  # Adam asked first: v against its long-run level
    noise: dict[str, Any] | None = None  # the machine's execution noise, measured by the repeats
    ranks: list[int] | None = None  # the ranks a hardware verdict names
    dp_ranks: list[int] | None = None
    suspect: dict[str, Any] | None = None  # the DP rank and evidence the data was tested on
    documents: list[list] | None = None  # [source, doc] convicted or suspected
    coverage: dict[str, Any] | None = None  # the quarantine bound's reading (``refused``)
    fragile: dict[str, Any] | None = None  # the LR's fingerprint where no conviction was made
    bisection: dict[str, Any] | None = None  # the group testing's path
    control: dict[str, Any] | None = None  # the other content masked as a control
    content: dict[str, Any] | None = None  # a conviction's content checks: near copies, stands out, seen before, novelty
    update_recomputed: str | None = None  # executed once more to apply it (its gradients were gone)
    decided_at: int | None = None  # deferred: proven behind this step's launch
    policy: str | None = None  # --ledger.response.policy
    stall: dict[str, Any] | None = None  # the stall rule's flag this proof answers
    window: dict[str, Any] | None = None  # the window proof from the host snapshot
    would_apply: Applied | None = None  # what the verdict called for, where it was held back
    held_back: str | None = None  # a :data:`HELD_BACK` key
    health: dict[str, Any] | None = None  # the model's health when proven: {"broken_since": onset} (None: healthy)

    @classmethod
    def of(cls, d: dict[str, Any]) -> ProofRecord:
        """The record a reader parsed (``spikes.jsonl``'s ``proof``), typed again: the
        verdict and updates as their enums where they are known values (a record of an older
        writer keeps its string), keys this writer does not know left out."""
        def enum(kind, v):
            return kind(v) if v in {m.value for m in kind} else v

        kw = {k: d[k] for k in cls.__slots__ if k in d}
        kw["verdict"] = enum(Finding, d["verdict"])
        kw["applied"] = enum(Applied, d.get("applied") or "original")
        if kw.get("would_apply") is not None:
            kw["would_apply"] = enum(Applied, kw["would_apply"])
        kw.setdefault("why", "")
        kw.setdefault("acting", True)
        kw.setdefault("executions", [])
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        """The record on disk: the fields set, in order (enums as their strings)."""
        out: dict[str, Any] = {}
        for name in self.__slots__:
            v = getattr(self, name)
            if v is not None:
                out[name] = str(v) if isinstance(v, StrEnum) else v
        return out


@dataclass(frozen=True, slots=True)
class ProofRun:
    """One execution of the flagged step (``kind`` ``step``: the first one, the same batch
    again, the suspect's data masked, a control) or one re-run of the window from the host
    snapshot (``kind`` ``window``: unchanged, or under one candidate fix)."""

    kind: str  # step | window
    variant: str  # original | same | masked | control (step); same | lr | adam | eps | ... (window)
    loss: float | None  # the step's global mean loss in this run
    grad_norm: float | None  # its pre-clip global grad norm
    normal: bool | None  # the update under the grad-norm rules' bars (None: not judged)
    removed: str | None  # the window judge's effect (removed, lowered, moved, not removed); None: not a fix
    seconds: float | None  # this execution's own time (window re-runs: the window's time is the proof's)
    cost: float | None  # window: the loss over its last steps minus the unchanged re-run's (+: the fix costs)
    bit_equal: bool | None  # ``same``: every rank's gradients bit-equal to the first execution's
    per_rank: tuple[tuple[float | None, float | None, int], ...]  # (loss sum, grad sum of squares, tokens)

    def ranks_in_words(self) -> str:
        """Each DP rank's share, in words (the page's per-rank cell)."""
        def n(v):
            return "n/a" if v is None else f"{v:.6g}"

        return "; ".join(f"DP rank {r}: loss sum {n(a)} over {t} tokens, gradient sum of squares {n(b)}"
                         for r, (a, b, t) in enumerate(self.per_rank))


@dataclass(frozen=True, slots=True)
class Proof:
    """A proof record, typed: what every view renders (:meth:`of` parses the dict the
    trainer wrote; ``record`` keeps it whole for the fields only one view shows)."""

    verdict: str  # the in-step verdict (:data:`VERDICTS`)
    applied: str | None  # the update the step trained with: original | same | masked | control | none
    would_apply: str | None  # what it called for where the policy or a bound held it back
    held_back: str | None  # a :data:`HELD_BACK` key
    why: str
    seconds: float
    runs: tuple[ProofRun, ...]  # the in-step executions, then the window's re-runs
    window_from: int | None  # the host snapshot's step the window re-ran from
    documents: tuple[str, ...]  # convicted documents as ``source:doc``
    record: dict[str, Any]

    @classmethod
    def of(cls, record: dict[str, Any]) -> Proof:
        v = record["verdict"]
        window = record.get("window") or {}
        runs = [ProofRun("step", e.get("variant", "?"), e.get("loss"), e.get("grad_norm"), e.get("normal"), None,
                         e.get("seconds"), None, e.get("bit_equal"),
                         tuple((x.get("loss"), x.get("grad_sq"), int(x.get("tokens") or 0))
                               for x in e.get("per_rank") or []))
                for e in record.get("executions") or []]
        runs += [ProofRun("window", r["variant"], r.get("loss"), r.get("grad_norm"), r.get("normal"),
                          None if r["variant"] == "same" else r.get("effect", "removed" if r.get("normal") else
                                                                    "not removed"),
                          None, r.get("cost"), None, ()) for r in window.get("runs") or []]
        return cls(verdict=v, applied=record.get("applied"),
                   would_apply=record.get("would_apply"), held_back=record.get("held_back"),
                   why=record.get("why", ""), seconds=float(record.get("seconds") or 0.0), runs=tuple(runs),
                   window_from=window.get("from_step"),
                   documents=tuple(f"{s}:{d}" for s, d in record.get("documents") or []), record=record)

    @property
    def executions(self) -> int:
        """The extra executions of the step (the first one is the run's own)."""
        return max(0, sum(r.kind == "step" for r in self.runs) - 1)

    def line(self) -> str:
        """The console's and the alert's line (:func:`describe_proof`)."""
        return describe_proof(self.record)

    def scalars(self) -> dict[str, float]:
        """The proof as dashboard scalars: ``proof/<verdict>`` 1.0, ``proof/executions``, ``proof/seconds``, ``proof/acted`` (the update applied
        was not the step's own), ``proof/held_back``, ``proof/adam_amplification``."""
        out = {f"proof/{v}": float(self.verdict == v) for v in VERDICTS}
        out["proof/executions"] = float(self.executions)
        out["proof/seconds"] = self.seconds
        out["proof/acted"] = float(self.applied not in (None, "original"))
        out["proof/held_back"] = float(self.held_back is not None)
        amp = (self.record.get("optimizer") or {}).get("amplification")
        if isinstance(amp, (int, float)):
            out["proof/adam_amplification"] = float(amp)
        return out

    def columns(self) -> dict[str, Any]:
        """The proof flattened for ``export`` (``proof_*`` columns)."""
        return {"proof_verdict": self.verdict, "proof_applied": self.applied, "proof_would_apply": self.would_apply,
                "proof_held_back": self.held_back, "proof_policy": self.record.get("policy"),
                "proof_executions": self.executions if self.runs else None, "proof_seconds": self.seconds,
                "proof_documents": list(self.documents),
                "proof_adam_amplification": (self.record.get("optimizer") or {}).get("amplification"),
                "proof_window_from": self.window_from}


def resolves(proof: dict[str, Any]) -> bool:
    """Whether the proof resolved its step (its event's action is the proof's, and the step
    is not on the auto-skip list): a verdict that acted or called for nothing (``outlier``;
    ``hardware`` keeping the first update). One that names no data or fault to act on
    (``not_data``, ``optimizer_state``) or that the policy or a bound held back (observe,
    the quarantine's size, a fragile run, the breaker) did not: the configured ``action``
    is the step's."""
    return proof.get("verdict") not in ("not_data", "optimizer_state") and proof.get("held_back") is None


def _done(proof: dict[str, Any], applied: str, verdict: str) -> str:
    """What the verdict's update is, in words (``applied``: the update it calls for)."""
    if verdict == "hardware":
        return {"same": "the recomputed update applied", "original": "the first update applied",
                "none": "no update applied (no two executions agree)"}[applied]
    return "trained without them, quarantined for the rest of the run"


def describe_proof(proof: dict[str, Any]) -> str:
    """The proof in one line (console, W&B alert, ``diagnose``). A verdict the policy or a
    bound kept from acting says what it would have done, and why it did not."""
    v = proof["verdict"]
    wants = proof.get("would_apply") or proof["applied"]
    held = proof.get("held_back")
    docs = proof.get("documents") or []
    named = ", ".join(f"{s}:{d}" for s, d in docs[:4]) + (" ..." if len(docs) > 4 else "")
    suspect = proof.get("suspect") or {}
    held_ranks = suspect.get("dp_ranks") or [suspect.get("dp_rank")]
    ranks = ("DP ranks " if len(held_ranks) > 1 else "DP rank ") + ", ".join(map(str, held_ranks))
    done = _done(proof, wants, v) if v in ("hardware", "bad_data") else ""
    if held is not None and done:
        done = "would have " + {"hardware": {"same": "applied the recomputed update", "original": "applied the first "
                                             "update", "none": "applied no update"}.get(wants, wants),
                                "bad_data": "trained without them and quarantined them"}[v]
        done += f" ({held_back_words(held)}" + (
            f": {proof['coverage']['refused']}" if held == "quarantine_bound" and proof.get("coverage") else
            f": the update moved the weights {proof['fragile'].get('param_norm_change_pre_median') or 0:.2%} of "
            f"their norm a step" if held == "fragile" and proof.get("fragile") else "") + ")"
    if v == "hardware":
        what = (f"hardware (transient): DP rank(s) {', '.join(map(str, proof.get('dp_ranks', [])))} changed "
                f"between executions; {done}")
    elif v == "bad_data":
        what = f"bad data on {ranks}" + (f", documents {named}" if named else "") + f"; {done}"
        if (proof.get("window") or {}).get("cause"):
            what += (f"; with the data unmasked, {proof['window']['cause']} removes the spike as well (a model its "
                     f"configuration made fragile): " + describe_window(proof["window"]))
    elif v == "outlier":
        what = (f"outlier data on DP rank {suspect.get('dp_rank')}" + (f" ({named})" if named else "")
                + ", the update is normal with it; nothing done")
        if proof.get("window"):  # a --ledger.rehearsal.prove_at step: the window replayed on a clean step
            what += "; " + describe_window(proof["window"])
    elif v == "optimizer_state":
        what = "Adam's state (not the data): " + proof.get("why", "")
        window = proof.get("window") or {}
        if window and window.get("cause") not in (None, v):  # Adam's own fix did not remove it; another did
            what += (f"; Adam's own fix did not remove it in the window, {window['cause']}'s did: "
                     + describe_window(window))
        elif window:
            what += "; " + describe_window(window)
    else:
        what = "not the data (reproducible): " + proof.get("why", "")
        if proof.get("window"):
            what += "; " + describe_window(proof["window"])
    n = len(proof.get("executions", [])) - 1
    late = f", decided at step {proof['decided_at']} with its update held" if "decided_at" in proof else ""
    return f"proven in step ({n} extra execution{'s' if n != 1 else ''}, {proof.get('seconds', 0):.2f} s{late}): {what}"


def describe_window(window: dict[str, Any]) -> str:
    """The window proof (``proof["window"]``, :mod:`titan_ledger.components.response.snapshots`)
    in words: each re-run, and the fixes that removed the spike, the cheapest first."""
    if "from_step" not in window:
        return f"window proof not run: {window.get('why', '')}" + (
            f" (failed: {window['error']})" if window.get("error") else "")

    def cost(r):
        c = r.get("cost")
        return "" if c is None or r.get("variant") == "same" else f", loss {c:+.3g}"

    def judged(r):
        if r.get("effect"):
            return r["effect"]
        return "normal" if r.get("normal") else "spiked"

    runs = ", ".join(f"{r['variant']} {judged(r)} (grad norm {r['grad_norm']:.3g}{cost(r)})"
                     for r in window.get("runs", []))
    head = f"{window['cause']} proven" if window.get("cause") else "no cause proven"
    fixes = window.get("fixes") or []
    best = ""
    if fixes:
        best = "; the cheapest fix: " + fixes[0]["variant"] + (
            f" (then {', '.join(f['variant'] for f in fixes[1:])})" if len(fixes) > 1 else "")
    return (f"{head} by the window from the host snapshot of step {window['from_step']} re-run in process "
            f"({window['steps']} steps, {window.get('seconds', 0):.1f} s: {runs}): {window.get('why', '')}{best}")
