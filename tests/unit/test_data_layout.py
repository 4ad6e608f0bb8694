"""Pure data bookkeeping: skip windows, sample-id layout, span packing, Megatron .idx."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from titan_ledger.data import indexed
from titan_ledger.data.indexed import Blend, CorpusError, IndexedCorpus, IndexedWriter, read_idx
from titan_ledger.data.layout import (RowTag, Segment, SkipError, pack_span, parse_skip_steps,
                                      sample_id, window_at)


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
    with pytest.raises(SkipError, match="--ledger.skip_steps"):
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


def test_row_tag_round_trip():
    t = RowTag(7, "web", (Segment(3, 0, 10), Segment(4, 5, 9)))
    assert RowTag.from_json(t.to_json()) == t
    assert t.as_dict()["segments"][1] == {"doc": 4, "start": 5, "end": 9}


# --------------------------------------------------------------------------- Megatron .idx
def _spec_idx(path, dtype_code, lengths, itemsize):
    """An .idx written byte by byte from Megatron's spec (not with our writer)."""
    n = len(lengths)
    with open(path, "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", n + 1))
        for x in lengths:
            f.write(struct.pack("<i", x))
        off = 0
        for x in lengths:
            f.write(struct.pack("<q", off))
            off += x * itemsize
        for i in range(n + 1):
            f.write(struct.pack("<q", i))


def test_reads_an_idx_written_from_the_spec(tmp_path):
    docs = [[0, 5, 6, 7, 1], [0, 9, 1], [0, 11, 12, 13, 14, 15, 1]]
    prefix = tmp_path / "spec"
    (tmp_path / "spec.bin").write_bytes(np.concatenate([np.array(d, np.uint16) for d in docs]).tobytes())
    _spec_idx(tmp_path / "spec.idx", 8, [len(d) for d in docs], 2)
    hdr, lengths, pointers, doc_idx = read_idx(tmp_path / "spec.idx")
    assert hdr.dtype == np.uint16 and list(lengths) == [5, 3, 7]
    assert list(pointers) == [0, 10, 16] and list(doc_idx) == [0, 1, 2, 3]
    c = IndexedCorpus(prefix, seq_len=4, seed=0, shuffle=False)
    assert [c.doc_tokens(i).tolist() for i in range(3)] == docs
    # our writer produces the same bytes as the spec
    w = IndexedWriter(tmp_path / "ours", np.uint16)
    for d in docs:
        w.add(d)
    w.finish()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "spec.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "spec.bin").read_bytes()


def test_bad_idx_names_the_file(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"NOTMAGIC!" + bytes(40))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(CorpusError, match="x.idx: not a Megatron .idx"):
        read_idx(tmp_path / "x.idx")
    with pytest.raises(CorpusError, match="titan_ledger.prepare"):
        IndexedCorpus(tmp_path / "missing", 4, 0)


def _corpus(tmp_path, name, n_docs, seed=0, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    w = IndexedWriter(tmp_path / name, np.uint16)
    for _ in range(n_docs):
        w.add(rng.integers(3, 2000, size=int(rng.integers(2, 60))))
    w.finish()
    return IndexedCorpus(tmp_path / name, seq_len=16, seed=seed)


def test_epoch_covers_every_trainable_token_once_and_rows_are_exact(tmp_path):
    c = _corpus(tmp_path, "a", 200)
    seen = {}
    for k in range(c.samples_per_epoch):
        inputs, labels, positions, segs = c.row(k)
        o = 0
        for s in segs:
            toks = c.doc_tokens(s.doc)
            assert inputs[o:o + len(s)].tolist() == toks[s.start:s.end].tolist()
            assert labels[o:o + len(s)].tolist() == toks[s.start + 1:s.end + 1].tolist()
            assert positions[o:o + len(s)].tolist() == list(range(len(s)))
            o += len(s)
            for t in range(s.start, s.end):
                assert (s.doc, t) not in seen, "a token trained twice in one epoch"
                seen[(s.doc, t)] = k
    total = int(np.maximum(c.lengths.astype(int) - 1, 0).sum())
    assert len(seen) == c.samples_per_epoch * 16 and total - len(seen) < 16  # only the tail dropped
    # epoch 1 is another order of the same rows; the index is cached and reopened
    assert c.pieces(c.samples_per_epoch) != c.pieces(0)
    again = IndexedCorpus(tmp_path / "a", seq_len=16, seed=0)
    assert [again.pieces(k) for k in (0, 5, c.samples_per_epoch + 3)] == \
        [c.pieces(k) for k in (0, 5, c.samples_per_epoch + 3)]
    assert len(list(c.cache_dir.glob("*.npy"))) == 6  # 3 arrays x 2 epochs
    assert IndexedCorpus(tmp_path / "a", seq_len=16, seed=1).pieces(0) != c.pieces(0)


def test_blend_shares_and_constant_time_lookup(tmp_path):
    a, b = _corpus(tmp_path, "a", 100), _corpus(tmp_path, "b", 100, rng_seed=1)
    blend = Blend([a, b], [3.0, 1.0])
    first = [blend.locate(i)[0].name for i in range(4000)]
    assert abs(first.count("a") / 4000 - 0.75) < 0.01
    # sample 10^12 is arithmetic, not iteration
    corpus, k = blend.locate(10 ** 12)
    assert blend.tag(10 ** 12).source == corpus.name and k > 10 ** 11
    # every sample of each corpus is used once, in order, per corpus
    ks = [blend.locate(i) for i in range(2 * blend.block)]
    for name in ("a", "b"):
        got = [k for c, k in ks if c.name == name]
        assert got == list(range(len(got)))
    with pytest.raises(CorpusError, match="--dataloader.weights"):
        Blend([a, b], [1.0])


def test_token_dtype_rule():
    assert indexed.token_dtype(2048) is np.uint16
    assert indexed.token_dtype(128256) is np.int32
