"""What a proof at the alarm says, in words: one owner for the verdicts and their line.

Design decision: the proof record (the ``proof`` of a ``spikes.jsonl`` event) is
written by :mod:`titan_ledger.components.response.prover` and read by the trainer's console and
W&B alert and by ``diagnose``/``report``, which must not import torch; so its
vocabulary and its one-line description live here, pure.
"""

from __future__ import annotations

from typing import Any

#: the verdicts, worst first
VERDICTS = ("hardware", "bad_data", "not_data", "outlier")
#: the verdicts that act on a note (``prove = "all"``)
HARMFUL = ("hardware", "bad_data")


def describe_proof(proof: dict[str, Any]) -> str:
    """The proof in one line (console, W&B alert, ``diagnose``)."""
    v, applied = proof["verdict"], proof["applied"]
    docs = proof.get("documents") or []
    named = ", ".join(f"{s}:{d}" for s, d in docs[:4]) + (" ..." if len(docs) > 4 else "")
    suspect = proof.get("suspect") or {}
    held = suspect.get("dp_ranks") or [suspect.get("dp_rank")]
    ranks = ("DP ranks " if len(held) > 1 else "DP rank ") + ", ".join(map(str, held))
    if v == "hardware":
        what = (f"hardware (transient): DP rank(s) {', '.join(map(str, proof.get('dp_ranks', [])))} changed "
                f"between executions; " + {"same": "the recomputed update applied",
                                           "original": "the first update applied",
                                           "none": "no update applied (no two executions agree)"}[applied])
    elif v == "bad_data":
        what = (f"bad data on {ranks}" + (f", documents {named}" if named else "")
                + "; trained without them, quarantined for the rest of the run")
        if (proof.get("window") or {}).get("cause"):
            what += (f"; with the data unmasked, {proof['window']['cause']} removes the spike as well (a model its "
                     f"configuration made fragile): " + describe_window(proof["window"]))
    elif v == "outlier":
        what = (f"outlier data on DP rank {suspect.get('dp_rank')}" + (f" ({named})" if named else "")
                + ", the update is normal with it; nothing done")
        if proof.get("window"):  # a --ledger.rehearsal.prove_at step: the window replayed on a clean step
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
    in words."""
    if "from_step" not in window:
        return f"window proof not run: {window.get('why', '')}"
    runs = ", ".join(f"{r['variant']} {'normal' if r['normal'] else 'spiked'} (grad norm {r['grad_norm']:.3g})"
                     for r in window.get("runs", []))
    head = f"{window['cause']} proven" if window.get("cause") else "no cause proven"
    return (f"{head} by the window from the host snapshot of step {window['from_step']} re-run in process "
            f"({window['steps']} steps, {window.get('seconds', 0):.1f} s: {runs}): {window.get('why', '')}")
