"""The CPU rehearsal trains every parallelism from TOML over real gloo processes.

Reads the session's straight run of each parallelism (``runs.straight``, conftest.py),
which ``test_signals_exact.py`` and the resume tests read too.
"""

import json
import math

import pytest
from conftest import PARALLELISMS, PROVEN_STEP, STEPS
from helpers import TB_GRAD_NORM, read_tb, signals_rows

from titan_ledger.format.signal_columns import TIMING_KEYS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", list(PARALLELISMS))
def test_trains_from_toml(runs, case):
    dump = runs.straight(case)
    losses = read_tb(dump)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    # A fresh model over a 2048-token vocabulary starts near ln(2048) = 7.62 (the
    # cross-entropy: the z-loss the TP and PP runs add is w * z_loss of the ledger row)
    assert all(math.isfinite(v) for v in losses.values())
    ce = losses[1] - PARALLELISMS[case].z_loss * signals_rows(dump)[1]["z_loss"]
    assert abs(ce - math.log(2048)) < 1.0, (ce, losses)
    grad_norms = read_tb(dump, TB_GRAD_NORM)
    assert all(0 < g < 100 for g in grad_norms.values()), grad_norms
    if case == "FSDP2":
        val = read_tb(dump, "validation_metrics/loss")
        assert 2 in val and all(abs(v - math.log(2048)) < 1.0 for v in val.values()), val


@pytest.mark.parametrize("case", list(PARALLELISMS))
def test_a_proof_re_executes_the_step_bit_for_bit(runs, case):
    """The straight run's forced proof at step 2 (``--ledger.rehearsal.prove_at``): the
    step re-executed under this parallelism equals its first execution on every rank,
    so the proof applies the first update (and the resume tests' bit-equal rows after it
    show it left no trace)."""
    dump = runs.straight(case)
    events = [json.loads(x) for x in (dump / "ledger" / "spikes.jsonl").read_text().splitlines()[1:]]
    (proof,) = [e["proof"] for e in events if e.get("step") == PROVEN_STEP and "proof" in e]
    original, same = proof["executions"][:2]
    assert same["variant"] == "same" and same["bit_equal"] is True, proof
    assert (same["loss"], same["grad_norm"]) == (original["loss"], original["grad_norm"])
    assert len(same["per_rank"]) == PARALLELISMS[case].nproc
    assert proof["verdict"] in ("not_data", "outlier") and proof["applied"] == "original"
    assert signals_rows(dump)[PROVEN_STEP]["grad_norm"] == original["grad_norm"]


def test_under_pipeline_parallelism_a_deferred_proof_trains_what_an_in_step_proof_trains(runs):
    """PP: one optimizer per stage, each holding the flagged update through its own
    ``found_inf``; step 2's proof made at step 3 (the update applied at step 2's LR, step 3
    executed again) against the same run deciding in the step: every row bit for bit
    (``update_norm`` included: the late update is measured on step 2's row)."""
    a, b = signals_rows(runs.straight("PP")), signals_rows(runs.in_step("PP"))
    timing = TIMING_KEYS  # (the table's wall-clock columns)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert {k: v for k, v in a[step].items() if k not in timing} == \
            {k: v for k, v in b[step].items() if k not in timing}, step
    assert a[PROVEN_STEP]["update_norm"] > 0

    def proof(dump):
        events = [json.loads(x) for x in (dump / "ledger" / "spikes.jsonl").read_text().splitlines()[1:]]
        return next(e["proof"] for e in events if e.get("step") == PROVEN_STEP and "proof" in e)
    assert proof(runs.straight("PP"))["decided_at"] == PROVEN_STEP + 1 and "decided_at" not in proof(runs.in_step("PP"))
