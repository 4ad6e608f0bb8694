"""bench/bench_detection.py's pure parts: what each rehearsal's proof should say, and its cases."""

from helpers import load_bench

det = load_bench("bench_detection")


def test_what_each_rehearsal_should_be_proven():
    assert det.expected("bitflip@1.5", None) == det.expected("bitflip@3", False) == "hardware"
    assert det.expected("split", None) == "bad_data"
    # a replaced batch: an incident only when the update it made was abnormal
    assert det.expected("random", True) == det.expected("repeat", True) == "bad_data"
    assert det.expected("random", False) == "outlier" and det.expected("repeat", None) is None


def test_the_ranks_a_proof_must_name():
    assert det.rank_named({"kind": "bitflip@2", "rank": 1, "proof_dp_ranks": [1]})
    assert not det.rank_named({"kind": "bitflip@2", "rank": 1, "proof_dp_ranks": [0, 1]})
    assert det.rank_named({"kind": "split", "rank": 0, "proof_dp_ranks": [0, 1]})
    assert det.rank_named({"kind": "random", "rank": 1, "proof_dp_rank": 1})
    assert not det.rank_named({"kind": "random", "rank": 1, "proof_dp_rank": None})


def test_cases():
    new = det.cases_of("new", quick=True)
    assert [c[3] for c in new] == ["bitflip@1.5", "bitflip@2", "bitflip@3"] * 2 + ["split"] * 2
    assert det.cases_of("all", quick=True) == det.cases_of("old", quick=True) + new
    assert {c[0] for c in det.cases_of("old", quick=False)} == {2, 4}
    assert {c[1] for c in det.cases_of("old", quick=True)} == {12, 30}
