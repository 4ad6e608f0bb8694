"""bench/zoo.py's pure parts, without training.

The synthetic copy corpus (the "sharp" model's data): each document must be one
phrase of COPY_PERIOD one-token words repeated, so that after the first period every
token is predictable only by looking back COPY_PERIOD positions (attention), the
property the sharp scenarios rely on. ``adam_peak``: the Adam recursion behind the
README's argument that the optimizer-state cause needs thousands of steps.
"""

import math

import pytest
from helpers import ROOT, load_bench


def test_copy_documents_repeat_one_phrase_of_one_token_words():
    zoo = load_bench("zoo")
    from titan_ledger.data.prepare import load_tokenizer

    tok = load_tokenizer(str(ROOT / "titan_ledger" / "assets" / "tokenizer"))
    docs = zoo.copy_documents(tok, seed=0)
    assert len(docs) == zoo.COPY_DOCS
    for d in docs[:50]:
        ids = tok.encode(d["text"], add_bos=False, add_eos=False)
        p = zoo.COPY_PERIOD
        assert len(ids) == 256 // p * p
        assert ids == ids[:p] * (256 // p), d["text"][:80]  # one token per word, one phrase repeated
    vocab = {w for d in docs for w in d["text"].split()}
    assert 100 < len(vocab) <= zoo.COPY_WORDS
    assert docs[0] != docs[1] and zoo.copy_documents(tok, seed=0)[:3] == docs[:3]  # seeded
    assert zoo.copy_documents(tok, seed=1)[:3] != docs[:3]


def test_adam_peak_matches_the_closed_forms():
    zoo = load_bench("zoo")
    for b2 in (0.95, 0.99, 0.999):
        # a steady gradient under bias-corrected Adam: every update is exactly 1
        assert zoo.adam_peak(b2, 100, 0) == pytest.approx(1.0)
        # no history and no bias correction: (1 - b1^k) / sqrt(1 - b2^k), maximised over k
        closed = max((1 - 0.9 ** k) / math.sqrt(1 - b2 ** k) for k in range(1, 5001))
        assert zoo.adam_peak(b2, 0, 0, after=5000, bias_correction=False) == pytest.approx(closed)
    assert zoo.adam_peak(0.999, 0, 0, after=5000, bias_correction=False) == pytest.approx(6.568520, abs=1e-6)  # the README's 6.57
    # a short run: bias correction keeps v_hat the plain mean of g^2 so far, so a
    # 100-step plateau after 100 normal steps amplifies the next updates by < 1.4x
    assert zoo.adam_peak(0.999, 100, 100) == pytest.approx(1.303384, abs=1e-6)


# --------------------------------------------------------------------------- the proof at the alarm
def _proof(verdict, acting=True, dp_rank=None, docs=None, dp_ranks=None):
    p = {"verdict": verdict, "applied": "none" if verdict == "hardware" else "same", "acting": acting,
         "executions": [], "seconds": 1.0}
    if dp_rank is not None:
        p["suspect"] = {"dp_rank": dp_rank, "evidence": "doc_high"}
    if docs is not None:
        p["documents"] = docs
    if dp_ranks is not None:
        p["dp_ranks"] = dp_ranks
    return p


def test_proof_rows_read_both_tiers_in_step_order():
    zoo = load_bench("zoo")
    events = [{"step": 30, "rules": ["doc_high"], "notes": [], "proof": _proof("bad_data", True, 1, [["zoo", 7]])},
              {"step": 31, "rules": ["ratio"], "notes": []},  # not proven (prove off, or before proofs)
              {"step": 12, "notes": ["doc_low"], "proof": _proof("outlier", False, 0)},  # a note event
              {"step": 20, "rules": ["doc_low"], "notes": ["doc_low"], "promoted_by_proof": True,
               "proof": _proof("hardware", False, dp_ranks=[1])}]
    rows = zoo.proof_rows(events)
    assert [r["step"] for r in rows] == [12, 20, 30]
    assert rows[0] == {"step": 12, "tier": "note", "promoted": False, "verdict": "outlier", "applied": "same",
                       "dp_rank": 0, "dp_ranks": None, "documents": None, "abnormal": False}
    assert rows[1]["tier"] == "note" and rows[1]["promoted"] and rows[1]["dp_ranks"] == [1]
    assert rows[2]["tier"] == "acting" and rows[2]["documents"] == [["zoo", 7]] and rows[2]["dp_rank"] == 1
    assert zoo.proof_counts(rows) == {"note": {"outlier": 1, "hardware": 1}, "acting": {"bad_data": 1}}
    assert zoo.proof_rows([]) == [] and zoo.proof_counts([]) == {}
    # group testing names the ranks holding the documents in its suspect; the first update's verdict
    bisected = _proof("bad_data", True, 0, [["split", 7]])
    bisected["suspect"]["dp_ranks"] = [0, 1]
    bisected["executions"] = [{"variant": "original", "normal": False}]
    row = zoo.proof_rows([{"step": 9, "rules": ["ratio"], "proof": bisected}])[0]
    assert row["dp_ranks"] == [0, 1] and row["abnormal"] is True


def test_proof_verdict_against_the_truth():
    zoo = load_bench("zoo")
    row = lambda step, v, **k: {"step": step, "tier": "acting", "promoted": False, "verdict": v,  # noqa: E731
                                "applied": "same", "dp_rank": k.get("dp_rank"), "dp_ranks": None,
                                "documents": k.get("docs")}
    expected = {"bad_data": "bad_data", "hardware": "hardware", "lr": "not_data"}
    assert {k: zoo.EXPECTED_VERDICT[k] for k in expected} == expected
    # planted document: the first proof in [true - 1, true + 5] is the spike's
    p = zoo.proof_verdict("bad_data", 28, [row(5, "outlier"), row(29, "bad_data", dp_rank=1, docs=[["zoo", 41]]),
                                           row(30, "not_data")], true_documents=[41])
    assert p["proof_match"] and p["proof_step"] == 29 and p["proof_dp_rank"] == 1 and p["proof_named_planted"]
    assert p["proof_harmful_elsewhere"] == [] and p["proofs"] == 3
    assert not zoo.proof_verdict("bad_data", 28, [row(28, "bad_data", docs=[["zoo", 3]])],
                                 true_documents=[41])["proof_named_planted"]
    # a bit flip proven not_data, an LR relaunch proven hardware: no match
    assert not zoo.proof_verdict("hardware", 28, [row(28, "not_data")])["proof_match"]
    assert zoo.proof_verdict("lr", 21, [row(22, "not_data")])["proof_match"]
    assert not zoo.proof_verdict("lr", 21, [row(21, "hardware")])["proof_match"]
    # no proof near the true step: no match; a harmful one elsewhere is reported
    far = zoo.proof_verdict("hardware", 28, [row(10, "bad_data"), row(40, "hardware")])
    assert not far["proof_match"] and far["proof_step"] is None
    assert far["proof_harmful_elsewhere"] == [[10, "bad_data"], [40, "hardware"]]
    # the window: before=0, after=0 is the step itself (bench_detection's injections)
    assert zoo.proof_verdict("bad_data", 30, [row(29, "bad_data")], before=0, after=0)["proof_step"] is None
    assert zoo.proof_verdict("bad_data", 30, [row(30, "bad_data")], before=0, after=0)["proof_match"]
    # a control: matches when no proof found a harmful cause
    assert zoo.proof_verdict(None, None, [row(3, "outlier"), row(9, "not_data")])["proof_match"]
    ctl = zoo.proof_verdict(None, None, [row(3, "outlier"), row(9, "bad_data")])
    assert not ctl["proof_match"] and ctl["proof_harmful_elsewhere"] == [[9, "bad_data"]]
    assert zoo.proof_verdict(None, None, [])["proof_match"]
    assert "MATCH" in zoo.proof_line(p) and "zoo:41" in zoo.proof_line(p) and "DP rank 1" in zoo.proof_line(p)
    assert zoo.proof_line(ctl).startswith("no proof at the spike NO MATCH")


def test_end_state_names_the_failed_audit_checks_and_where_the_run_ended():
    """precision_real's evidence: a cause that never spikes is judged by the audit at
    start and by where the run ended, against its prevention."""
    zoo = load_bench("zoo")

    class Led:
        def __init__(self, audit, rows):
            self.audit, self.rows = audit, rows

        def precision(self):
            return self.audit

        def trained_rows(self):
            return self.rows

    rows = [{"step": s, "loss": 8.0 - s / 100, "param_norm": 365.8 + s / 100, "logz_max": 10.0 + (s == 7),
             "max_logit": 3.0} for s in range(1, 201)]
    audit = [{"check": "master weights", "found": "bfloat16", "ok": False},
             {"check": "compute dtype", "found": "bfloat16", "ok": None},
             {"check": "norm statistics", "found": "float32", "ok": True}]
    failed, end = zoo.end_state(Led(audit, rows))
    assert failed == ["master weights: bfloat16"]  # informative (None) and passing checks are not failures
    assert end == {"steps": 200, "param_norm": 367.8, "param_norm_start": 365.81,
                   "loss_last100_median": pytest.approx(8.0 - 150.5 / 100), "logz_max": 11.0, "max_logit": 3.0,
                   "logz_max_last_tenth_median": 10.0, "logz_max_last_tenth_max": 10.0}  # step 7's 11 is early
    assert zoo.end_state(Led(None, [])) == ([], {"steps": 0, "param_norm": None, "param_norm_start": None,
                                                "loss_last100_median": None, "logz_max": None, "max_logit": None,
                                                "logz_max_last_tenth_median": None,
                                                "logz_max_last_tenth_max": None})
    assert zoo.BY_NAME["precision_real"].prevention == ("--training.dtype", "float32")
    assert zoo.BY_NAME["output_logits_long"].set == "long"  # its horizon is outside --set real's budget


def test_the_summary_says_which_window_proofs_name_the_truth_a_stalls_included():
    """A stall's proof is a forced one (no spike event): it counts, as the stall's."""
    zoo = load_bench("zoo")
    stall = zoo.Result("logit_stall_lr02", "real", "logit_growth", window=[
        [25, "lr", 0, 9.4, "spike"], [352, "logit_growth", 140, 123.5, "stall"]])
    lr = zoo.Result("lr_warmup_real", "real", "lr", window=[[26, "lr", 0, 8.0, "spike"]])
    plateau = zoo.Result("optimizer_state_plateau", "real", "optimizer_state",
                         window=[[123, "lr", 100, 33.0, "spike"], [420, "optimizer_state", 400, 40.0, "spike"]])
    line = next(x for x in zoo.summary([stall, lr, plateau]) if x.startswith("window proofs"))
    assert line.startswith("window proofs name the truth in 2/3 runs"), line
    assert "logit_stall_lr02: lr / logit_growth" in line and "optimizer_state_plateau: lr / -" in line
