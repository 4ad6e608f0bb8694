"""titan_ledger.components.response.verdict: the verdict logic, the suspect and its control, the
label masks, and the detector's view of the history before a step (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from titan_ledger.components.detection.spikes import STAT_KEYS, SpikeDetector
from titan_ledger.components.response.verdict import (
    Execution,
    Suspect,
    control_of,
    differing_ranks,
    document_tokens,
    faulty_ranks,
    flags_as_run,
    judge,
    local_distance,
    mask_labels,
    name_suspect,
    noise_record,
    normal_update,
    odd_one_out,
    reproduced,
    same_tensor,
    window_effect,
)
from titan_ledger.data.layout import RowTag, Segment
from titan_ledger.format.proofs import describe_proof


def ex(variant, loss, gn, ranks, normal=None):
    return Execution(variant, loss, gn, [list(r) for r in ranks], normal)


ORIG = ex("original", 7.6, 10.2, [[1970.0, 40.0, 256, 1], [1932.0, 44.0, 256, 1]], normal=False)


def test_same_bit_equal_then_masks_decide():
    same = ex("same", 7.6, 10.2, [[1970.0, 40.0, 256, 1], [1932.0, 44.0, 256, 1]])
    assert differing_ranks(ORIG, same, 0.0) == []
    masked = ex("masked", 7.7, 1.4, [[1970.0, 1.0, 256, 0], [0.0, 1.0, 0, 0]], normal=True)
    control = ex("control", 7.5, 20.3, [[0.0, 90.0, 0, 0], [1932.0, 90.0, 256, 0]], normal=False)
    v = judge(ORIG, [same], masked, control, suspect=True)
    assert (v.verdict, v.applied) == ("bad_data", "masked")
    # the masks swapped: the control's data is the bad data (disjoint masks of one size)
    v = judge(ORIG, [same], control.__class__("masked", 7.5, 20.3, control.ranks, False),
              masked.__class__("control", 7.7, 1.4, masked.ranks, True), suspect=True)
    assert (v.verdict, v.applied) == ("bad_data", "control")
    # both masks restore the update: removing data, not bad data
    both = ex("control", 7.5, 1.3, control.ranks, normal=True)
    assert judge(ORIG, [same], masked, both, suspect=True).verdict == "not_data"
    # neither does: the optimisation itself (LR, optimizer state, logits)
    neither = ex("masked", 7.7, 19.0, masked.ranks, normal=False)
    assert judge(ORIG, [same], neither, control, suspect=True).verdict == "not_data"
    # no control could be built (DP 1, one document): no proof of data
    assert judge(ORIG, [same], None, None, suspect=True).verdict == "not_data"


def test_a_normal_update_is_an_outlier_with_a_suspect_and_not_data_without():
    orig = ex("original", 7.6, 1.0, ORIG.ranks, normal=True)
    same = ex("same", 7.6, 1.0, ORIG.ranks)
    v = judge(orig, [same], None, None, suspect=True)
    assert (v.verdict, v.applied) == ("outlier", "original")
    assert judge(orig, [same], None, None, suspect=False).verdict == "not_data"


def test_a_transient_difference_is_hardware_and_the_third_execution_decides():
    flipped = ex("same", 7.6, 3.1, [[1970.0, 9.0, 256, 0], [1932.0, 44.0, 256, 1]])
    # rank 0's gradients changed between the first execution and the second
    assert differing_ranks(ORIG, flipped, 0.0) == [0]
    with pytest.raises(ValueError, match="a third decides"):
        judge(ORIG, [flipped], None, None)
    again = ex("same", 7.6, 3.1, flipped.ranks)
    v = judge(ORIG, [flipped, again], None, None)
    assert (v.verdict, v.applied, v.ranks) == ("hardware", "same", [0])
    # the second execution was the faulty one: the first result stands
    back = ex("same", 7.6, 10.2, [[1970.0, 40.0, 256, 1], [1932.0, 44.0, 256, 1]])
    v = judge(ORIG, [flipped, back], None, None)
    assert (v.verdict, v.applied) == ("hardware", "original")
    # no two agree: no update is applied
    third = ex("same", 7.6, 5.0, [[1970.0, 20.0, 256, 0], [1932.0, 44.0, 256, 1]])
    assert judge(ORIG, [flipped, third], None, None).applied == "none"


def test_a_tolerance_counts_small_differences_as_equal():
    near = ex("same", 7.6, 10.2, [[1970.0 * (1 + 1e-7), 40.0, 256, 0], [1932.0, 44.0, 256, 0]])
    assert differing_ranks(ORIG, near, 0.0) == [0, 1]  # not bit-equal gradients on either rank
    assert differing_ranks(ORIG, near, 1e-6) == []
    far = ex("same", 7.6, 10.2, [[1970.0 * 1.01, 40.0, 256, 0], [1932.0, 44.0, 256, 0]])
    assert differing_ranks(ORIG, far, 1e-6) == [0]


def noisy(variant, loss, gn, rank_sq, psq, normal=None):
    """An execution on a machine that is not bit-reproducible: per rank its loss, its
    sum of squares, and (this rank, rank 0) its per-parameter sums of squares."""
    e = ex(variant, loss, gn, [[1970.0, rank_sq[0], 256, 0], [1932.0, rank_sq[1], 256, 0]], normal)
    e.psq = torch.tensor(psq, dtype=torch.float64)
    return e


def test_three_executions_within_their_noise_reproduce_and_the_data_path_decides():
    # a GPU without determinism: every execution differs in the 7th digit, none stands out
    o = noisy("original", 7.6, 10.2, (40.0, 44.0), [10.0, 30.0], normal=False)
    s1 = noisy("same", 7.6, 10.2, (40.00001, 44.00002), [10.00001, 30.00003])
    s2 = noisy("same", 7.6, 10.2, (39.99998, 43.99999), [9.99998, 29.99998])
    assert differing_ranks(o, s1, 0.0) and differing_ranks(s1, s2, 0.0) and differing_ranks(o, s2, 0.0)
    d = [[local_distance(o, s1, 0), local_distance(o, s2, 0), local_distance(s1, s2, 0)]]
    assert all(0 < x < 1e-5 for x in d[0])
    odd, floor = odd_one_out(d, 100.0)
    assert odd is None and floor == min(d[0])
    assert reproduced(o, [s1, s2], 0.0, d, 100.0) == (True, floor)
    # reproducible within the noise: the masks decide, and the first update stands
    masked = ex("masked", 7.7, 1.4, [[1970.0, 1.0, 256, 0], [0.0, 1.0, 0, 0]], normal=True)
    control = ex("control", 7.5, 20.3, [[0.0, 90.0, 0, 0], [1932.0, 90.0, 256, 0]], normal=False)
    v = judge(o, [s1, s2], masked, control, 0.0, suspect=True, distances=d)
    assert (v.verdict, v.applied, v.noise) == ("bad_data", "masked", floor)
    v = judge(o, [s1, s2], None, None, 0.0, distances=d)
    assert (v.verdict, v.applied) == ("not_data", "original")
    # without the measured distances there is no noise to compare with: no two agree
    assert judge(o, [s1, s2], None, None, 0.0).applied == "none"


def test_a_fault_stands_out_of_the_execution_noise():
    # the first execution's parameter 1 was hit (a flipped bit): 1e3 relative, noise 1e-6
    o = noisy("original", 7.6, 31.0, (940.0, 44.0), [10.0, 930.0], normal=False)
    s1 = noisy("same", 7.6, 10.2, (40.00001, 44.00002), [10.00001, 30.00003])
    s2 = noisy("same", 7.6, 10.2, (39.99998, 43.99999), [9.99998, 29.99998])
    d = [[local_distance(o, s1, 0), local_distance(o, s2, 0), local_distance(s1, s2, 0)],
         [1e-7, 2e-7, 1.5e-7]]  # rank 1: only noise
    assert odd_one_out(d, 100.0)[0] == 0
    assert reproduced(o, [s1, s2], 0.0, d, 100.0)[0] is False
    v = judge(o, [s1, s2], None, None, 0.0, distances=d)
    assert (v.verdict, v.applied, v.ranks) == ("hardware", "same", [0])
    assert v.noise == d[0][2] and "execution noise" in v.why
    # the fault hit a repeat (the second): the first update stands
    d2 = [[d[0][1], d[0][2], d[0][0]], [2e-7, 1e-7, 1.5e-7]]  # o~s1 close, s2 far
    v = judge(o, [s1, s2], None, None, 0.0, distances=d2)
    assert (v.verdict, v.applied, v.ranks) == ("hardware", "original", [0])
    # a smaller factor than the gap still names it; one past it does not
    gap = min(d[0][0], d[0][1]) / d[0][2]
    assert odd_one_out(d, gap * 0.9)[0] == 0 and odd_one_out(d, gap * 1.1)[0] is None


def test_local_distance_reads_pre_clip_sums_and_non_finite_is_infinitely_far():
    a = noisy("original", 7.6, 100.0, (1.0, 1.0), [100.0, 4.0])
    a.clip_coef = 0.1  # post-clip sums of squares: 100x smaller than before the clip
    b = noisy("same", 7.6, 10.0, (1.0, 1.0), [10000.0, 400.0])
    assert local_distance(a, b, 0) == pytest.approx(0.0, abs=1e-12)
    c = noisy("same", 7.6, 10.0, (1.0, 1.0), [float("inf"), 4.0])
    assert local_distance(a, c, 0) == math.inf


def tags():
    return [RowTag(0, "c", (Segment(7, 0, 100), Segment(8, 0, 28))),
            RowTag(1, "c", (Segment(8, 28, 156),)),
            RowTag(2, "c", (Segment(9, 0, 64), Segment(10, 0, 64)))]


def test_suspect_documents_from_the_document_rules_and_ranks_otherwise():
    summary = {"median": 2.0, "top": [[0, 0, 100 * 9.0, 100], [2, 1, 64 * 5.0, 64], [2, 0, 64 * 2.1, 64]],
               "bottom": [[1, 0, 100 * 0.5, 100]]}
    ev = {"rules": ["grad_jump"], "notes": ["doc_high"], "doc_high_rank": 1, "separation_rank": 0}
    s = name_suspect(ev, [2.0, 2.1], summary, tags(), floor=0.7)
    # doc 7 (9.0 = 4.5x the median) and doc 10 (2.5x) pass the floor; doc 9 (1.05x) does not
    assert s == Suspect(1, frozenset({("c", 7), ("c", 10)}), "doc_high")
    ev = {"rules": ["grad_jump"], "notes": ["rank_separation"], "separation_rank": 1}
    assert name_suspect(ev, [2.0, 2.1], None, None, 0.7) == Suspect(1, None, "rank_separation")
    # no rule named one: the DP rank whose loss stands farthest from the others' median
    assert name_suspect({"rules": ["grad_jump"], "notes": []}, [2.0, 2.05, 0.4], None, None, 0.7) == \
        Suspect(2, None, "rank_loss")
    assert name_suspect({"rules": ["grad_jump"], "notes": []}, [2.0], None, None, 0.7) is None


def test_the_control_masks_as_much_other_data():
    assert control_of(Suspect(1, None), 4, None) == Suspect(2, None, "control")
    assert control_of(Suspect(3, None), 4, None) == Suspect(0, None, "control")
    assert control_of(Suspect(0, None), 1, None) is None  # DP 1: no other rank
    by_dp = {0: tags()}
    assert document_tokens(tags()) == {("c", 7): 100, ("c", 8): 156, ("c", 9): 64, ("c", 10): 64}
    # doc 9 (64 tokens) gets the other 64-token document as its control
    assert control_of(Suspect(0, frozenset({("c", 9)})), 1, by_dp) == Suspect(0, frozenset({("c", 10)}), "control")
    # nothing else on the rank: another DP rank's documents of like size (doc 8, 156 tokens)
    one = {0: [RowTag(0, "c", (Segment(5, 0, 150),))], 1: tags()}
    assert control_of(Suspect(0, frozenset({("c", 5)})), 2, one) == Suspect(1, frozenset({("c", 8)}), "control")
    assert control_of(Suspect(0, frozenset({("c", 5)})), 1, one) is None


def test_mask_labels_masks_the_documents_segments_or_the_whole_batch():
    labels = torch.arange(3 * 128).reshape(3, 128)
    groups = [[({"input": labels.clone()}, labels[:2].clone())], [({"input": labels.clone()}, labels[2:].clone())]]
    out, hits = mask_labels(groups, tags(), Suspect(0, frozenset({("c", 8), ("c", 10)})), -100)
    assert hits == [[0, 1], [1, 0], [2, 1]]
    a, b = out[0][0][1], out[1][0][1]
    assert (a[0, :100] >= 0).all() and (a[0, 100:] == -100).all() and (a[1] == -100).all()
    assert (b[0, :64] >= 0).all() and (b[0, 64:] == -100).all()
    assert (groups[0][0][1] >= 0).all()  # the step's own labels are untouched
    out, hits = mask_labels(groups, tags(), Suspect(0, None), -100)
    assert all((lab == -100).all() for mbs in out for _, lab in mbs) and len(hits) == 5


def test_detector_before_is_the_history_before_the_last_step():
    cfg = SpikeDetector.Config(window=8, min_history=4)
    det = SpikeDetector(cfg)
    g = torch.Generator().manual_seed(0)
    for i in range(40):  # wraps the window several times; spikes and accepted steps
        loss = torch.tensor(5.0 - 0.01 * i + 0.01 * float(torch.rand((), generator=g)), dtype=torch.float64)
        gn = torch.tensor(1.0 + 0.05 * float(torch.rand((), generator=g)) + (9.0 if i in (20, 33) else 0.0),
                          dtype=torch.float64)
        stats = det.step(loss, gn)
        redo = det.before().step(loss, gn)  # judges this step exactly as the live one did
        torch.testing.assert_close(redo, stats, rtol=0, atol=0, equal_nan=True)
        assert stats[0] == (i in (20, 33))
    # the live detector is unchanged by its copies
    assert int(det.count) == 38


def test_normal_update_uses_the_grad_norm_rules_own_bars():
    cfg = SpikeDetector.Config(window=8, min_history=4)
    det = SpikeDetector(cfg)
    for i in range(12):
        det.step(torch.tensor(5.0 - 0.01 * i, dtype=torch.float64), torch.tensor(1.0 + 0.01 * (i % 3),
                                                                                dtype=torch.float64))
    stats = det.step(torch.tensor(4.9, dtype=torch.float64), torch.tensor(10.0, dtype=torch.float64))
    assert stats[0] == 1  # an acting spike
    assert not normal_update(det, 4.9, 10.0)
    assert normal_update(det, 4.9, 1.02)
    assert not normal_update(det, math.nan, 1.0)
    assert STAT_KEYS[0] == "flag"


def test_flags_as_run_reads_the_loss_rules_too():
    """The window proof's test: a loss-only spike (the grad norm ordinary) is flagged again,
    which the update's bars (normal_update) call normal; an ordinary step is not; a
    non-finite value is."""
    cfg = SpikeDetector.Config(window=8, min_history=4)
    det = SpikeDetector(cfg)
    for i in range(12):
        det.step(torch.tensor(5.0 - 0.01 * i + 0.005 * (i % 2), dtype=torch.float64),
                 torch.tensor(1.0 + 0.01 * (i % 3), dtype=torch.float64))
    stats = det.step(torch.tensor(9.0, dtype=torch.float64), torch.tensor(1.01, dtype=torch.float64))
    assert stats[0] == 1  # the loss alone flagged it
    assert flags_as_run(det, 9.0, 1.01) and normal_update(det, 9.0, 1.01)
    assert not flags_as_run(det, 4.9, 1.01)
    assert flags_as_run(det, math.nan, 1.0)


def _history(grad_novelty=2.0, jumps=()):
    """A detector after 200 quiet steps (loss ~5, grad norm ~1), with grad-norm moves of
    ``jumps`` x along the way (the run's own tail: the novelty gate remembers them)."""
    det = SpikeDetector(SpikeDetector.Config(window=16, min_history=4, grad_novelty=grad_novelty,
                                             grad_novelty_warmup=8))
    for i in range(200):
        g = 1.0 + 0.02 * (i % 3)
        if jumps and i % 40 == 39:
            g *= jumps[(i // 40) % len(jumps)]
        det.step(torch.tensor(5.0 - 0.0005 * i, dtype=torch.float64), torch.tensor(g, dtype=torch.float64))
    return det


def test_the_window_judge_is_the_runs_own_rules_novelty_gate_included_and_the_excess_left():
    """One judge (issue 67): a fix removes a spike when the run's own acting rules -- with the
    novelty gate that made the run call such moves notes -- do not flag its step and at most
    half the excess over the median is left; an LR cut that leaves most of the excess removed
    nothing; half gone but still flagged is ``lowered``."""
    det = _history(jumps=(3.0,))  # the run showed 3x moves: the gate asks > 6x to act
    det.step(torch.tensor(4.9, dtype=torch.float64), torch.tensor(40.0, dtype=torch.float64))  # the spike: 40x
    same = (4.9, 40.0)
    assert window_effect(det, same, (4.9, 1.0)) == ("removed", 0.0)
    # 4.5x: under the run's own gate (a note there), but 9% of the excess left: removed
    effect, share = window_effect(det, same, (4.9, 4.5))
    assert effect == "removed" and 0.05 < share < 0.1
    # 32x: 79% of the excess left: not removed (an LR cut that moved the grad norm 40 -> 32)
    assert window_effect(det, same, (4.9, 32.0))[0] == "not removed"
    # 15x: 36% left, but the run's rules still act on it: lowered
    assert window_effect(det, same, (4.9, 15.0))[0] == "lowered"
    assert window_effect(det, same, (math.nan, 1.0)) == ("not removed", None)
    # without the gate's memory the same 4.5x would act: the gate is what the run judged with
    plain = _history(grad_novelty=0.0)
    plain.step(torch.tensor(4.9, dtype=torch.float64), torch.tensor(40.0, dtype=torch.float64))
    assert flags_as_run(plain, 4.9, 4.5) and not flags_as_run(det, 4.9, 4.5)


def test_describe_proof_says_what_was_done():
    p = {"verdict": "bad_data", "applied": "masked", "suspect": {"dp_rank": 1}, "documents": [["c", 7]],
         "executions": [{}, {}, {}, {}], "seconds": 1.5}
    assert describe_proof(p) == ("proven in step (3 extra executions, 1.50 s): bad data on DP rank 1, documents "
                                 "c:7; trained without them, quarantined for the rest of the run")
    p = {"verdict": "hardware", "applied": "same", "dp_ranks": [0], "executions": [{}, {}, {}], "seconds": 1.0}
    assert "hardware (transient): DP rank(s) 0 changed between executions; the recomputed update applied" \
        in describe_proof(p)


def test_the_faulty_rank_is_the_one_whose_own_gradients_changed_before_the_clip():
    # a flipped bit on rank 0 raises the global norm 10x: the clip then scales every rank
    before = Execution("original", 7.6, 100.0, [[1970.0, 0.0099, 256, 1], [1932.0, 1e-6, 256, 1]], clip_coef=0.01)
    after = Execution("same", 7.6, 10.0, [[1970.0, 0.0001, 256, 0], [1932.0, 1e-4, 256, 0]], clip_coef=0.1)
    changed = differing_ranks(before, after, 0.0)
    assert changed == [0, 1] and faulty_ranks(before, after, changed) == [0]


def test_a_step_that_is_nan_every_time_reproduced_and_a_non_finite_pair_is_no_noise_and_strict_json():
    """NaN in the same places in every execution is a reproduced step (``not_data``: the
    configured action, not a transient fault -- torch.equal calling NaN unequal to itself
    once proved an LR blow-up ``hardware`` at every step); its NaN gradients compare
    equal bit for bit. Three executions infinitely apart have no noise floor (not
    reproduced), and the distances go into the record as nulls."""
    nan, inf = float("nan"), math.inf

    def mk(variant, equal=1.0):
        e = Execution(variant, nan, nan, [[nan, nan, 100.0, equal]], normal=False)
        e.psq = torch.tensor([nan, 1.0], dtype=torch.float64)
        return e

    g = torch.tensor([1.0, nan, -0.5])
    assert not torch.equal(g, g.clone()) and same_tensor(g, g.clone())
    assert not same_tensor(g, torch.tensor([1.0, nan, 0.5])) and not same_tensor(g, torch.tensor([1.0, 2.0, -0.5]))
    assert reproduced(mk("original"), [mk("same")], 0.0, None, 100.0) == (True, None)
    v = judge(mk("original"), [mk("same")], None, None, 0.0, False)
    assert (v.verdict, v.applied) == ("not_data", "original")
    d = [[local_distance(mk("original"), mk("same"), 0)] * 3]
    assert d == [[inf, inf, inf]]
    changed = [Execution("same", 1.0, 1.0, [[1.0, 2.0, 100.0, 0.0]]),  # finite once, then other values
               Execution("same", 1.5, 1.0, [[1.5, 3.0, 100.0, 0.0]])]
    assert reproduced(mk("original"), changed, 0.0, d, 100.0)[0] is False
    assert judge(mk("original"), changed, None, None, 0.0, False, d, 100.0).applied == "none"
    # one execution made infinite by a fault, the other two within noise: still the fault
    d = [[inf, inf, 2e-6]]
    assert odd_one_out(d, 100.0) == (0, 2e-6)
    assert judge(mk("original"), [mk("same", 0.0), mk("same", 0.0)], None, None, 0.0, False, d, 100.0).applied == "same"
    import json

    rec = noise_record(2e-6, 100.0, d)
    assert rec == {"floor": 2e-6, "factor": 100.0, "distances": [[None, None, 2e-6]]}
    json.dumps(rec, allow_nan=False)  # what the ledger's writer demands
    assert noise_record(inf, 100.0, [[inf, inf, inf]])["floor"] is None


def test_a_mask_is_judged_by_the_update_alone_not_by_the_loss_it_removes():
    """Only the ratio rule fired (grad norm 3.5x its median, loss 6% up). Masking either
    DP rank lowers the loss under the rule's loss bar whatever it does to the grad norm:
    judged at the first execution's loss, a mask that leaves the grad norm at 3.5 is not
    normal (it would convict innocent data), one that brings it to 1.1 is. (Default rules,
    40 steps of history: the z-score rule has not started.)"""
    det = SpikeDetector(SpikeDetector.Config())
    for i in range(40):
        det.step(torch.tensor(2.0, dtype=torch.float64), torch.tensor(1.0 + 0.01 * (i % 3), dtype=torch.float64))
    stats = det.step(torch.tensor(2.12, dtype=torch.float64), torch.tensor(3.5, dtype=torch.float64))
    assert stats[STAT_KEYS.index("ratio")] == 1 and stats[0] == 1
    assert normal_update(det, 2.09, 3.5)  # the loss under the bar: the rule cannot fire
    assert not normal_update(det, 2.09, 3.5, held_loss=2.12)
    assert normal_update(det, 2.09, 1.1, held_loss=2.12)
    assert not normal_update(det, math.nan, 1.1, held_loss=2.12)
    assert normal_update(det, 2.0, 1.1, held_loss=math.nan)  # a NaN first loss cannot be held: its own


def test_inf_is_within_no_tolerance_of_a_finite_value():
    a = Execution("original", math.inf, 1.0, [[math.inf, 1.0, 100.0, 1.0]])
    b = Execution("same", 2.0, 1.0, [[2.0, 1.0, 100.0, 0.0]])
    assert differing_ranks(a, b, 1e-3) == [0] == differing_ranks(a, b, 0.0)
    assert differing_ranks(a, Execution("same", math.inf, 1.0, [[math.inf, 1.0, 100.0, 1.0]]), 1e-3) == []


def test_behind_an_infinite_grad_norm_the_rank_left_non_finite_is_the_faulty_one():
    """A flip to inf on rank 1: the clip multiplied every gradient by 0, so rank 0's became
    0 and rank 1's inf element NaN. Rank 1 is named, not rank 0 (whose 0 differs most)."""
    first = Execution("original", 4.0, math.inf, [[4.0, 0.0, 256, 0], [4.0, math.nan, 256, 0]])
    again = Execution("same", 4.0, 1.5, [[4.0, 1.2, 256, 0], [4.0, 1.05, 256, 0]], clip_coef=0.66)
    changed = differing_ranks(first, again, 0.0)
    assert changed == [0, 1] and faulty_ranks(first, again, changed) == [1]
    v = judge(first, [again, again], None, None)
    assert (v.verdict, v.applied, v.ranks) == ("hardware", "same", [1])
    both = Execution("original", 4.0, math.nan, [[4.0, math.nan, 256, 0], [4.0, math.nan, 256, 0]])
    assert faulty_ranks(both, again, [0, 1]) == [0, 1]  # NaN everywhere: cannot be told apart


def test_a_rank_whose_loss_is_not_finite_is_the_suspect():
    for losses, rank in (([math.nan, 2.0], 0), ([2.0, math.inf], 1), ([2.0, 2.1, math.nan, 2.0], 2)):
        s = name_suspect({"rules": ["non_finite"]}, losses, None, None, 1.0)
        assert s is not None and (s.dp_rank, s.docs, s.evidence) == (rank, None, "rank_loss")
    assert name_suspect({"rules": ["non_finite"]}, [math.nan, math.nan], None, None, 1.0) is None


def test_two_repeats_are_compared_by_their_checksums_not_only_by_their_totals():
    """On a machine that is not bit-reproducible, two repeats can agree in loss and total
    sum of squares and still differ (a last bit in one gradient): then all three executions
    differ and the noise decides, instead of 'the first differed from two that agree'."""
    original = Execution("original", 2.0, 1.0, [[2.0, 1.0, 100.0, 1.0, 1.0]])
    r1 = Execution("same", 2.0, 1.0, [[2.0, 1.0, 100.0, 0.0, 1.0]])
    r2 = Execution("same", 2.0, 1.0, [[2.0, 1.0, 100.0, 0.0, 0.0]])  # unequal to r1 by checksum
    assert differing_ranks(r1, r2, 0.0) == [0]
    assert differing_ranks(r1, Execution("same", 2.0, 1.0, [[2.0, 1.0, 100.0, 0.0, 1.0]]), 0.0) == []
    d = [[2e-7, 3e-7, 2.5e-7]]
    v = judge(original, [r1, r2], None, None, 0.0, False, d, 100.0)
    assert v.verdict == "not_data" and v.noise == 2e-7  # reproduced within the noise; no suspect, no mask


# --------------------------------------------------------------------------- group testing
def _docs(n, size=10):
    return {("s", i): size + (i % 3) for i in range(n)}


def test_halves_split_the_tokens_evenly_and_deterministically():
    from titan_ledger.components.response.bisection import halves

    sizes = {("s", 0): 100, ("s", 1): 60, ("s", 2): 50, ("s", 3): 10}
    a, b = halves(sizes)
    assert a | b == set(sizes) and not a & b
    assert abs(sum(sizes[d] for d in a) - sum(sizes[d] for d in b)) <= 20
    assert (a, b) == halves(dict(reversed(list(sizes.items()))))


@pytest.mark.parametrize("k", [2, 3, 8, 33, 128])
def test_one_bad_document_is_found_in_two_executions_per_halving(k):
    from titan_ledger.components.response.bisection import bisect_documents

    bad = ("s", k // 3)
    calls = []

    def normal_without(docs):
        calls.append(docs)
        return bad in docs

    b = bisect_documents(_docs(k), normal_without)
    assert b.documents == {bad}
    assert b.executions == len(calls) <= 2 * math.ceil(math.log2(k))
    assert all(r["a_normal"] != r["b_normal"] for r in b.path)


def test_no_document_is_convicted_when_removing_any_data_helps_or_none_does():
    from titan_ledger.components.response.bisection import bisect_documents

    assert bisect_documents(_docs(16), lambda docs: True).documents == frozenset()  # "removing data"
    assert bisect_documents(_docs(16), lambda docs: False).documents == frozenset()  # not the data
    assert bisect_documents({("s", 1): 5}, lambda docs: True).path == []  # one document: nothing to split


def test_two_culprits_split_over_both_halves_convict_the_smallest_set_that_alone_explains_it():
    from titan_ledger.components.response.bisection import bisect_documents

    bad = {("s", 1), ("s", 2)}  # both needed masked for the update to be normal

    b = bisect_documents(_docs(16), lambda docs: bad <= docs)
    last = b.path[-1]
    assert not last["a_normal"] and not last["b_normal"]  # they split: neither half alone explains it
    assert last["a"] | last["b"] == (b.documents or set(_docs(16)))  # the last set that alone did
    assert bad <= last["a"] | last["b"]
    if len(b.path) > 1:
        assert bad <= b.documents and len(b.documents) < 16


def test_two_culprits_in_one_half_convict_that_half_and_no_more():
    from titan_ledger.components.response.bisection import bisect_documents, halves

    sizes = _docs(16)
    a, _ = halves(sizes)
    a1, a2 = halves({d: sizes[d] for d in a})
    bad = {min(a1), min(a2)}  # together in the first half, apart in the second round
    b = bisect_documents(sizes, lambda docs: bad <= docs)
    assert b.documents == a and b.executions == 4


def test_a_round_whose_explaining_half_dwarfs_its_control_convicts_nothing():
    """Issue 51: an LR-driven spike, no bad data: masking a 986-token document "brought the
    update back", masking the step's other (38-token) document did not. Masking 96% of
    a batch is no control for 4%: under the size rule nothing is convicted; without it (a
    rank an equal-size mask already convicted) the round narrows as before."""
    from titan_ledger.components.response.bisection import BISECT_BALANCE, bisect_documents

    sizes = {("zoo", 7): 986, ("zoo", 8): 38}
    big_helps = lambda docs: ("zoo", 7) in docs  # noqa: E731
    b = bisect_documents(sizes, big_helps, BISECT_BALANCE)
    assert b.documents == frozenset() and b.path[0]["unbalanced"]
    assert b.to_json()[0]["unbalanced"] is True
    assert bisect_documents(sizes, big_helps).documents == {("zoo", 7)}
    # the small half explaining it against the big one convicts (less data masked did it)
    assert bisect_documents(sizes, lambda docs: ("zoo", 8) in docs, BISECT_BALANCE).documents == {("zoo", 8)}
    # a later unbalanced round keeps the last fair conviction
    sizes = {("s", 1): 600, ("s", 2): 500, ("s", 3): 100, ("s", 4): 10}
    b = bisect_documents(sizes, lambda docs: ("s", 2) in docs, BISECT_BALANCE)
    assert b.documents == {("s", 2), ("s", 3)} and b.path[-1].get("unbalanced")  # 500 against 100
    # the zoo's planted repeated document: 1,501 of 2,048 tokens, 2.74x its control -- convicted
    b = bisect_documents({("zoo", 36): 1501, ("zoo", 35): 300, ("zoo", 37): 247}, lambda d: ("zoo", 36) in d,
                         BISECT_BALANCE)
    assert b.documents == {("zoo", 36)}


@pytest.mark.parametrize("k", [2, 3, 8, 33])
def test_the_size_rule_keeps_finding_one_bad_document_among_similar_ones(k):
    from titan_ledger.components.response.bisection import BISECT_BALANCE, bisect_documents

    bad = ("s", k // 3)
    assert bisect_documents(_docs(k), lambda docs: bad in docs, BISECT_BALANCE).documents == {bad}
