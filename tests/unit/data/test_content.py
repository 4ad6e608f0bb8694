"""titan_ledger.data.content: documents compared by their token shingles, not their ids,
and the memory of what trained recently (issue 68). No processes."""

from __future__ import annotations

import numpy as np

from titan_ledger.data.content import NEAR, ContentMemory, covered, segments_of, shingles, window_hashes
from titan_ledger.data.layout import RowTag, Segment


def test_runs_of_one_character_of_different_lengths_are_the_same_content():
    tab, longer, star = shingles([9] * 30), shingles([9] * 400), shingles([42] * 381)
    assert tab.size == 1 and covered(tab, longer) == 1.0 and covered(tab, star) == 0.0
    assert shingles([1, 2]).size == 1 and shingles([]).size == 0  # shorter than a shingle: one


def test_overlap_is_the_share_of_shingles_the_other_holds():
    a, b = shingles(range(100)), shingles(range(50, 150))
    assert 0.4 < covered(a, b) < NEAR  # half the text shared (its windows across the seam not): under the bar
    assert covered(a, shingles(range(100))) == 1.0 and covered(shingles([]), a) == 0.0


def test_segments_of_joins_each_documents_spans_across_rows():
    tokens = np.arange(12).reshape(2, 6)
    tags = [RowTag(0, "c", (Segment(3, 10, 14), Segment(4, 0, 2))), RowTag(1, "c", (Segment(4, 2, 8),))]
    out = segments_of(tokens, tags)
    assert out[("c", 3)].tolist() == [0, 1, 2, 3] and out[("c", 4)].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_the_memory_answers_for_earlier_unflagged_steps_within_its_window():
    m = ContentMemory(1 << 10, window=50)
    doc = window_hashes([5, 6, 7, 8, 9, 10, 11])
    m.record(10, doc)
    m.record(20, doc)  # fetched again (the step after a flagged one, say): both stamps kept
    h = np.unique(doc)
    assert m.seen_before(h, 21).all()
    assert m.seen_before(h, 21, flagged={20}).all()  # step 10's stamp still answers
    assert not m.seen_before(h, 21, flagged={10, 20}).any()
    assert not m.seen_before(h, 10).any()  # nothing before step 10
    assert not m.seen_before(h, 80).any()  # out of the window (80 - 50 > 20)
    assert m.nbytes == (1 << 10) * 2 * 4
