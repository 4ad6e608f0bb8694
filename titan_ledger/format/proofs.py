"""What a proof at the alarm says, in words: one owner for the verdicts and their line.

Design decision: the proof record (the ``proof`` of a ``spikes.jsonl`` event) is
written by :mod:`titan_ledger.components.response.prover` and read by the trainer's console and
W&B alert and by ``diagnose``/``report``, which must not import torch; so its
vocabulary and its one-line description live here, pure.
"""

from __future__ import annotations

from typing import Any

#: the verdicts, worst first
VERDICTS = ("hardware", "bad_data", "optimizer_state", "not_data", "outlier")
#: the verdicts that act on a note (``prove = "all"``)
HARMFUL = ("hardware", "bad_data")


#: why a verdict that calls for an action did not act (a proof's ``held_back``)
HELD_BACK = {
    "observe": "--ledger.on_spike.act observe",
    "quarantine_bound": "the quarantine bound",
    "fragile": "a run already fragile",
    "breaker": "the circuit breaker",
}


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
        done += f" ({HELD_BACK.get(held, held)}" + (
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
        if proof.get("window"):
            what += "; " + describe_window(proof["window"])
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

    runs = ", ".join(f"{r['variant']} {'normal' if r['normal'] else 'spiked'} (grad norm {r['grad_norm']:.3g}{cost(r)})"
                     for r in window.get("runs", []))
    head = f"{window['cause']} proven" if window.get("cause") else "no cause proven"
    fixes = window.get("fixes") or []
    best = ""
    if fixes:
        best = "; the cheapest fix: " + fixes[0]["variant"] + (
            f" (then {', '.join(f['variant'] for f in fixes[1:])})" if len(fixes) > 1 else "")
    return (f"{head} by the window from the host snapshot of step {window['from_step']} re-run in process "
            f"({window['steps']} steps, {window.get('seconds', 0):.1f} s: {runs}): {window.get('why', '')}{best}")
