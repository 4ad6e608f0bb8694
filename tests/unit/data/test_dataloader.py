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
from titan_ledger.data.loader import STATE_KEY, DataStateError, LedgerDataLoader
from titan_ledger.data.prepare import load_tokenizer, prepare
from titan_ledger.data.text import Cursor, TextStream

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
    cfg = LedgerDataLoader.Config(dataset="stdlib_docs", dataset_path=str(CORPUS_DIR),
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


def test_unshuffled_indexed_corpus_equals_text_stream(tok, corpus):
    c = IndexedCorpus(corpus, SEQ, seed=0, shuffle=False)
    ours = TextStream("stdlib_docs", str(CORPUS_DIR), tok, SEQ, 0, 1, seed=0).rows(Cursor())
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


# --------------------------------------------------------------------------- config checks
@pytest.mark.parametrize("kw, flag", [
    (dict(source="parquet"), "--dataloader.source 'parquet'"),
    (dict(source="indexed"), "--dataloader.source indexed needs --dataloader.paths"),
    (dict(paths=["a"]), "--dataloader.paths is only read with --dataloader.source indexed"),
    (dict(weights=[1.0]), "--dataloader.weights is only read with"),
    (dict(prepare_from="x"), "--dataloader.prepare_from is only read with"),
    (dict(dataset=""), "--dataloader.dataset: empty"),
    (dict(source="indexed", paths=["a", "b"], weights=[1.0]),
     "--dataloader.weights has 1 entries for 2 --dataloader.paths"),
    (dict(source="indexed", paths=["a", "b"], weights=[1.0, 0.0]), "--dataloader.weights .* > 0"),
    (dict(source="indexed", paths=["a", "b"], weights=[1.0, float("nan")]), "--dataloader.weights"),
    (dict(source="indexed", paths=["x/web", "y/web"]), "--dataloader.paths .* distinct"),
    (dict(source="indexed", paths=["corpora/"]), "--dataloader.paths 'corpora/': .* not a folder"),
    (dict(source="indexed", paths=["a", "b"], prepare_from="src"),
     "--dataloader.prepare_from needs exactly one --dataloader.paths, got 2"),
    (dict(seed=-1), "--dataloader.seed -1"),
    (dict(tagging="yes"), "--dataloader.tagging 'yes'"),
    (dict(num_workers=-1), "--dataloader.num_workers -1"),
    (dict(prefetch_factor=2), "--dataloader.prefetch_factor needs --dataloader.num_workers > 0"),
    (dict(prefetch_factor=0, num_workers=2), "--dataloader.prefetch_factor 0"),
])
def test_config_is_checked_at_construction_naming_the_flag(kw, flag):
    from titan_ledger.errors import ConfigError

    with pytest.raises(ConfigError, match=flag):
        LedgerDataLoader.Config(**kw)


def test_config_post_init_runs_with_slots_and_on_replace():
    import dataclasses

    from titan_ledger.errors import ConfigError

    ok = LedgerDataLoader.Config(source="indexed", paths=["a", "b"], weights=[0.7, 0.3],
                                 num_workers=2, prefetch_factor=4)
    assert not hasattr(ok, "__dict__")  # still a slots dataclass
    with pytest.raises(ConfigError, match="--dataloader.weights has 3 entries"):
        dataclasses.replace(ok, weights=[1.0, 1.0, 1.0])  # build() copies the config this way


# --------------------------------------------------------------------------- prepare on rank 0
class FakeDist:
    """Just the collective ``prepare_once`` uses, as seen from one rank."""

    def __init__(self, rank, incoming=None):
        self.rank, self.incoming, self.sent = rank, incoming, []

    def is_initialized(self):
        return True

    def get_world_size(self):
        return 2

    def get_rank(self):
        return self.rank

    def broadcast_object_list(self, box, src):
        assert src == 0 and len(box) == 1
        if self.rank == 0:
            self.sent.append(box[0])
        else:
            assert box == [None]
            box[0] = self.incoming

    def barrier(self):
        raise AssertionError("a barrier hangs every other rank when rank 0 failed")


def test_a_failed_preparation_on_rank_0_stops_every_rank_with_its_message(tmp_path, tok, monkeypatch):
    from titan_ledger.data import inputs as inputs_mod
    from titan_ledger.data.indexed import CorpusError

    (tmp_path / "empty.jsonl").write_text("")
    prefix = str(tmp_path / "c")
    rank0 = FakeDist(0)
    monkeypatch.setattr(inputs_mod, "dist", rank0)
    with pytest.raises(CorpusError, match="--dataloader.prepare_from .*empty.jsonl: preparing .*c.bin/.idx "
                                          "on rank 0 failed: .*no documents") as e0:
        inputs_mod.prepare_once(str(tmp_path / "empty.jsonl"), prefix, tok)
    assert len(rank0.sent) == 1 and "no documents" in rank0.sent[0]
    rank1 = FakeDist(1, incoming=rank0.sent[0])
    monkeypatch.setattr(inputs_mod, "dist", rank1)
    with pytest.raises(CorpusError) as e1:
        inputs_mod.prepare_once(str(tmp_path / "empty.jsonl"), prefix, tok)
    assert str(e1.value) == str(e0.value)  # the same one line on every rank
    # success: rank 0 broadcasts None and the other ranks carry on
    src = tmp_path / "one.jsonl"
    src.write_text('{"text": "def f(): return 1"}\n' * 40)
    ok0 = FakeDist(0)
    monkeypatch.setattr(inputs_mod, "dist", ok0)
    inputs_mod.prepare_once(str(src), prefix, tok)
    assert ok0.sent == [None] and (tmp_path / "c.idx").exists()
    monkeypatch.setattr(inputs_mod, "dist", FakeDist(1, incoming=None))
    inputs_mod.prepare_once(str(src), prefix, tok)


# --------------------------------------------------------------------------- blend rule, profiling
def test_blend_rule_is_in_the_fingerprint_and_header(tok, corpus, tmp_path):
    import shutil

    from titan_ledger.data.indexed import BLEND_RULE, Blend
    from titan_ledger.data.inputs import fingerprint

    for suffix in (".bin", ".idx"):
        shutil.copy(corpus + suffix, str(tmp_path / "other") + suffix)
    dl = loader(tok, paths=[corpus, str(tmp_path / "other")], weights=[0.7, 0.3], source="indexed")
    assert dl.header()["spec"]["blend_rule"] == BLEND_RULE == 2
    old = Blend(dl.source.corpora, [0.7, 0.3], rule=1)
    assert dl.fingerprint == fingerprint(f"indexed:{dl.source.fingerprint()}", tok, SEQ, 1234)
    assert dl.fingerprint != fingerprint(f"indexed:{old.fingerprint()}", tok, SEQ, 1234)
    # sample 4 is where Megatron's rule (ours now) and the former rule part
    assert dl.source.locate(4)[0].name == "other" and old.locate(4)[0].name == "bundled"


@pytest.mark.parametrize("source", ["text", "indexed"])
def test_tagging_work_is_in_profiler_spans(tok, corpus, source):
    from torch.profiler import ProfilerActivity, profile

    from titan_ledger.data.batches import TAGGING_SPAN

    dl = loader(tok, corpus if source == "indexed" else None)
    it = iter(dl)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            next(it)
            dl.take_tags()
    spans = [e for e in prof.events() if e.name == TAGGING_SPAN]
    # per batch: the dataset's tags (main process, 0 workers), the hand-over, take_tags
    assert len(spans) == 3 * 3, [e.name for e in prof.events()][:20]


def test_reading_ahead_counts_what_a_quarantine_would_leave_of_the_next_steps(tok, corpus):
    """``LedgerDataLoader.scan`` and ``document_facts``: the rows of the steps from a
    sample position on, read in the corpus's own order -- the same rows training fetches
    -- so a quarantine's bound knows which steps it would empty, and which earlier steps
    held the documents."""
    dl = loader(tok, corpus, shuffle=False, mbs=2)
    gb = 2  # DP 1 x 2 rows a step
    steps = take(dl, 4)  # what training fetches
    docs = {("bundled", s[0]) for t in steps[1][3] for s in t[2]}
    want = [[k, sum(s[2] - s[1] for t in tags for s in t[2] if ("bundled", s[0]) in docs)]
            for k, (_, _, _, tags) in enumerate(steps)]
    got = dl.scan(docs, 0, 4, gb)
    assert got["with"] == [w for w in want if w[1]] and got["tokens"] == sum(w[1] for w in want)
    assert got["steps"] == 4 and got["rows"] == 8 and got["total"] == 4 * gb * SEQ
    every = {("bundled", s[0]) for _, _, _, tags in steps for t in tags for s in t[2]}
    assert dl.scan(every, 0, 4, gb)["empty"] == [0, 1, 2, 3]
    assert dl.scan(docs, gb, 3, gb)["with"][0][0] == 0  # from the second step on: offsets from there
    assert dl.scan(docs, 0, 10, gb, max_rows=6)["steps"] == 3  # capped by rows
    n, digest = dl.document_facts("bundled", 5)
    assert n == len(IndexedCorpus(corpus, SEQ, seed=0).doc_tokens(5)) and dl.document_facts("bundled", 5)[1] == digest
    assert dl.document_facts("other", 5) is None and dl.corpus_share("bundled", n) > 0
    text = loader(tok)
    assert text.scan(docs, 0, 4, gb) is None and text.corpus_share("stdlib_docs", 10) is None
    assert text.document_facts("stdlib_docs", 5)[0] > 0
