"""Spike rules (on-device code run on CPU) over synthetic ledgers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.unit.tools.test_diagnose import ledger
from titan_ledger.components.detection.spike_rules import EROWS, evidence, window_rules
from titan_ledger.components.detection.spikes import STAT_KEYS, SpikeDetector, describe, detect_offline, is_note
from titan_ledger.errors import ConfigError


def test_rules_flag_spikes_and_nan_and_keep_the_window_clean():
    rows = ledger(300)
    rows[200].update(loss=4.8, grad_norm=9.0)
    rows[250]["loss"] = float("nan")
    events = detect_offline(rows, SpikeDetector.Config())
    assert [e["step"] for e in events] == [201, 251]
    assert set(events[0]["rules"]) == {"zscore_loss", "zscore_grad_norm", "ratio", "grad_jump"}
    assert events[1]["rules"] == ["non_finite"]
    # the flagged value never entered the window: the mean is unaffected
    assert abs(events[1]["grad_norm_mean"] - 1.0) < 0.02


def test_rules_wait_for_half_a_window_and_can_be_switched_off():
    det = SpikeDetector(SpikeDetector.Config(window=8))
    for i in range(3):
        assert det.step(torch.tensor(2.0), torch.tensor(1.0 + 0.01 * i))[0] == 0
    assert det.step(torch.tensor(50.0), torch.tensor(50.0))[0] == 0  # only 3 < 4 steps seen
    off = SpikeDetector(SpikeDetector.Config(window=8, zscore=0, ratio=0, grad_jump=0, doc_outlier=0, separation=0))
    for i in range(8):
        off.step(torch.tensor(2.0 + 0.01 * i), torch.tensor(1.0))
    stats = off.step(torch.tensor(50.0), torch.tensor(50.0)).tolist()
    assert stats[0] == 0 and len(stats) == len(STAT_KEYS)
    assert describe(off.step(torch.tensor(math.inf), torch.tensor(1.0)).tolist())["rules"] == ["non_finite"]


def test_ratio_rule_starts_after_min_history_not_half_a_window():
    """The zoo's LR jump (relaunch at step 21) spiked at step 25: the z-score rule (128
    steps / 2) was not active, the ratio rule must be (a median of 8 steps will do)."""
    rows = ledger(30)
    rows[24].update(loss=rows[24]["loss"] * 1.25, grad_norm=3.4)
    ev = detect_offline(rows, SpikeDetector.Config(grad_jump=0))
    assert [e["step"] for e in ev] == [25] and ev[0]["rules"] == ["ratio"]
    rows = ledger(30)
    rows[5].update(loss=rows[5]["loss"] * 1.25, grad_norm=3.4)  # step 6 < min_history: not yet
    assert detect_offline(rows, SpikeDetector.Config(grad_jump=0)) == []


def test_detector_state_round_trip():
    a = SpikeDetector(SpikeDetector.Config(window=16))
    for i in range(10):
        a.step(torch.tensor(2.0 + 0.01 * i), torch.tensor(1.0))
    b = SpikeDetector(SpikeDetector.Config(window=16))
    b.load_state_dict(a.state_dict())
    x = (torch.tensor(3.0), torch.tensor(4.0))
    assert torch.equal(a.step(*x).nan_to_num(), b.step(*x).nan_to_num())


def _doc(med=3.0, hi=3.3, lo=2.7, n=5):
    return [med, hi, lo, n]


def _evidence_run(**cfg):
    import random

    rnd = random.Random(0)
    det = SpikeDetector(SpikeDetector.Config(window=32, **{"separation_warmup": 8, **cfg}))
    fired, noted = {}, {}
    for t in range(1, 61):
        doc = torch.tensor([_doc(hi=3.3 + rnd.gauss(0, 0.03), lo=2.7 + rnd.gauss(0, 0.03)), _doc(), _doc()],
                           dtype=torch.float64)
        dp = torch.tensor([3.0, 3.0, 3.0], dtype=torch.float64)
        gn = torch.tensor(1.0 + 0.02 * t)  # a trend: the history follows it
        if t == 20:  # rank 2 read repeated text: one document far below its batch
            doc[2, 2] = 0.05
        if t == 30:  # rank 1 read random text: all its documents above everyone's
            doc[1] = torch.tensor(_doc(med=6.0, hi=6.1, lo=5.9), dtype=torch.float64)
            dp[1] = 6.0
        if t == 40:  # a skewed gradient
            gn = torch.tensor(20.0)
        stats = det.step(dp.mean(), gn, dp, doc).tolist()
        if stats[0]:
            fired[t] = describe(stats)
        elif is_note(stats):
            noted[t] = describe(stats)
    return fired, noted


def test_evidence_rules_name_the_rank_and_do_not_lock_in():
    # before the tiers (every rule acts)
    fired, noted = _evidence_run(notes="")
    assert sorted(fired) == [20, 30, 40] and noted == {}, fired
    assert fired[20]["rules"] == ["doc_low"] and fired[20]["doc_low_rank"] == 2
    assert "rank_separation" in fired[30]["rules"] and fired[30]["separation_rank"] == 1
    assert "grad_jump" in fired[40]["rules"]


def test_document_outliers_are_notes_by_default_and_the_rest_still_acts():
    fired, noted = _evidence_run()
    assert sorted(fired) == [30, 40] and sorted(noted) == [20], (fired, noted)
    assert noted[20]["rules"] == [] and noted[20]["notes"] == ["doc_low"] and noted[20]["doc_low_rank"] == 2
    # rank 1's random batch is decisive: far past what the separation statistic has been
    assert "rank_separation" in fired[30]["rules"] and fired[30]["separation_y"] > fired[30]["separation_bound"]
    assert "grad_jump" in fired[40]["rules"] and fired[40]["notes"] == []


def _sep_step(det, gap):
    """One DP-2 step whose rank 0 sits ``gap`` (log) above rank 1 (documents spread 0.1)."""
    import math

    hi = math.exp(1.0 + gap + 0.1)
    doc = torch.tensor([[math.exp(1.0 + gap + 0.05), hi, math.exp(1.0 + gap), 5],
                        [math.exp(1.05), math.exp(1.1), math.exp(1.0), 5]], dtype=torch.float64)
    return det.step(torch.tensor(3.0), torch.tensor(1.0), torch.tensor([3.0, 3.0]), doc).tolist()


def test_rank_separation_acts_only_past_its_own_history_and_not_in_the_first_steps():
    det = SpikeDetector(SpikeDetector.Config(window=64, min_history=8, separation_warmup=8))
    # step 1: separated by 4 spreads, but no history yet: a note, not a spike
    first = _sep_step(det, 0.5)
    assert not first[0] and is_note(first) and describe(first)["notes"] == ["rank_separation"]
    # a run whose ranks often sit apart (separation 2-3.5 spreads): the statistic's upper
    # tail is this run's normal, so a 3.6-spread separation is marginal (a note)
    import random

    rnd = random.Random(1)
    for _ in range(40):
        _sep_step(det, 0.1 * (2 + 1.5 * rnd.random()) + 0.1)
    marginal = _sep_step(det, 0.46)
    assert not marginal[0] and describe(marginal)["notes"] == ["rank_separation"], describe(marginal)
    # far past that tail: it acts
    decisive = _sep_step(det, 2.0)
    ev = describe(decisive)
    assert decisive[0] and ev["rules"] == ["rank_separation"] and ev["separation_y"] > ev["separation_bound"]
    # separation_gate 0: the constant alone decides, as before the tiers
    det0 = SpikeDetector(SpikeDetector.Config(window=64, separation_gate=0))
    assert _sep_step(det0, 0.5)[0]
    # the default warm-up (64 values): after 42 steps even a decisive separation is a note
    early = SpikeDetector(SpikeDetector.Config(window=128))
    for _ in range(41):
        _sep_step(early, 0.1 * (2 + 1.5 * rnd.random()) + 0.1)
    got = _sep_step(early, 2.0)
    assert not got[0] and describe(got)["notes"] == ["rank_separation"]


def _docs_step(det, rank0, rank1, docs):
    """One DP-2 step: each rank's (lowest, highest) segment log loss, and distinct documents."""
    import math

    doc = torch.tensor([[math.exp((lo + hi) / 2), math.exp(hi), math.exp(lo), 4, n]
                        for (lo, hi), n in zip((rank0, rank1), docs)], dtype=torch.float64)
    return describe(det.step(torch.tensor(3.0), torch.tensor(1.0), torch.tensor([3.0, 3.0]), doc).tolist())


def test_one_document_per_rank_is_measured_with_the_runs_between_document_spread():
    # the clean warm run's false alarm: each rank's four rows slice ONE long document (its
    # segments differ by ~0.1), the two documents 0.3 apart: 3 "spreads" by the ranks' own
    import random

    rnd = random.Random(3)
    cfg = {"window": 64, "min_history": 8, "separation_warmup": 8}
    for one_doc_spread, want in ((False, ["rank_separation"]), (True, [])):
        det = SpikeDetector(SpikeDetector.Config(one_doc_spread=one_doc_spread, **cfg))
        for _ in range(40):  # several documents per rank: segments spread ~0.3 and overlap
            a = 1.0 + 0.05 * rnd.random()
            _docs_step(det, (a, a + 0.3), (a + 0.02, a + 0.32), (3, 4))
        ev = _docs_step(det, (1.0, 1.1), (1.4, 1.5), (1, 1))
        assert ev["rules"] + ev["notes"] == want, (one_doc_spread, ev)
        if one_doc_spread:  # 0.3 apart in units of the run's 0.3 between-document spread
            assert ev["separation_y"] < 1.5
    # a rank whose one "document" is random text still stands out by far (the warm
    # injections: 3.1-7.4 against the clean run's 1.9 at most, docs/benchmarks.md)
    ev = _docs_step(det, (1.0, 1.1), (2.5, 2.55), (1, 1))
    assert ev["rules"] == ["rank_separation"] and ev["separation_rank"] == 1 and ev["separation_y"] > 4
    # no document counts (NaN: ledgers recorded before them): the detector as before
    det = SpikeDetector(SpikeDetector.Config(**cfg))
    for _ in range(40):
        _docs_step(det, (1.0, 1.3), (1.02, 1.32), (float("nan"), float("nan")))
    assert _docs_step(det, (1.0, 1.1), (1.4, 1.5), (float("nan"),) * 2)["rules"] == ["rank_separation"]


def test_distinct_documents_count_a_sliced_document_once():
    from titan_ledger.data.layout import distinct_documents

    rows = [[0, "c4", [[7, 0, 256]]], [1, "c4", [[7, 256, 512]]], [2, "c4", [[7, 512, 700], [8, 0, 10]]],
            [3, "other", [[7, 0, 256]]]]
    assert distinct_documents(rows) == 3  # doc 7 of c4 (three rows), doc 8, doc 7 of another source
    assert distinct_documents(rows, min_tokens=16) == 2  # doc 8's 10 tokens are not ranked


def test_a_small_z_score_move_is_a_note_and_a_material_one_acts():
    import random

    rnd = random.Random(2)
    # grad_novelty off: the two notes below would be remembered and make 3.2x no novelty
    # (that gate has its own test)
    det = SpikeDetector(SpikeDetector.Config(window=128, grad_novelty=0))
    for _ in range(128):  # a tight grad-norm history (CV 6%, as a clean run's)
        det.step(torch.tensor(5.0 + 0.01 * rnd.random()), torch.tensor(0.82 * (1 + 0.06 * rnd.gauss(0, 1))))
    small = det.step(torch.tensor(5.0), torch.tensor(1.3))  # ~9 std, 1.6x the median
    assert not small[0] and describe(small)["notes"] == ["zscore_grad_norm"]
    also_small = det.step(torch.tensor(5.0), torch.tensor(1.8))  # 2.2x (the clean run's step 740)
    assert not also_small[0] and describe(also_small)["notes"] == ["zscore_grad_norm"]
    big = det.step(torch.tensor(5.0), torch.tensor(2.6))  # 3.2x: material
    assert big[0] and "zscore_grad_norm" in describe(big)["rules"]
    det0 = SpikeDetector(SpikeDetector.Config(window=128, zscore_min_ratio=0, grad_novelty=0))
    for _ in range(128):
        det0.step(torch.tensor(5.0 + 0.01 * rnd.random()), torch.tensor(0.82 * (1 + 0.06 * rnd.gauss(0, 1))))
    assert det0.step(torch.tensor(5.0), torch.tensor(1.3))[0]


def test_a_grad_norm_jump_on_a_falling_loss_is_a_note_and_on_a_rising_or_flat_loss_acts():
    """``dip_note`` (issue 67): the memorisation plateau's dip -- the loss at 15% of its recent
    median, the grad norm 4x -- is a note (its proof still runs, and convicts bad data); the
    same grad-norm move with the loss flat acts; with ``dip_note`` off the dip acts as before;
    the event carries the recent median the rule compared with."""
    def history(dip_note=True):
        det = SpikeDetector(SpikeDetector.Config(window=16, min_history=4, dip_note=dip_note))
        for i in range(40):
            det.step(torch.tensor(0.0067 * (1 + 0.01 * (i % 3)), dtype=torch.float64),
                     torch.tensor(0.0033 * (1 + 0.05 * (i % 2)), dtype=torch.float64))
        return det

    dip = describe(history().step(torch.tensor(0.00103, dtype=torch.float64), torch.tensor(0.0135, dtype=torch.float64)))
    assert dip["rules"] == [] and "grad_jump" in dip["notes"]
    assert dip["loss_recent"] == pytest.approx(0.006767, rel=1e-3)
    flat = describe(history().step(torch.tensor(0.0068, dtype=torch.float64), torch.tensor(0.0135, dtype=torch.float64)))
    assert "grad_jump" in flat["rules"]
    old = describe(history(dip_note=False).step(torch.tensor(0.00103, dtype=torch.float64),
                                                 torch.tensor(0.0135, dtype=torch.float64)))
    assert "grad_jump" in old["rules"]


def test_grad_novelty_makes_a_move_the_run_has_already_shown_a_note():
    import random

    def history(novelty, steps=400):
        rnd = random.Random(3)
        det = SpikeDetector(SpikeDetector.Config(window=128, grad_novelty=novelty))
        for i in range(steps):  # a heavy-tailed clean run: every 50th step 3x its neighbours
            g = 0.5 * (1 + 0.1 * rnd.gauss(0, 1)) * (3.0 if i % 50 == 25 else 1.0)
            det.step(torch.tensor(0.6 + 0.1 * rnd.gauss(0, 1)), torch.tensor(g))
        return det

    # the loss up 17% (the ratio rule needs a rising loss), within its noise: no z-score
    det = history(0.0)  # off: the ratio and grad-jump bars alone act on a 4x move
    inside = describe(det.step(torch.tensor(0.7), torch.tensor(2.0)))
    assert inside["rules"] == ["zscore_grad_norm", "ratio"]  # seeded: the 4x move is under grad_jump's bar
    det = history(2.0)
    remembered = 2 * math.exp(float(det.jhist.max()))  # grad_novelty x the largest remembered jump
    inside = det.step(torch.tensor(0.7), torch.tensor(2.0))  # 4x: under 2 x the 3x it has shown
    ev = describe(inside)
    assert ev["rules"] == [] and ev["notes"] == ["zscore_grad_norm", "ratio"]  # the same rules, now notes
    assert float(ev["grad_jump_bound"]) == pytest.approx(remembered, rel=1e-12)  # the bar the memory sets
    assert remembered == pytest.approx(6.420053, abs=1e-6)  # 2 x the 3.21x the seeded history showed
    beyond = describe(det.step(torch.tensor(0.7), torch.tensor(20.0)))  # 40x: past anything it has shown
    assert beyond["rules"] == ["zscore_grad_norm", "ratio", "grad_jump"]
    # the spike did not enter the memory: the same move acts again, a remembered note does not raise the bar
    state = det.state_dict()
    again = SpikeDetector(SpikeDetector.Config(window=128, grad_novelty=2.0))
    again.load_state_dict(json.loads(json.dumps(state)))  # as the checkpoint stores it
    assert describe(again.step(torch.tensor(0.7), torch.tensor(20.0)))["rules"]
    assert describe(det.step(torch.tensor(0.7), torch.tensor(20.0)))["rules"]
    # early training: no memory yet (from the warm-up on), the bars alone act
    early = history(2.0, steps=100)
    assert describe(early.step(torch.tensor(0.7), torch.tensor(2.0)))["rules"]
    with pytest.raises(ConfigError, match="grad_novelty"):
        SpikeDetector.Config(grad_novelty=-1)
    with pytest.raises(ConfigError, match="grad_memory"):
        SpikeDetector.Config(grad_memory=0)


def test_notes_config_is_checked():
    with pytest.raises(ConfigError, match="--ledger.spike.notes"):
        SpikeDetector.Config(notes="doc_high,non_finite")
    with pytest.raises(ConfigError, match="--ledger.spike.notes"):
        SpikeDetector.Config(notes="doc_hi")
    assert SpikeDetector.Config(notes=" doc_low ,").note_rules() == ("doc_low",)


def test_a_checkpoint_from_before_the_tiers_loads():
    det = SpikeDetector(SpikeDetector.Config(window=8))
    for _ in range(5):
        det.step(torch.tensor(3.0), torch.tensor(1.0))
    old = det.state_dict()
    old["ehist"], old["ecount"] = old["ehist"][:3], old["ecount"][:3]
    again = SpikeDetector(SpikeDetector.Config(window=8))
    again.load_state_dict(old)
    assert again.ehist.shape[0] == 6 and int(again.ecount[3]) == 0 and int(again.count) == 5
    # ...and one from before one_doc_spread (no between-document history): it starts empty
    old = det.state_dict()
    old["ehist"], old["ecount"] = old["ehist"][:4], old["ecount"][:4]
    again.load_state_dict(old)
    assert int(again.ecount[4]) == 0 and int(again.ecount[0]) == 5


def test_rank_separation_at_dp2_names_the_rank_that_moved():
    det = SpikeDetector(SpikeDetector.Config(window=16, separation_warmup=8))
    for _ in range(10):
        det.step(torch.tensor(3.0), torch.tensor(1.0), torch.tensor([3.0, 3.0]),
                 torch.tensor([_doc(), _doc()], dtype=torch.float64))
    # rank 0 read repeated text: all its documents far below rank 1's, and alike
    stats = det.step(torch.tensor(2.0), torch.tensor(1.0), torch.tensor([1.0, 3.0]),
                     torch.tensor([_doc(med=1.0, hi=1.02, lo=0.98), _doc()], dtype=torch.float64)).tolist()
    ev = describe(stats)
    assert "rank_separation" in ev["rules"] and ev["separation_rank"] == 0


def test_a_degenerate_document_history_is_judged_by_its_upper_tail():
    """At 2 rows per rank doc_low's statistic is 0 on most steps (median of two = the
    lower): its MAD is 0 and a clean 2.2x step passes median + 6 x MAD. With the tail
    spread it does not; a 20x document still does."""
    import random

    rnd = random.Random(3)

    def run(tail: bool, lows: list[float]) -> list[int]:
        det = SpikeDetector(SpikeDetector.Config(window=64, doc_tail_spread=tail, notes=""))
        out = []
        for t, lo_ratio in enumerate(lows, start=1):
            med = 3.0
            doc = torch.tensor([[med, med * 1.1, med / lo_ratio, 2], [med, med * 1.1, med, 2]], dtype=torch.float64)
            if describe(det.step(torch.tensor(3.0), torch.tensor(1.0), None, doc).tolist())["rules"]:
                out.append(t)
        return out

    # 60 clean steps: ratio 1 (the degenerate zero) on 80%, up to 2.3x on the rest
    lows = [1.0 if rnd.random() < 0.8 else 1.5 + 0.8 * rnd.random() for _ in range(60)]
    clean = lows + [2.2]
    assert 61 in run(False, clean) and 61 not in run(True, clean)
    assert 61 in run(True, lows + [20.0])


def test_diagnose_says_why_a_grad_norm_move_stayed_a_note():
    from titan_ledger.tools.incident import _why_noted

    why = _why_noted({"notes": ["ratio", "grad_jump"], "grad_jump_ratio": 4.1, "grad_jump_bound": 6.5})
    assert why and "4.10x" in why and "6.50x" in why
    assert _why_noted({"notes": ["doc_low"], "grad_jump_ratio": 4.1, "grad_jump_bound": 6.5}) is None
    assert _why_noted({"notes": ["ratio"], "grad_jump_ratio": 4.1}) is None  # warm-up: no bound yet


def _shifted(n=400, at=200, seed=1):
    """A clean ledger whose loss and grad norm move to a new level at step ``at`` and
    stay there (a change of data mixture), with the same small noise."""
    import random

    rnd = random.Random(seed)
    rows = ledger(n)
    for r in rows[at - 1:]:
        r["loss"], r["grad_norm"] = 4.0 + rnd.gauss(0, 0.01), 5.0 + rnd.gauss(0, 0.1)
    return rows


def test_a_lasting_change_of_level_is_readmitted_after_readmit_after_flags_in_a_row():
    rows = _shifted()
    events = detect_offline(rows, SpikeDetector.Config(readmit_after=16))
    flagged = [e["step"] for e in events]
    assert flagged == list(range(200, 216)), flagged  # the shift, 16 steps in a row, then its new normal
    assert events[-1]["readmitted"] == 16 and not any("readmitted" in e for e in events[:-1])
    # without readmission: an alarm at every step for the rest of the run
    never = detect_offline(rows, SpikeDetector.Config(readmit_after=0))
    assert [e["step"] for e in never] == list(range(200, 401))
    # a spike of a few steps is no change of level: the flags in a row end, nothing is readmitted
    rows = ledger(300)
    for r in rows[199:203]:
        r.update(loss=4.8, grad_norm=9.0)
    events = detect_offline(rows, SpikeDetector.Config(readmit_after=4))
    assert [e["step"] for e in events] == [200, 201, 202, 203]
    assert events[-1]["readmitted"] == 4  # the 4th in a row readmits at readmit_after 4 ...
    events = detect_offline(rows, SpikeDetector.Config(readmit_after=5))
    assert [e["step"] for e in events] == [200, 201, 202, 203] and not any("readmitted" in e for e in events)
    with pytest.raises(ConfigError, match="readmit_after"):
        SpikeDetector.Config(readmit_after=-1)


def test_before_undoes_a_readmission_and_the_state_survives_a_checkpoint():
    import copy

    cfg = SpikeDetector.Config(window=32, readmit_after=8)
    det = SpikeDetector(cfg)
    rows = _shifted(60, at=30)
    snapshot = None
    for r in rows:
        loss, gn = torch.tensor(r["loss"], dtype=torch.float64), torch.tensor(r["grad_norm"], dtype=torch.float64)
        prev = copy.deepcopy(det)
        stats = dict(zip(STAT_KEYS, det.step(loss, gn).tolist()))
        if stats["readmitted"] == 8:
            snapshot = prev
            break
    # the history starts again from the 8 flagged steps (steps 30-37), the grad-jump rule's too
    assert snapshot is not None and int(det.streak) == 0 and int(det.count) == 8
    assert det.hist[0, :8].tolist() == [r["loss"] for r in rows[29:37]]
    assert int(det.ecount[0]) == 8 and torch.allclose(det.ehist[0, :8].exp(),
                                                     torch.tensor([r["grad_norm"] for r in rows[29:37]],
                                                                  dtype=torch.float64))
    back = det.before()
    assert torch.equal(back.hist, snapshot.hist) and int(back.count) == int(snapshot.count)
    assert torch.equal(back.ehist, snapshot.ehist) and torch.equal(back.ecount, snapshot.ecount)
    assert int(back.streak) == 7 and torch.equal(back.pend[:, :7], snapshot.pend[:, :7])
    # mid-run of flags: the streak and its values go into the checkpoint
    det2 = SpikeDetector(cfg)
    for r in rows[:33]:
        det2.step(torch.tensor(r["loss"], dtype=torch.float64), torch.tensor(r["grad_norm"], dtype=torch.float64))
    state = json.loads(json.dumps(det2.state_dict()))
    det3 = SpikeDetector(cfg)
    det3.load_state_dict(state)
    assert int(det3.streak) == int(det2.streak) == 4 and torch.equal(det3.pend, det2.pend)
    old = {k: v for k, v in state.items() if k not in ("streak", "pend")}  # a checkpoint from before
    det4 = SpikeDetector(cfg)
    det4.load_state_dict(old)
    assert int(det4.streak) == 0 and torch.equal(det4.hist, det2.hist)


def _noisy(det, steps, dp=0, seed=0):
    """Clean steps: loss ~3.0, grad norm ~1.0 (±3%), DP ranks' losses within ±0.5%."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        u = torch.rand(2 + dp, generator=g, dtype=torch.float64)
        dp_loss = 3.0 * (1 + 0.01 * (u[2:] - 0.5)) if dp else None
        det.step(torch.tensor(3.0 * (1 + 0.02 * (u[0] - 0.5))), 1.0 + 0.06 * (u[1] - 0.5), dp_loss)


def test_a_grad_norm_move_with_the_loss_unmoved_is_a_note_that_never_acts():
    """The finite-fault shape (issue 52): 2x the grad norm's recent median, the loss flat.
    Below the grad-norm rules' bars (3-4x) it is a note, even with ``notes = ""``; the loss
    moved with it, or a move the grad-norm rules already see, is not ``grad_move``."""
    for notes in ("doc_high,doc_low", ""):
        det = SpikeDetector(SpikeDetector.Config(notes=notes))
        _noisy(det, 20)
        ev = describe(det.step(torch.tensor(3.0), torch.tensor(2.0)).tolist())
        assert ev["rules"] == [] and ev["notes"] == ["grad_move"] and ev["grad_jump_ratio"] > 1.9, ev
    before = SpikeDetector(SpikeDetector.Config())
    _noisy(before, 7)  # min_history (8) not reached: no median to move from
    assert describe(before.step(torch.tensor(3.0), torch.tensor(5.0)).tolist())["notes"] == []
    det = SpikeDetector(SpikeDetector.Config())
    _noisy(det, 20)
    assert describe(det.step(torch.tensor(3.0), torch.tensor(1.6)).tolist())["notes"] == []  # under 1.8x
    assert "grad_move" not in describe(det.step(torch.tensor(3.5), torch.tensor(2.0)).tolist())["notes"]  # loss up
    ev = describe(det.step(torch.tensor(3.0), torch.tensor(6.0)).tolist())  # the grad-norm rules' own move
    assert "grad_jump" in ev["rules"] and "grad_move" not in ev["notes"], ev
    off = SpikeDetector(SpikeDetector.Config(grad_move=0))
    _noisy(off, 20)
    assert describe(off.step(torch.tensor(3.0), torch.tensor(2.0)).tolist())["notes"] == []


def test_one_ranks_loss_out_of_its_usual_spread_is_a_note_naming_the_rank():
    """A DP-4 random batch (issue 52: 8.13 against 7.29-7.38) from the first steps on: the
    rank whose loss leaves the ranks' median by 8x its usual distance is named in a note."""
    det = SpikeDetector(SpikeDetector.Config(notes=""))
    _noisy(det, 10, dp=4)
    ev = describe(det.step(torch.tensor(3.1), torch.tensor(1.0),
                           torch.tensor([2.99, 3.01, 3.0, 3.35], dtype=torch.float64)).tolist())
    assert ev["rules"] == [] and ev["notes"] == ["rank_loss"] and ev["rank_loss_rank"] == 3, ev
    assert ev["rank_loss_y"] > 8 * ev["rank_loss_median"] and ev["rank_loss_y"] > 0.06
    # a wide but usual spread (every step like it) is no note; under the floor neither
    wide = SpikeDetector(SpikeDetector.Config())
    for i in range(20):
        stats = wide.step(torch.tensor(3.0), torch.tensor(1.0),
                          torch.tensor([2.7, 3.3] if i % 2 else [3.3, 2.7], dtype=torch.float64))
        assert describe(stats.tolist())["notes"] == []
    tight = SpikeDetector(SpikeDetector.Config())
    _noisy(tight, 10, dp=2)
    stats = tight.step(torch.tensor(3.0), torch.tensor(1.0), torch.tensor([3.0, 3.06], dtype=torch.float64))
    assert describe(stats.tolist())["notes"] == []  # 1% from the median: under rank_loss_floor (6%)
    # the history survives a checkpoint and ``before`` (six evidence rows)
    again = SpikeDetector(SpikeDetector.Config())
    again.load_state_dict(det.state_dict())
    assert torch.equal(again.ehist, det.ehist) and torch.equal(det.before().ehist[5, :10], det.ehist[5, :10])


def test_the_rules_read_the_detectors_histories_and_write_none():
    """spike_rules' functions are pure: the detector alone enters a step's values into its
    histories (so a checkpoint and ``before`` hold all the state), and the rules it runs
    see what ``step`` sees."""
    det = SpikeDetector(SpikeDetector.Config(window=16, min_history=4))
    doc = torch.tensor([_doc(), _doc(med=3.1, hi=3.4, lo=2.8)], dtype=torch.float64)
    dp = torch.tensor([3.0, 3.1], dtype=torch.float64)
    for i in range(12):
        det.step(torch.tensor(3.0 - 0.01 * i), torch.tensor(1.0 + 0.01 * i), dp, doc)
    state = [x.clone() for x in (det.hist, det.count, det.ehist, det.ecount)]
    v = torch.tensor([5.0, 9.0], dtype=torch.float64)
    win = window_rules(det.config, det.hist, det.count, torch.arange(16), v)
    ev = evidence(det.config, det.ehist, det.ecount, torch.arange(16), v[1], doc, dp)
    assert all(torch.equal(a, b) for a, b in zip(state, (det.hist, det.count, det.ehist, det.ecount)))
    assert win.z.tolist() == [True, True] and bool(win.ratio) and bool(ev.fired[3])  # grad jump
    assert ev.values.shape == (EROWS,) and math.isclose(float(ev.values[0]), math.log(9.0))
    got = describe(det.step(v[0], v[1], dp, doc).tolist())
    assert {"zscore_loss", "zscore_grad_norm", "ratio", "grad_jump"} <= set(got["rules"])
    assert int(det.ecount[0]) == int(state[3][0]) + 1  # ...and step entered the value
