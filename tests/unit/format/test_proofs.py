"""titan_ledger.format.proofs: the proof written (``ProofRecord``) and read back (``Proof``)
are one record: the response sets typed fields by name, ``to_json`` gives the dict on
disk (the fields set, in the fields' order, enums as their strings), and ``Proof.of``
reads it back."""

from __future__ import annotations

import json

from titan_ledger.format.proofs import Applied, Finding, Proof, ProofRecord


def test_a_proof_record_writes_the_fields_set_in_order_and_reads_back_as_the_same_proof():
    rec = ProofRecord(verdict=Finding.BAD_DATA, applied=Applied.MASKED, why="masking doc 7 brought it back",
                      acting=True, executions=[{"variant": "original", "loss": 9.5, "grad_norm": 40.0, "normal": False}],
                      documents=[["corpus", 7]])
    rec.seconds, rec.policy = 0.25, "act"
    rec.would_apply, rec.applied, rec.held_back = rec.applied, Applied.ORIGINAL, "quarantine_bound"
    out = rec.to_json()
    assert list(out) == ["verdict", "applied", "why", "acting", "executions", "seconds", "documents", "policy",
                         "would_apply", "held_back"]
    on_disk = json.loads(json.dumps(out))
    assert on_disk["verdict"] == "bad_data" and on_disk["would_apply"] == "masked" and on_disk["applied"] == "original"
    assert all(type(v) is str for k, v in out.items() if k in ("verdict", "applied", "would_apply"))
    proof = Proof.of(on_disk)
    assert (proof.verdict, proof.applied, proof.would_apply, proof.held_back) == \
        ("bad_data", "original", "masked", "quarantine_bound")
    assert proof.documents == ("corpus:7",) and proof.runs[0].variant == "original"


def test_a_window_proofs_runs_carry_the_one_judges_effect_and_no_cause_is_derived_here():
    rec = ProofRecord(verdict=Finding.NOT_DATA, applied=Applied.ORIGINAL, why="reproducible", acting=True,
                      executions=[], window={"cause": "lr", "from_step": 40, "fixes": [{"variant": "lr"}],
                                             "runs": [{"variant": "same", "loss": 5.0},
                                                      {"variant": "lr", "loss": 4.0, "effect": "removed"},
                                                      {"variant": "eps", "loss": 5.0, "effect": "moved"}]})
    proof = Proof.of(json.loads(json.dumps(rec.to_json())))
    assert proof.window_from == 40 and not hasattr(proof, "cause")  # the answer (format.answers) names it
    assert [r.removed for r in proof.runs] == [None, "removed", "moved"]
