"""Loss masks (titan_ledger.data.filters): quarantine and the repetition filter."""

from __future__ import annotations

import json

import pytest
import torch

from titan_ledger.data.filters import IGNORE_INDEX, Quarantine, mask_repetitive, repetitive_segments
from titan_ledger.data.layout import RowTag, Segment, positions_of
from titan_ledger.errors import ConfigError


def test_quarantine_masks_the_named_documents_wherever_they_are(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"source": "c4", "doc": 7}) + "\n\n" + json.dumps({"source": "web", "doc": 1}) + "\n")
    quar = Quarantine([str(q)])
    assert quar.docs == {("c4", 7), ("web", 1)} and len(quar.digest) == 16
    tags = [RowTag(0, "c4", (Segment(3, 0, 4), Segment(7, 0, 4))), RowTag(1, "c4", (Segment(7, 4, 12),)),
            RowTag(2, "web", (Segment(7, 0, 8),))]  # doc 7 of another source is another document
    labels = torch.arange(24).reshape(3, 8)
    assert quar.mask(tags, labels) == [[0, 1], [1, 0]]
    assert labels[0].tolist() == [0, 1, 2, 3] + [IGNORE_INDEX] * 4
    assert (labels[1] == IGNORE_INDEX).all() and (labels[2] != IGNORE_INDEX).all()
    # the digest is of the set, not of the file's order or blank lines
    q2 = tmp_path / "q2.jsonl"
    q2.write_text(json.dumps({"source": "web", "doc": 1}) + "\n" + json.dumps({"source": "c4", "doc": 7}) + "\n")
    assert Quarantine([str(q2)]).digest == quar.digest
    assert not Quarantine([])


@pytest.mark.parametrize("content, match", [(None, "no such file"), ("nope\n", "q.jsonl:1"),
                                            ('{"source": "c4"}\n', "q.jsonl:1")])
def test_bad_quarantine_files_name_the_line(tmp_path, content, match):
    q = tmp_path / "q.jsonl"
    if content is not None:
        q.write_text(content)
    with pytest.raises(ConfigError, match=match):
        Quarantine([str(q)])


def test_repetition_filter_masks_whole_segments_holding_a_repeated_ngram():
    torch.manual_seed(0)
    segs = [Segment(0, 0, 40), Segment(1, 0, 60)]
    positions = torch.tensor([positions_of(segs)] * 3)
    tokens = torch.randint(100, 1000, (3, 100))
    tokens[0, 45:45 + 33] = 5  # row 0, segment 1: one token 33 times
    tokens[1, 1:1 + 3 * 33] = torch.tensor([7, 8, 9]).repeat(33)  # 33 repeats, but split by the boundary at 40
    tokens[2, 50:100] = torch.tensor([7, 8, 9]).repeat(17)[:50]  # period 3, 16 repeats: too few
    m = repetitive_segments(tokens, positions, min_repeats=32, max_period=13)
    assert m[0, 40:].all() and not m[0, :40].any()
    assert not m[1].any()  # a repeat that is broken by the segment boundary does not count
    assert not m[2].any()
    labels = tokens.clone()
    assert mask_repetitive(tokens, positions, labels, 32, 13) == [[0, 1]]
    assert (labels[0, 40:] == IGNORE_INDEX).all() and (labels[1:] != IGNORE_INDEX).all()


def test_repetition_filter_periods():
    segs = [Segment(0, 0, 500)]
    positions = torch.tensor([positions_of(segs)])
    for period in (1, 5, 13):
        tokens = torch.randint(100, 1000, (1, 500), generator=torch.Generator().manual_seed(period))
        tokens[0, 10:10 + 32 * period] = tokens[0, 10:10 + period].repeat(32)
        assert repetitive_segments(tokens, positions, 32, 13).all(), period
        assert not repetitive_segments(tokens, positions, 33, 13).any(), period
    tokens = torch.randint(100, 1000, (1, 500), generator=torch.Generator().manual_seed(1))
    tokens[0, :14 * 12] = tokens[0, :14].repeat(12)  # period 14: beyond max_period
    assert not repetitive_segments(tokens, positions, 12, 13).any()
