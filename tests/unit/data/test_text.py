"""titan_ledger.data.text: the text stream (rows, cursors, shards, errors)."""

from __future__ import annotations

import itertools

import pytest

from titan_ledger.config_registry import CORPUS_DIR, TOKENIZER_DIR
from titan_ledger.data.prepare import load_tokenizer
from titan_ledger.data.text import Cursor, TextStream, contiguous_shard
from titan_ledger.errors import ConfigError, CorpusError

SEQ = 64


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


def test_text_rows_equal_torchtitan_hf_dataset(tok):
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    for dp, rank in ((1, 0), (2, 1)):
        ref = HuggingFaceTextDataset("stdlib_docs", str(CORPUS_DIR), tok, seq_len=SEQ, dp_rank=rank,
                                     dp_world_size=dp)
        ours = TextStream("stdlib_docs", str(CORPUS_DIR), tok, SEQ, rank, dp, seed=0).rows(Cursor())
        for (inp, lab), (segs, _, i2, l2) in itertools.islice(zip(ref, ours), 400):
            assert inp["input"].tolist() == i2 and lab.tolist() == l2
            assert inp["positions"].tolist() == [p for s in segs for p in range(len(s))]


def test_contiguous_shard_is_datasets_shard():
    from datasets import Dataset

    ds = Dataset.from_dict({"i": list(range(23))})
    for shards in (1, 2, 5, 23):
        for index in range(shards):
            lo, hi = contiguous_shard(23, shards, index)
            assert list(range(lo, hi)) == ds.shard(shards, index, contiguous=True)["i"]


def test_cursor_resume_and_walk_without_building_give_the_same_rows(tok):
    stream = TextStream("stdlib_docs", str(CORPUS_DIR), tok, SEQ, 0, 2, seed=3)
    ref = list(itertools.islice(stream.rows(Cursor()), 30))
    walked = list(itertools.islice(stream.rows(Cursor(), build=False), 30))
    assert [r[0] for r in walked] == [r[0] for r in ref] and walked[0][2] is None
    cur = Cursor.from_json(ref[9][1].to_json())  # the checkpointed form
    again = list(itertools.islice(stream.rows(cur), 20))
    assert [r[2] for r in again] == [r[2] for r in ref[10:30]]
    # only every other row built: the built ones are unchanged
    half = list(itertools.islice(stream.rows(Cursor(), build=lambda k: k % 2 == 0), 6))
    assert [r[2] for r in half[::2]] == [r[2] for r in ref[:6:2]] and half[1][2] is None


def test_later_epochs_reshuffle_this_ranks_documents(tok):
    stream = TextStream("stdlib_docs", str(CORPUS_DIR), tok, SEQ, 1, 2, seed=3)
    e0, e1 = stream.order(0), stream.order(1)
    assert e0.tolist() == list(range(stream.lo, stream.hi))  # epoch 0: dataset order
    assert sorted(e1.tolist()) == e0.tolist() and e1.tolist() != e0.tolist()
    assert not hasattr(stream, "n_rows_docs")


def test_errors_name_the_flag(tok, tmp_path):
    with pytest.raises(ConfigError, match="--dataloader.dataset 'nope'"):
        TextStream("nope", None, tok, SEQ, 0, 1, seed=0)
    (tmp_path / "one.jsonl").write_text('{"text": "only one document"}\n')
    with pytest.raises(CorpusError, match="--dataloader.dataset 'stdlib_docs' has 1 documents, fewer "
                                          "than the 2 DP ranks"):
        TextStream("stdlib_docs", str(tmp_path), tok, SEQ, 1, 2, seed=0)


def test_bundled_corpus_has_its_own_name_in_the_registry(tok):
    """``stdlib_docs`` names the bundled corpus in torchtitan's registry (no dataset_path),
    in the stream's description and in every row's tag."""
    from torchtitan.hf_datasets.text_datasets import DATASETS, _validate_dataset

    from titan_ledger.data.text import BUNDLED_CORPUS, BUNDLED_DATASET, register_bundled

    register_bundled()
    assert BUNDLED_DATASET == "stdlib_docs" and BUNDLED_CORPUS == CORPUS_DIR
    path, loader, _ = _validate_dataset(BUNDLED_DATASET)
    assert path == str(CORPUS_DIR) and len(loader(path)) == 457
    stream = TextStream(BUNDLED_DATASET, None, tok, SEQ, 0, 1, seed=0)
    assert stream.describe().startswith("text:stdlib_docs:")
    assert "c4_test" in DATASETS  # torchtitan's own entries stay
