"""Per-document loss (titan_ledger.components.signals.doc_loss): the loss is torchtitan's, and every
segment's (sum, tokens) equals a direct per-document recomputation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss

from titan_ledger.components.signals.doc_loss import DocLossCrossEntropy, DocLossTracker, segment_index
from titan_ledger.data.layout import Segment, positions_of


def _batch(seed=0, b=3, length=32, vocab=50):
    g = torch.Generator().manual_seed(seed)
    rows = [[Segment(0, 0, 10), Segment(1, 0, 22)], [Segment(2, 5, 37)], [Segment(3, 0, 5), Segment(4, 0, 20), Segment(5, 0, 7)]]
    positions = torch.tensor([positions_of(r) for r in rows[:b]])
    pred = torch.randn(b, length, vocab, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (b, length), generator=g)
    labels[2, 4] = IGNORE_INDEX  # a masked label is not a token of its document
    return rows, positions, pred, labels


def test_segment_index_counts_position_resets():
    assert segment_index(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist() == [[0, 0, 0, 1, 1, 2]]


def test_loss_equals_torchtitans_and_segments_equal_direct_recomputation():
    rows, positions, pred, labels = _batch()
    ours = DocLossCrossEntropy(DocLossCrossEntropy.Config())
    ours.tracker = tracker = DocLossTracker(k=8, min_tokens=1)
    tracker.push(positions)
    loss, _ = ours(pred, labels, torch.tensor(90.0))
    ref, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(pred, labels, torch.tensor(90.0))
    assert math.isclose(float(loss.detach()), float(ref.detach()), rel_tol=1e-6)
    loss.backward()  # the loss stays differentiable
    s = tracker.decode(tracker.summary(torch.device("cpu")).tolist())
    assert s["n"] == 6 and s["n_valid"] == 6
    got = {(r, seg): (ls, t) for r, seg, ls, t in s["top"]}
    for r, segs in enumerate(rows):
        start = 0
        for i, sg in enumerate(segs):
            lab = labels[r, start:start + len(sg)]
            keep = lab != IGNORE_INDEX
            want = F.cross_entropy(pred.detach()[r, start:start + len(sg)][keep].double(), lab[keep], reduction="sum")
            assert math.isclose(got[(r, i)][0], float(want), rel_tol=1e-4), (r, i)
            assert got[(r, i)][1] == int(keep.sum())
            start += len(sg)
    means = sorted(ls / t for ls, t in got.values())
    assert math.isclose(s["median"], means[2], rel_tol=1e-4)  # torch.median: the lower middle value


def test_top_and_bottom_k_and_the_min_tokens_floor():
    rows, positions, pred, labels = _batch(seed=1)
    with torch.no_grad():
        pred[1] = -10.0
        pred[1, torch.arange(32), labels[1]] = 10.0  # row 1's document is perfectly predicted
    loss_fn = DocLossCrossEntropy(DocLossCrossEntropy.Config())
    loss_fn.tracker = tracker = DocLossTracker(k=2, min_tokens=8)
    tracker.push(positions)
    loss_fn(pred, labels, None)
    tracker.set_documents([[0, "c4", [[3, 0, 20], [4, 0, 5]]], [1, "c4", [[3, 20, 52]]]])
    s = tracker.decode(tracker.summary(torch.device("cpu")).tolist())
    assert s["n"] == 6 and s["n_valid"] == 4  # the 5- and 7-token segments are not ranked
    assert s["docs"] == 1  # document 3 sliced over two rows; document 4's 5 tokens are not ranked
    tracker.push(positions)
    loss_fn(pred, labels, None)  # the next step, its documents not given: no count (not the last one)
    assert "docs" not in tracker.decode(tracker.summary(torch.device("cpu")).tolist())
    assert s["bottom"][0][:2] == [1, 0]  # the lowest-loss document is named
    assert all(t >= 8 for *_, t in s["top"] + s["bottom"]) and len(s["top"]) == 2


def test_microbatches_and_sequence_chunks_keep_their_keys():
    # two microbatches (grad accumulation / PP), the second fed as 4 sequence chunks
    # (ChunkedLossWrapper): keys must be the rows' index within the step
    rows, positions, pred, labels = _batch(seed=2)
    tracker = DocLossTracker(k=16, min_tokens=1)
    loss_fn = DocLossCrossEntropy(DocLossCrossEntropy.Config())
    loss_fn.tracker = tracker
    tracker.push(positions[:1])
    tracker.push(positions[1:])
    loss_fn(pred[:1], labels[:1], None)
    for c in range(4):
        sl = slice(8 * c, 8 * (c + 1))
        loss_fn(pred[1:, sl], labels[1:, sl], None)
    s = tracker.decode(tracker.summary(torch.device("cpu")).tolist())
    whole = DocLossTracker(k=16, min_tokens=1)
    loss_fn.tracker = whole
    whole.push(positions)
    loss_fn(pred, labels, None)
    w = whole.decode(whole.summary(torch.device("cpu")).tolist())
    key = lambda e: (e[0], e[1])  # noqa: E731
    assert sorted(map(key, s["top"])) == sorted(map(key, w["top"]))
    a = {key(e): e[2] for e in s["top"]}
    assert all(math.isclose(a[key(e)], e[2], rel_tol=1e-9) for e in w["top"])


def test_validation_and_unannounced_calls_are_not_tracked():
    rows, positions, pred, labels = _batch()
    loss_fn = DocLossCrossEntropy(DocLossCrossEntropy.Config())
    loss_fn.tracker = tracker = DocLossTracker()
    with torch.no_grad():
        loss_fn(pred, labels, None)  # validation: no grad, no positions pushed
    loss_fn(pred, labels, None)  # a call nobody announced
    assert tracker.decode(tracker.summary(torch.device("cpu")).tolist()) is None


def test_rewind_step_forgets_shape_inference_calls():
    # PP shape inference runs the loss on made-up activations inside the first step
    rows, positions, pred, labels = _batch(seed=3)
    loss_fn = DocLossCrossEntropy(DocLossCrossEntropy.Config())
    loss_fn.tracker = tracker = DocLossTracker(k=16, min_tokens=1)
    tracker.push(positions)
    loss_fn(torch.randn_like(pred, requires_grad=True), labels, None)  # inference
    tracker.rewind_step()
    loss_fn(pred, labels, None)
    got = tracker.decode(tracker.summary(torch.device("cpu")).tolist())
    clean = DocLossTracker(k=16, min_tokens=1)
    loss_fn.tracker = clean
    clean.push(positions)
    loss_fn(pred, labels, None)
    want = clean.decode(clean.summary(torch.device("cpu")).tolist())
    assert got == want
