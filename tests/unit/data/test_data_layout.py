"""titan_ledger.data.layout: skip windows, sample-id layout, span packing, row tags.

(The Megatron .bin/.idx corpus and the blend are tested in test_indexed.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from titan_ledger.data.layout import (
    EpochOrder,
    RowTag,
    Segment,
    SkipError,
    pack_span,
    parse_skip_steps,
    sample_id,
    window_at,
)


# --------------------------------------------------------------------------- skip windows
def test_skip_steps_parse_merge_and_cli_form():
    assert parse_skip_steps(["137000-137300", "140001"]) == [(137000, 137300), (140001, 140001)]
    assert parse_skip_steps("5-7,3,8-9, 20") == [(3, 3), (5, 9), (20, 20)]  # adjacent windows merge
    assert parse_skip_steps([]) == []
    w = parse_skip_steps(["10-20", "30"])
    assert [window_at(w, s) for s in (9, 10, 15, 20, 21, 30, 31)] == \
        [None, (10, 20), (10, 20), (10, 20), None, (30, 30), None]


@pytest.mark.parametrize("bad", ["0", "7-3", "a-b", "1-", "-5"])
def test_skip_steps_bad_entries_name_the_flag(bad):
    with pytest.raises(SkipError, match="--ledger.skip.steps"):
        parse_skip_steps([bad])


# --------------------------------------------------------------------------- ids and spans
def test_megatron_sample_layout_is_disjoint_and_dense():
    mbs, dp = 3, 4
    ids = [sample_id(24, r, mbs, j) for r in range(dp) for j in range(mbs)]
    assert ids == list(range(24, 36))


def test_pack_span_splits_across_documents_and_skips_empty_ones():
    cum = [0, 5, 5, 12, 20]  # doc 1 is empty
    assert pack_span(cum, 3, 6) == [(0, 3, 5), (2, 0, 4)]
    assert pack_span(cum, 0, 20)[-1] == (3, 0, 8)
    with pytest.raises(IndexError):
        pack_span(cum, 15, 10)


def test_epoch_order_is_stored_then_seeded_permutations_one_epoch_kept():
    order = EpochOrder(10, 20, seed=7)
    assert order(0).tolist() == list(range(10, 20)) and order(0).dtype == np.int64
    e1 = order(1)
    assert e1.tolist() == (10 + np.random.default_rng([7, 1]).permutation(10)).tolist()
    assert order(1) is e1 and order(2).tolist() != e1.tolist() and order(1) is not e1  # one epoch kept
    assert order(1).tolist() == e1.tolist()  # ... and recomputed the same
    assert EpochOrder(10, 20, seed=8)(1).tolist() != e1.tolist()
    assert EpochOrder(10, 20, seed=7, ids=lambda p: p * 100)(1).tolist() == (e1 * 100).tolist()


def test_row_tag_round_trip():
    t = RowTag(7, "web", (Segment(3, 0, 10), Segment(4, 5, 9)))
    assert RowTag.from_json(t.to_json()) == t
    assert t.as_dict()["segments"][1] == {"doc": 4, "start": 5, "end": 9}
