"""The tree's fingerprint questions (F1-F3) on recorded real runs, and the readings' math (issue 51).

``data/real_fingerprints.json`` holds rows recorded by ``bench/zoo.py --set real --seed S``
(S = 0, 1; the tiny model, nothing injected): the run's first 20 trained steps and the 50
before / 10 after its first acting flag, with the launch's precision audit. A seed is a
different initialisation of the same configuration; the LR runs flagged at other steps
(26 and 70; 22 and 10), and the tree must name the same cause on both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_ledger.components.detection import fingerprints as fp
from titan_ledger.tools.decision import Thresholds, classify

CASES = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "real_fingerprints.json").read_text())


def _classify(name, th=None):
    c = CASES[name]
    return classify(c["rows"], c["step"], th, precision=c["precision"], start=c["start"])


def _yes(got):
    return [c["question"].split(" ")[0] for c in got["checks"] if c["answer"]]


@pytest.mark.parametrize("name", ["lr_warmup_real_seed0", "lr_divergence_real_seed0", "lr_warmup_real_seed1",
                                  "lr_divergence_real_seed1"])
def test_an_lr_too_large_for_the_model_is_named_lr_on_both_seeds_with_the_lr_that_prevents_it(name):
    got = _classify(name)
    assert got["cause"] == "lr" and "F2" in _yes(got), got
    rel = got["fingerprints"]["update"]["relative_update_pre_median"]
    assert 0.04 <= rel <= 0.16  # 4-16% of the param norm a step
    assert got["margins"]["F2"] == pytest.approx(rel / 0.01)  # how sure: how far past its bar
    flags = got["prevention"]["flags"]
    lr = got["fingerprints"]["schedule"]["peak_lr"]
    assert flags[0] == "--optimizer.lr" and float(flags[1]) == pytest.approx(lr * 0.01 / rel, rel=0.05)
    if "Q1" in _yes(got):  # the attention logits rose with it: the LR's mechanism, not the cause
        assert got["mechanism"] == "logit_growth"


def test_the_lr_the_tree_names_for_the_divergence_is_the_one_that_prevented_it():
    """The zoo's lr_divergence_real ran at LR 1.0; its prevention (LR 0.1, warm-up 300) had
    no acting flag in 400 steps. The tree, from the run's own update sizes: <= 0.093."""
    got = _classify("lr_divergence_real_seed0")
    assert got["prevention"]["flags"] == ["--optimizer.lr", "0.093"]
    s = got["fingerprints"]["schedule"]
    assert (s["warmup_steps"], s["after_peak"], s["warming_up"]) == (20, 2, False)
    # seed 1 flagged at step 10, still in the warm-up: its length is unknown, and the text says so
    s1 = _classify("lr_divergence_real_seed1")
    assert s1["fingerprints"]["schedule"]["warming_up"] is True
    assert s1["fingerprints"]["schedule"]["warmup_steps"] is None
    assert "still warming up" in s1["prevention"]["text"]


@pytest.mark.parametrize("name", ["optimizer_state_real_seed0", "optimizer_state_real_seed1"])
def test_adams_amplified_update_after_quiet_gradients_names_the_optimizer_state(name):
    """1,759 steps of one easy document (grad norm 4.7 -> 0.0015), then the text: the loss
    never comes back (divergence), and what drove it is Adam's update per unit LR ~30x its
    median -- the second moment lagging the returned gradients (the article's section 2.6)."""
    got = _classify(name)
    assert got["cause"] == "divergence" and got["underlying"] == "optimizer_state", got
    a = got["fingerprints"]["adam"]
    assert a["adam_amplification"] >= 20 and a["quiet_gradients"] <= 0.01, a
    assert got["prevention"]["flags"] == ["--optimizer.betas", "0.9", "0.95", "--optimizer.eps", "1e-8"]


def test_the_same_run_at_an_ordinary_step_reads_no_fingerprint():
    got = _classify("quiet_lr3e-3_seed0")  # LR 3e-3, nothing flagged: 0.03% of the param norm a step
    assert not {"F1", "F2", "F3"} & set(_yes(got)), _yes(got)
    assert got["fingerprints"]["update"]["relative_update_pre_median"] < 0.001
    assert got["cause"] not in ("lr", "optimizer_state")


@pytest.mark.parametrize("name", ["embedding_real_seed0", "embedding_real_seed1"])
def test_a_small_embedding_at_lr_0_1_reads_as_an_lr_too_large_for_the_weights(name):
    """Embeddings at std 0.02 under LR 0.1: the update moves the small weights 3-8% a
    step. The tree names the LR (its prevention: the LR those weights can take); the zoo's
    own prevention scales the weights up instead (std 1.0) -- the same ratio from the
    other side."""
    got = _classify(name)
    assert got["cause"] == "lr" and "F2" in _yes(got)


def test_the_bars_are_the_thresholds():
    th = Thresholds(bars=fp.Bars(rel_update=0.2))
    assert "F2" not in _yes(_classify("lr_warmup_real_seed0", th))
    th = Thresholds(bars=fp.Bars(adam_amp=100.0))
    assert _classify("optimizer_state_real_seed0", th).get("underlying") != "optimizer_state"


# --------------------------------------------------------------------------- the readings (pure)
def _rows(n, lr_at, **cols):
    return [{"step": s, "lr": lr_at(s), **{k: f(s) for k, f in cols.items()}} for s in range(1, n + 1)]


def test_the_schedule_reading_finds_the_warmup_and_where_the_step_sits():
    rows = _rows(100, lambda s: 1e-3 * min(s, 40) / 40)  # 40 warm-up steps, then flat
    s = fp.lr_schedule(rows[:60], rows[60:79], rows[79])
    assert (s["warmup_steps"], s["after_peak"], s["after_peak_warmups"], s["warming_up"]) == (40, 40, 1.0, False)
    s = fp.lr_schedule(rows[:30], rows[:29], rows[29])  # step 30, still rising
    assert s["warming_up"] is True and s["warmup_steps"] is None
    # the first rows were not read up to the peak (a warm-up longer than ``start``): unknown
    s = fp.lr_schedule(rows[:10], rows[60:79], rows[79])
    assert s["warmup_steps"] is None and s["peak_lr"] == pytest.approx(1e-3)
    # no first rows at all (a ledger that starts late): unknown too
    assert fp.lr_schedule([], rows[60:79], rows[79])["warmup_steps"] is None


def test_adams_reading_is_per_unit_lr_so_a_schedule_is_not_an_amplification():
    # the update follows the LR (Adam is scale-free): no amplification, whatever the schedule does
    rows = _rows(60, lambda s: 1e-3 * min(s, 30) / 30, update_norm=lambda s: 50 * 1e-3 * min(s, 30) / 30,
                 grad_norm=lambda s: 1.0)
    a = fp.adam(rows[:20], rows[:59], rows[59], fp.Bars())
    assert a["adam_amplification"] == pytest.approx(1.0) and a["quiet_gradients"] == pytest.approx(1.0)
    rows[59]["update_norm"] *= 30
    assert fp.adam(rows[:20], rows[:59], rows[59], fp.Bars())["adam_amplification"] == pytest.approx(30)
    assert fp.adam(rows[:20], rows[:59], {"step": 60}, fp.Bars())["adam_amplification"] is None  # not recorded


def test_log_z_drift_needs_both_a_rise_and_a_level():
    bars = fp.Bars()
    early = [{"step": s, "logz_max": 8.0} for s in range(1, 21)]
    f = {"logz": fp.logz(early, [{"step": 100, "logz_max": 30.0}], {"step": 101}, bars)}
    assert f["logz"]["logz_rise"] == pytest.approx(3.75) and fp.logz_drift(f, bars)
    f = {"logz": fp.logz(early, [{"step": 100, "logz_max": 14.0}], {"step": 101}, bars)}
    assert not fp.logz_drift(f, bars)  # 1.75x: under the bar


def test_every_not_data_cause_names_a_prevention_with_its_flags():
    for cause in ("logit_growth", "optimizer_state", "bf16", "output_logits"):
        p = fp.prevention(cause, {})
        assert p["text"] and p["flags"] and all(x.startswith("--") for x in p["flags"][:1]), (cause, p)
    assert fp.prevention("bad_data", {}) is None and fp.prevention("hardware", {}) is None
    assert fp.prevention("lr", {})["flags"] == []  # no update recorded: no value to compute


def test_data_proven_in_a_run_the_lr_made_fragile_says_both():
    """The real set's LR 0.3 run (no bad data planted) had documents convicted in step: the
    proof stands (masking them did bring the update back), and the verdict adds that the
    run's fingerprint says lr, with the LR's prevention; the LR's mechanism is dropped."""
    from titan_ledger.tools.incident import note_fragile

    res = _classify("lr_warmup_real_seed0")
    assert res["mechanism"] == "logit_growth"
    res.update(cause="bad_data", certainty="proven")
    note_fragile(res)
    assert "fingerprint says lr" in res["fragile"] and "5.9%" in res["fragile"]
    assert res["prevention"]["flags"][0] == "--optimizer.lr" and "mechanism" not in res
    quiet = _classify("quiet_lr3e-3_seed0")
    quiet.update(cause="bad_data", certainty="proven")
    note_fragile(quiet)
    assert "fragile" not in quiet  # no configuration fingerprint: the data alone


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(("lr_", "quiet"))])
def test_without_update_norm_the_lr_is_read_from_the_param_norms_own_moves(name):
    """--ledger.update_norm is off by default: F2 then reads the param norm's change a step
    (a lower bound of the update, >= 0.2%), F1 cannot be read and says what it needs, and
    the LR's prevention gives no value it cannot compute."""
    c = CASES[name]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "update_norm"} for r in rs]  # noqa: E731
    got = classify(strip(c["rows"]), c["step"], precision=c["precision"], start=strip(c["start"]))
    assert ("F2" in _yes(got)) == name.startswith("lr_"), got["checks"]
    assert next(x for x in got["checks"] if x["question"].startswith("F1 "))["needs"] == "--ledger.update_norm"
    if name.startswith("lr_"):
        assert got["cause"] == "lr" and got["prevention"]["flags"] == []
        assert "--ledger.update_norm" in got["prevention"]["text"]


def test_the_lr_fingerprints_onset_is_where_the_large_updates_began():
    """The real set's LR runs moved the weights >= 2% from their first step: onset 1 (a
    rerun from the first step's checkpoint then proves the LR; tests/bench/test_zoo.py)."""
    assert _classify("lr_divergence_real_seed0")["onset"] == 1
    bars = fp.Bars()
    rows = [{"step": s, "param_norm": 100.0, "update_norm": 0.5 if s < 30 else 3.0} for s in range(1, 50)]
    assert fp.lr_onset(rows[:40], rows[40:], 50, bars) == 30  # 0.5% a step until 29, then 3%
    assert fp.lr_onset(rows[:10], rows[35:], 50, bars) is None  # the stretch reaches past a gap: earlier
    assert fp.lr_onset(rows[:20], [], 21, bars) is None  # no large update before the step
    # without update_norm: the param norm's own moves (0.3% a step from step 30)
    rows = [{"step": s, "param_norm": 100.0 * (1.003 ** max(0, s - 29))} for s in range(1, 50)]
    assert fp.lr_onset(rows, [], 50, bars) == 30


def test_a_window_proof_that_named_a_cause_decides_the_verdict_and_its_prevention():
    """The trainer's window proof (host snapshots) re-ran the window and one variant alone
    removed the spike: ``diagnose`` says that cause, proven in process, with that cause's
    prevention, and keeps the tree's reading as ``heuristic``; a window proof that named
    nothing leaves the tree's verdict as it was."""
    from titan_ledger.tools.incident import _apply_proof

    window = {"cause": "optimizer_state", "variant": "adam", "why": "with the adam variant alone ...",
              "from_step": 0, "steps": 26, "seconds": 2.0,
              "runs": [{"variant": "same", "loss": 9.0, "grad_norm": 9.2, "normal": False},
                       {"variant": "adam", "loss": 6.1, "grad_norm": 0.4, "normal": True}]}
    res = {**_classify("lr_warmup_real_seed0"), "certainty": "evidence", "certainty_rule": "F2"}  # as judge() has it
    _apply_proof(res, {"verdict": "not_data", "applied": "original", "why": "reproducible", "window": window})
    assert (res["cause"], res["certainty"], res["heuristic"]) == ("optimizer_state", "proven", "lr")
    assert res["certainty_rule"].startswith("proven in process: optimizer_state proven by the window")
    assert "mechanism" not in res and "--optimizer.betas" in res["prevention"]["flags"]
    assert res["proof"]["window"]["from_step"] == 0
    res = {**_classify("lr_warmup_real_seed0"), "certainty": "evidence", "certainty_rule": "F2"}
    before = dict(res)
    _apply_proof(res, {"verdict": "not_data", "applied": "original", "why": "reproducible",
                       "window": {**window, "cause": None, "variant": None}})
    assert (res["cause"], res["certainty"]) == (before["cause"], before["certainty"])


def test_data_convicted_where_the_window_at_a_lower_lr_removes_the_spike_too_says_both_proven():
    """The proof convicted documents, and the window proof re-ran the window with the data
    unmasked: the LR variant alone removed the spike as well. The verdict stays the
    proof's (bad data, proven); ``fragile`` says the LR is proven too, and the prevention
    is the LR's -- not the fingerprint's guess, which note_fragile leaves alone then."""
    from titan_ledger.format.proofs import describe_proof
    from titan_ledger.tools.incident import _apply_proof, note_fragile

    window = {"cause": "lr", "variant": "lr", "why": "with the lr variant alone ...", "from_step": 100, "steps": 26,
              "seconds": 3.0, "runs": [{"variant": "same", "loss": 9.0, "grad_norm": 94.7, "normal": False},
                                       {"variant": "lr", "loss": 6.1, "grad_norm": 2.0, "normal": True}]}
    proof = {"verdict": "bad_data", "applied": "masked", "why": "group testing", "window": window,
             "suspect": {"dp_rank": 0, "evidence": "bisection"}, "documents": [["zoo", 3], ["zoo", 4]]}
    res = {**_classify("lr_warmup_real_seed0"), "certainty": "evidence", "certainty_rule": "F2"}
    _apply_proof(res, proof)
    note_fragile(res)
    assert (res["cause"], res["certainty"]) == ("bad_data", "proven")
    assert res["fragile"].startswith("proven in process: with the convicted data unmasked, lr proven by the window")
    assert res["prevention"]["flags"][0] == "--optimizer.lr"
    assert "lr removes the spike as well" in describe_proof(proof)


def test_a_forced_proofs_window_on_an_outlier_is_shown_and_proves_nothing():
    """``--ledger.rehearsal.prove_at`` on a step whose suspect data stood out but whose
    update was normal: the window replayed there is kept in ``diagnose``'s proof and in
    the console line, and the verdict stays the tree's."""
    from titan_ledger.format.proofs import describe_proof
    from titan_ledger.tools.incident import _apply_proof

    window = {"cause": None, "variant": None, "why": "the unchanged re-run did not flag the step", "from_step": 0,
              "steps": 6, "seconds": 0.4, "runs": [{"variant": "same", "loss": 6.0, "grad_norm": 0.4, "normal": True}]}
    proof = {"verdict": "outlier", "applied": "original", "window": window, "suspect": {"dp_rank": 1}}
    res = {**_classify("lr_warmup_real_seed0"), "certainty": "evidence", "certainty_rule": "F2"}
    before = (res["cause"], res["certainty"])
    _apply_proof(res, proof)
    assert (res["cause"], res["certainty"]) == before
    assert res["proof"]["window"]["from_step"] == 0
    assert "no cause proven by the window from the host snapshot of step 0" in describe_proof(proof)
