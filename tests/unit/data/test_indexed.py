"""titan_ledger.data.indexed: the Megatron .bin/.idx format, integrity at open, the
global row order, and the blend (against Megatron-Core's own rule)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.data import indexed
from titan_ledger.data.indexed import (
    BLEND_RULE,
    Blend,
    CorpusError,
    IndexedCorpus,
    IndexedWriter,
    blending_pattern,
    read_idx,
)


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


def test_token_dtype_rule():
    assert indexed.token_dtype(2048) is np.uint16
    assert indexed.token_dtype(128256) is np.int32


# --------------------------------------------------------------------------- integrity at open
DOCS = [[1, 5, 6, 7, 2], [1, 9, 2], [1, 11, 12, 13, 14, 15, 2], [1, 3, 4, 2]]


def _good(tmp_path, name="c", dtype=np.uint16):
    w = IndexedWriter(tmp_path / name, dtype)
    for d in DOCS:
        w.add(d)
    w.finish()
    return tmp_path / name


def _open(prefix):
    return IndexedCorpus(prefix, seq_len=4, seed=0, shuffle=False)


def _patch(path, offset, fmt, value):
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    path.write_bytes(bytes(raw))


N = len(DOCS)
LENGTHS_AT = indexed.HEADER_BYTES          # int32 x N
POINTERS_AT = LENGTHS_AT + 4 * N           # int64 x N


def _cut(path, n_bytes):
    path.write_bytes(path.read_bytes()[:n_bytes])


@pytest.mark.parametrize("case, message", [
    ("idx_shorter_than_header", r"c\.idx: truncated header \(20 bytes"),
    ("idx_empty", r"c\.idx: truncated header \(0 bytes"),
    ("idx_shorter_than_arrays", r"c\.idx: truncated \(.* announces 4 sequences"),
    ("dtype_code_unknown", r"c\.idx: unknown dtype code 99"),
    ("bin_empty", r"c\.bin: empty file"),
    ("bin_cut_in_half", r"c\.bin: cut: 18 bytes, but its index .*c\.idx needs 38"),
    ("bin_odd_size", r"c\.bin: 37 bytes is not a multiple of the item size 2"),
    ("bin_longer_than_index", r"c\.bin: 40 bytes, but its index .* describes 38 .*different"),
    ("idx_says_int32", r"c\.bin: 38 bytes is not a multiple of the item size 4 \(int32"),
    ("idx_says_int32_bin_40", r"c\.idx: pointers .* not multiples of the item size 4 .*last 30"),
    ("last_length_past_end", r"c\.bin: cut: 38 bytes, but its index .* needs 40 \(document 3 ends"),
    ("last_length_negative", r"c\.idx: document 3 has negative length -4"),
    ("first_pointer_not_zero", r"c\.idx: pointers do not start at 0"),
])
def test_corrupt_corpus_is_refused_at_open_naming_the_file(tmp_path, case, message):
    prefix = _good(tmp_path)
    idx, bin_ = tmp_path / "c.idx", tmp_path / "c.bin"
    assert bin_.stat().st_size == 38  # 19 uint16 tokens
    if case == "idx_shorter_than_header":
        _cut(idx, 20)
    elif case == "idx_empty":
        _cut(idx, 0)
    elif case == "idx_shorter_than_arrays":
        _cut(idx, idx.stat().st_size - 8)
    elif case == "dtype_code_unknown":
        _patch(idx, 17, "<B", 99)
    elif case == "bin_empty":
        _cut(bin_, 0)
    elif case == "bin_cut_in_half":
        _cut(bin_, 18)
    elif case == "bin_odd_size":
        _cut(bin_, 37)
    elif case == "bin_longer_than_index":
        bin_.write_bytes(bin_.read_bytes() + b"\0\0")
    elif case == "idx_says_int32":
        _patch(idx, 17, "<B", 4)  # int32 for uint16 tokens: 19 x 2 bytes
    elif case == "idx_says_int32_bin_40":
        _patch(idx, 17, "<B", 4)  # ... and a .bin of whole int32s: the pointers give it away
        bin_.write_bytes(bin_.read_bytes() + b"\0\0")
    elif case == "last_length_past_end":
        _patch(idx, LENGTHS_AT + 4 * (N - 1), "<i", 5)
    elif case == "last_length_negative":
        _patch(idx, LENGTHS_AT + 4 * (N - 1), "<i", -4)
    elif case == "first_pointer_not_zero":
        _patch(idx, POINTERS_AT, "<q", 2)
    with pytest.raises(CorpusError, match=message) as e:
        _open(prefix)
    assert "\n" not in str(e.value)


def test_an_intact_corpus_opens_and_a_negative_length_inside_is_found_before_training(tmp_path):
    prefix = _good(tmp_path)
    c = _open(prefix)  # the fixtures above start from a valid corpus
    assert [c.doc_tokens(i).tolist() for i in range(N)] == DOCS
    # a negative length in the middle is invisible to the O(1) checks: the index build
    # (one pass over every length) and the document read find it, naming the document
    _patch(tmp_path / "c.idx", LENGTHS_AT + 4 * 1, "<i", -3)
    bad = _open(prefix)
    with pytest.raises(CorpusError, match=r"c\.idx: document 1 has negative length -3"):
        bad.pieces(0)
    with pytest.raises(CorpusError, match=r"c\.idx: document 1 \(length -3, pointer 10\) does not fit"):
        bad.doc_tokens(1)
    # a pointer past the end of the .bin is caught where the document is read
    _patch(tmp_path / "c.idx", LENGTHS_AT + 4 * 1, "<i", 3)
    _patch(tmp_path / "c.idx", POINTERS_AT + 8 * 1, "<q", 1000)
    with pytest.raises(CorpusError, match=r"document 1 \(length 3, pointer 1000\) does not fit"):
        _open(prefix).doc_tokens(1)


def test_the_checks_are_constant_time(tmp_path, monkeypatch):
    """Opening reads the header, the sizes and the last entries, not the arrays."""
    prefix = _good(tmp_path)
    seen = []
    real = indexed.check_bin

    def spy(prefix_, hdr, lengths, pointers):
        class Probe:
            def __init__(self, a):
                self.a = a

            def __getitem__(self, i):
                seen.append(i)
                assert isinstance(i, int), "check_bin must index single entries"
                return self.a[i]

        return real(prefix_, hdr, Probe(lengths), Probe(pointers))

    monkeypatch.setattr(indexed, "check_bin", spy)
    _open(prefix)
    assert sorted(set(seen)) == [0, N - 1]


# --------------------------------------------------------------------------- row order
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


# --------------------------------------------------------------------------- the blend
def megatron_build_blending_indices(weights, size):
    """Megatron-Core, megatron/core/datasets/helpers.cpp, ``build_blending_indices``
    (NVIDIA/Megatron-LM), transcribed line by line to Python (Python floats are the
    C++ doubles): returns (dataset_index, dataset_sample_index)."""
    num_datasets = len(weights)
    dataset_index = [0] * size
    dataset_sample_index = [0] * size
    current_samples = [0] * num_datasets
    for sample_idx in range(size):
        sample_idx_double = max(float(sample_idx), 1.0)
        max_error_index = 0
        max_error = weights[0] * sample_idx_double - float(current_samples[0])
        for dataset_idx in range(1, num_datasets):
            error = weights[dataset_idx] * sample_idx_double - float(current_samples[dataset_idx])
            if error > max_error:
                max_error = error
                max_error_index = dataset_idx
        dataset_index[sample_idx] = max_error_index
        dataset_sample_index[sample_idx] = current_samples[max_error_index]
        current_samples[max_error_index] += 1
    return dataset_index, dataset_sample_index


def megatron_normalize(weights):
    """megatron/core/datasets/utils.py ``normalize``."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def test_megatron_transcription_on_a_hand_worked_case():
    # 0.7/0.3 by hand: errors at j=4 (x=4, counts 3/1) are -0.2 and 0.2 -> dataset 1
    idx, within = megatron_build_blending_indices([0.7, 0.3], 10)
    assert idx == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert within == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [3.0, 1.0], [1, 1], [0.5, 0.3, 0.2],
                                     [1, 2, 3, 4, 5], [0.001, 0.999], [1 / 3, 1 / 3, 1 / 3]])
def test_blend_pattern_is_megatron_build_blending_indices(weights):
    w = megatron_normalize(weights)
    ref_idx, ref_within = megatron_build_blending_indices(w, indexed.BLEND_BLOCK)
    idx, within = blending_pattern(np.asarray(weights, np.float64) / np.sum(weights),
                                   indexed.BLEND_BLOCK)
    assert idx.tolist() == ref_idx and within.tolist() == ref_within


def test_the_former_rule_is_not_megatrons():
    # the rule before BLEND_RULE 2 (w*(j+1) - count) differs from sample 4 on
    old, _ = blending_pattern([0.7, 0.3], 10, rule=1)
    ref, _ = megatron_build_blending_indices([0.7, 0.3], 10)
    assert old.tolist()[:4] == ref[:4] and old[4] == 0 and ref[4] == 1


def test_blend_is_megatron_per_block_and_constant_time(tmp_path):
    corpora = [_corpus(tmp_path, n, 60, rng_seed=s) for s, n in enumerate("abc")]
    weights = [0.5, 0.3, 0.2]
    blend = Blend(corpora, weights)
    assert blend.rule == BLEND_RULE == 2
    B = blend.block
    ref_idx, ref_within = megatron_build_blending_indices(megatron_normalize(weights), B)
    per_block = np.bincount(ref_idx, minlength=3)
    for b in (0, 1, 7, 10 ** 9):  # block b: block 0 shifted by b x each corpus' count per block
        for j in list(range(50)) + list(range(B - 50, B)):
            corpus, k = blend.locate(b * B + j)
            assert corpus is corpora[ref_idx[j]]
            assert k == b * per_block[ref_idx[j]] + ref_within[j]
    # the first block is exactly Megatron's indices for a run of `block` samples
    got = [blend.locate(i) for i in range(B)]
    assert [corpora.index(c) for c, _ in got] == ref_idx and [k for _, k in got] == ref_within
    # every sample of each corpus is used once, in order
    ks = [blend.locate(i) for i in range(2 * B)]
    for c in corpora:
        assert [k for cc, k in ks if cc is c] == list(range(sum(cc is c for cc, _ in ks)))
    assert blend.tag(10 ** 12).source == blend.locate(10 ** 12)[0].name
    with pytest.raises(CorpusError, match="--dataloader.weights"):
        Blend(corpora, [1.0])
    with pytest.raises(CorpusError, match="--dataloader.weights must be positive"):
        Blend(corpora, [1.0, 0.0, 1.0])


def test_blend_rule_enters_the_fingerprint_only_when_blending(tmp_path):
    a, b = _corpus(tmp_path, "a", 60), _corpus(tmp_path, "b", 60, rng_seed=1)
    assert Blend([a, b], [0.7, 0.3]).fingerprint() != Blend([a, b], [0.7, 0.3], rule=1).fingerprint()
    assert Blend([a], [1.0]).fingerprint() == Blend([a], [1.0], rule=1).fingerprint()
    assert Blend([a, b], [0.7, 0.3], rule=1).locate(4)[0] is a  # old ledgers still readable
    assert Blend([a, b], [0.7, 0.3]).locate(4)[0] is b


# --------------------------------------------------------------------------- O(1) data-ledger rows
def _derived_ledger(tmp_path, dp=2, mbs=2, accum=2, steps=3, derive=True):
    """Real loaders + the real DataLedgerWriter for ``dp`` ranks of an indexed corpus."""

    from titan_ledger.components.ledger.data_writer import DataLedgerWriter
    from titan_ledger.components.signals.topology import Topology
    from titan_ledger.config_registry import CORPUS_DIR, TOKENIZER_DIR
    from titan_ledger.data.loader import LedgerDataLoader
    from titan_ledger.data.prepare import load_tokenizer, prepare
    from titan_ledger.format import records

    tok = load_tokenizer(TOKENIZER_DIR)
    prefix = str(tmp_path / "corpus" / "bundled")
    if not (tmp_path / "corpus").exists():
        (tmp_path / "corpus").mkdir()
        prepare([str(CORPUS_DIR)], prefix, tokenizer=tok, progress=False)
    led = tmp_path / "ledger"
    led.mkdir(exist_ok=True)
    trained = {}
    for r in range(dp):
        cfg = LedgerDataLoader.Config(source="indexed", paths=[prefix], derive_rows=derive)
        dl = LedgerDataLoader(cfg, dp_world_size=dp, dp_rank=r, tokenizer=tok, seq_len=64,
                              local_batch_size=mbs)
        w = DataLedgerWriter(Topology(world=dp, rank=r, dp_size=dp, dp_rank=r,
                                      dp_rank_of=tuple(range(dp))), dl,
                             global_batch=mbs * dp * accum, skip_lr="freeze", tokenizer="tok")
        w.open(led, records.Header(schema="", run_id="r", seq=1, resumed_from=0, extra={}), [])
        it = iter(dl)
        for step in range(1, steps + 1):
            for _ in range(accum):
                next(it)
            tags = dl.take_tags()
            trained[step, r] = [t.to_json() for t in tags]
            w.record(StepRecord(step=step, start=0.0, tags=tags), doc_loss={"n": 1, "top": [[len(tags) - 1, 0, 3.5, 7]], "bottom": []})
        w.close()
    return led, trained, prefix


def test_derived_rows_are_o1_and_read_back_exactly(tmp_path):
    import json

    from titan_ledger.format.data_reader import DataLedger

    led, trained, _ = _derived_ledger(tmp_path)
    raw = [json.loads(x) for x in (led / "data_dp1.jsonl").read_text().splitlines()[1:]]
    assert all("rows" not in r and len(r["samples"]) == 2 and len(r["digest"]) == 16 for r in raw)
    data = DataLedger(led)
    for (step, r), tags in trained.items():
        assert [t.to_json() for t in data.at(step, r).tags] == tags
        assert list(data.ids_at(step, r)) == [t[0] for t in tags]
    got, _ = data.doc_losses(2)  # doc_loss rows index the derived rows
    assert {g["sample_id"] for g in got} == {trained[2, 0][-1][0], trained[2, 1][-1][0]}


def test_a_changed_corpus_is_caught_by_the_token_hash(tmp_path):
    from titan_ledger.errors import LedgerError
    from titan_ledger.format.data_reader import DataLedger

    led, _, prefix = _derived_ledger(tmp_path, steps=1)
    with open(prefix + ".bin", "r+b") as f:  # same length, other tokens
        data = bytearray(f.read())
        data[::2] = bytes(b ^ 1 for b in data[::2])  # every token's low bit
        f.seek(0)
        f.write(data)
    with pytest.raises(LedgerError, match="changed since the run"):
        [DataLedger(led).at(1, r) for r in (0, 1)]


def test_explicit_rows_stay_readable(tmp_path):
    import json

    from titan_ledger.format.data_reader import DataLedger

    led, trained, _ = _derived_ledger(tmp_path, steps=2, derive=False)
    raw = json.loads((led / "data_dp0.jsonl").read_text().splitlines()[1])
    assert "rows" in raw and "digest" not in raw
    assert [t.to_json() for t in DataLedger(led).at(2, 1).tags] == trained[2, 1]


def test_derived_rows_across_a_dp_change_use_their_segments_layout(tmp_path):
    """Steps 1-2 on 2 DP ranks (mbs 2), resumed at step 3 on 1 rank (mbs 4): each derived
    row is expanded with the layout of the segment that wrote it."""
    from titan_ledger.components.ledger.data_writer import DataLedgerWriter
    from titan_ledger.components.signals.topology import Topology
    from titan_ledger.data.loader import LedgerDataLoader
    from titan_ledger.format import records
    from titan_ledger.format.data_reader import DataLedger

    led, trained, prefix = _derived_ledger(tmp_path, dp=2, mbs=2, accum=1, steps=2)
    from titan_ledger.config_registry import TOKENIZER_DIR
    from titan_ledger.data.prepare import load_tokenizer

    dl = LedgerDataLoader(LedgerDataLoader.Config(source="indexed", paths=[prefix]), dp_world_size=1,
                          dp_rank=0, tokenizer=load_tokenizer(TOKENIZER_DIR), seq_len=64,
                          local_batch_size=4)
    dl._position = 8  # where the 2-rank run stopped (2 steps x 4 rows)
    w = DataLedgerWriter(Topology(world=1, rank=0, dp_size=1, dp_rank=0, dp_rank_of=(0,)), dl,
                         global_batch=4, skip_lr="freeze", tokenizer="tok")
    w.open(led, records.Header(schema="", run_id="r", seq=2, resumed_from=2, extra={}), [])
    it = iter(dl)
    next(it)
    tags = dl.take_tags()
    w.record(StepRecord(step=3, start=0.0, tags=tags))
    w.close()
    data = DataLedger(led)
    assert [t.to_json() for t in data.at(3, 0).tags] == [t.to_json() for t in tags]
    assert [t.sample_id for t in tags] == [8, 9, 10, 11]
    for (step, r), want in trained.items():
        assert [t.to_json() for t in data.at(step, r).tags] == want
