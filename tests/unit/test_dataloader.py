"""LedgerDataLoader in one process (its workers are real DataLoader workers).

Checks the properties the data ledger promises: rows equal torchtitan's, the
indexed corpus equals the text stream, num_workers 0 == 2, the position counts
what training consumed, skip == consume, resume continues exactly, fingerprint
and DP-size rules.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from titan_ledger.config_registry import CORPUS_DIR, TOKENIZER_DIR
from titan_ledger.data.indexed import IndexedCorpus
from titan_ledger.data.text import Cursor, TextStream
from titan_ledger.dataloader import STATE_KEY, DataStateError, LedgerDataLoader
from titan_ledger.prepare import load_tokenizer, prepare

SEQ = 64


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tok):
    prefix = str(tmp_path_factory.mktemp("corpus") / "bundled")
    meta = prepare([str(CORPUS_DIR)], prefix, tokenizer=tok, progress=False)
    assert meta["documents"] == 457
    return prefix


def loader(tok, corpus=None, dp=1, rank=0, mbs=2, workers=0, **kw):
    if corpus is not None:
        kw.setdefault("source", "indexed")
        kw.setdefault("paths", [corpus])
    cfg = LedgerDataLoader.Config(dataset="c4_test", dataset_path=str(CORPUS_DIR),
                                  num_workers=workers, **kw)
    return LedgerDataLoader(cfg, dp_world_size=dp, dp_rank=rank, tokenizer=tok, seq_len=SEQ,
                            local_batch_size=mbs)


def take(dl, n):
    out = []
    for inputs, labels in itertools.islice(iter(dl), n):
        assert set(inputs) == {"input", "positions"}  # provenance never reaches the model
        out.append((inputs["input"].clone(), labels.clone(), inputs["positions"].clone(),
                    [t.to_json() for t in dl.take_tags()]))
    return out


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
        assert x[3] == y[3]


def test_text_rows_equal_torchtitan_hf_dataset(tok):
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    for dp, rank in ((1, 0), (2, 1)):
        ref = HuggingFaceTextDataset("c4_test", str(CORPUS_DIR), tok, seq_len=SEQ, dp_rank=rank,
                                     dp_world_size=dp)
        ours = TextStream("c4_test", str(CORPUS_DIR), tok, SEQ, rank, dp, seed=0).rows(Cursor())
        for (inp, lab), (segs, _, i2, l2) in itertools.islice(zip(ref, ours), 400):
            assert inp["input"].tolist() == i2 and lab.tolist() == l2
            assert inp["positions"].tolist() == [p for s in segs for p in range(len(s))]


def test_unshuffled_indexed_corpus_equals_text_stream(tok, corpus):
    c = IndexedCorpus(corpus, SEQ, seed=0, shuffle=False)
    ours = TextStream("c4_test", str(CORPUS_DIR), tok, SEQ, 0, 1, seed=0).rows(Cursor())
    for k, (segs, _, inputs, labels) in zip(range(400), ours):
        i2, l2, _, s2 = c.row(k)
        assert i2.tolist() == inputs and l2.tolist() == labels and s2 == segs


@pytest.mark.parametrize("source", ["text", "indexed"])
def test_workers_do_not_change_the_sequence_and_position_counts_consumption(tok, corpus, source):
    c = corpus if source == "indexed" else None
    ref = take(loader(tok, c, dp=2, rank=1), 7)
    dl = loader(tok, c, dp=2, rank=1, workers=2)
    got = take(dl, 3)  # workers have prefetched further than this
    same(got, ref[:3])
    assert dl.position == 3 * 2 * 2
    state = dl.state_dict()
    # a new loader (as after kill -9) continues exactly at the consumed position
    dl2 = loader(tok, c, dp=2, rank=1, workers=2)
    dl2.load_state_dict(state)
    same(take(dl2, 4), ref[3:7])
    ids = [t[0] for b in ref for t in b[3]]
    assert ids == [q * 4 + 2 + j for q in range(7) for j in range(2)]  # Megatron layout, rank 1


@pytest.mark.parametrize("source", ["text", "indexed"])
def test_skip_equals_consuming_without_building(tok, corpus, source):
    c = corpus if source == "indexed" else None
    ref = take(loader(tok, c), 9)
    dl = loader(tok, c, workers=2)
    it = iter(dl)
    next(it)
    dl.take_tags()
    info = dl.skip(5)
    assert (info.position_before, info.position_after) == (2, 12)
    if source == "text":
        assert [t.to_json() for t in info.tags] == [t for b in ref[1:6] for t in b[3]]
    else:
        assert info.tags is None  # derivable from the ids
    inputs, labels = next(it)
    assert torch.equal(inputs["input"], ref[6][0]) and dl.take_tags()[0].sample_id == 12


def test_indexed_skip_is_arithmetic(tok, corpus, monkeypatch):
    dl = loader(tok, corpus, mbs=4)
    blend = dl.source

    def no_reading(*_):
        raise AssertionError("a skip of an indexed corpus must not read samples")

    monkeypatch.setattr(blend, "row", no_reading)
    monkeypatch.setattr(blend, "tag", no_reading)
    dl.skip(10 ** 6 * 8)  # (its cost is measured in bench/bench_data.py)
    monkeypatch.undo()
    inputs, _ = next(iter(dl))
    assert dl.take_tags()[0].sample_id == 4 * 8 * 10 ** 6


def test_fingerprint_change_is_refused_unless_allowed(tok):
    state = take_state(loader(tok), 2)
    other = loader(tok, seed=99)
    with pytest.raises(DataStateError, match="--ledger.allow_data_change"):
        other.load_state_dict(state)
    other.allow_data_change = True
    other.load_state_dict(state)
    assert other.position == 4


def take_state(dl, n):
    take(dl, n)
    return dl.state_dict()


def test_text_stream_refuses_another_dp_size(tok):
    state = take_state(loader(tok, dp=2, rank=0), 2)
    with pytest.raises(DataStateError, match="indexed corpus"):
        loader(tok, dp=1, rank=0).load_state_dict(state)


def test_indexed_corpus_resumes_with_another_dp_size(tok, corpus):
    # 2 ranks x mbs 2 for 3 rounds, then 1 rank x mbs 4: the global sequence continues
    r0, r1 = loader(tok, corpus, dp=2, rank=0), loader(tok, corpus, dp=2, rank=1)
    take(r0, 3), take(r1, 3)
    state = r0.state_dict()
    assert json.loads(state[STATE_KEY])["position"] == 12
    solo = loader(tok, corpus, dp=1, rank=0, mbs=4)
    solo.load_state_dict(state)
    got = take(solo, 2)
    straight = loader(tok, corpus, dp=1, rank=0, mbs=4)
    ref = take(straight, 5)
    same(got, ref[3:5])
    assert [t[0] for t in got[0][3]] == [12, 13, 14, 15]
