"""titan_ledger.data.hf: the Hugging Face ``datasets`` source (map-style and streaming).

Small local shards made here (2 parquet files, 2 jsonl files); ``HF_DATASETS_OFFLINE=1``.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from titan_ledger.config_registry import TOKENIZER_DIR
from titan_ledger.data.hf import HFStream, HFStreaming, doc_id, split_id
from titan_ledger.data.loader import DataStateError, LedgerDataLoader
from titan_ledger.data.prepare import load_tokenizer
from titan_ledger.data.text import Cursor
from titan_ledger.errors import ConfigError

SEQ = 32
ROWS = (13, 8)  # documents per file


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


def _docs(f: int, n: int) -> list[str]:
    return [f"file {f} row {r}: " + " ".join(f"w{f}{r}{i}" for i in range(3 + (7 * r + f) % 11))
            for r in range(n)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("shards")
    (root / "pq").mkdir()
    (root / "js").mkdir()
    for f, n in enumerate(ROWS):
        pq.write_table(pa.table({"text": _docs(f, n), "id": list(range(n))}),
                       root / "pq" / f"part-{f}.parquet", row_group_size=4)
        with open(root / "js" / f"part-{f}.jsonl", "w") as fh:
            for t in _docs(f, n):
                fh.write(json.dumps({"content": t}) + "\n")
    return root


def _check_rows(rows, tok):
    """Every segment's tokens are its document's (file, row) tokens at its span."""
    for segs, _, inputs, labels in rows:
        o = 0
        for s in segs:
            f, r = split_id(s.doc)
            toks = tok.encode(_docs(f, ROWS[f])[r], add_bos=True, add_eos=True)
            assert inputs[o:o + len(s)] == toks[s.start:s.end]
            assert labels[o:o + len(s)] == toks[s.start + 1:s.end + 1]
            o += len(s)
        assert o == SEQ


def test_doc_ids_are_file_and_row():
    assert doc_id(0, 5) == 5 and split_id(doc_id(1, 7)) == (1, 7)


@pytest.mark.parametrize("kind", ["pq", "js"])
def test_map_style_rows_name_file_and_row(tok, shards, kind):
    key = "text" if kind == "pq" else "content"
    s = HFStream("", [str(shards / kind)], "", "train", key, tok, SEQ, 0, 1, seed=0)
    rows = list(itertools.islice(s.rows(Cursor()), 40))
    _check_rows(rows, tok)
    first = []
    for segs, cur, _, _ in rows:
        first += [x.doc for x in segs if x.doc not in first]
        if cur.epoch:
            break
    # epoch 0: file 0's rows in order, then file 1's (ids: file << 40 | row)
    assert first[:sum(ROWS)] == [doc_id(0, r) for r in range(13)] + [doc_id(1, r) for r in range(8)]


def test_streaming_equals_map_style_at_one_rank_and_resumes_mid_file(tok, shards):
    ref = list(itertools.islice(
        HFStream("", [str(shards / "pq")], "", "train", "text", tok, SEQ, 0, 1, 0).rows(Cursor()), 25))
    st = HFStreaming("", [str(shards / "pq")], "", "train", "text", tok, SEQ, 0, 1, 0)
    got = list(itertools.islice(st.rows(Cursor()), 25))
    assert [r[0] for r in got] == [r[0] for r in ref] and [r[2] for r in got] == [r[2] for r in ref]
    # resume from every cursor: the same continuation; opened mid-file without re-reading
    for k in (0, 3, 9, 17):
        st2 = HFStreaming("", [str(shards / "pq")], "", "train", "text", tok, SEQ, 0, 1, 0)
        again = list(itertools.islice(st2.rows(Cursor.from_json(got[k][1].to_json())), 5))
        assert [r[0] for r in again] == [r[0] for r in got[k + 1:k + 6]]
        assert [r[2] for r in again] == [r[2] for r in got[k + 1:k + 6]]
        f, row = split_id(got[k][1].index)
        assert st2.rows_skipped == row  # opened at its file, rows skipped unread by the tokenizer
    assert any(split_id(got[k][1].index)[1] > 0 for k in (3, 9, 17))


def test_streaming_ranks_split_rows_and_cross_epochs(tok, shards):
    seen = {}
    for rank in (0, 1):
        st = HFStreaming("", [str(shards / "js")], "", "train", "content", tok, SEQ, rank, 2, 0)
        rows = list(itertools.islice(st.rows(Cursor()), 30))  # > one epoch
        _check_rows(rows, tok)
        seen[rank] = {seg.doc for r in rows for seg in r[0]}
        assert all(split_id(d)[1] % 2 == rank for d in seen[rank])
        assert max(r[1].epoch for r in rows) >= 1
    assert len(seen[0] | seen[1]) == sum(ROWS)


def _loader(tok, shards, dp=1, rank=0, mbs=2, workers=0, **kw):
    kw.setdefault("data_files", [str(shards / "pq")])
    cfg = LedgerDataLoader.Config(source="hf", num_workers=workers, **kw)
    return LedgerDataLoader(cfg, dp_world_size=dp, dp_rank=rank, tokenizer=tok, seq_len=SEQ,
                            local_batch_size=mbs)


def _take(dl, n):
    out = []
    for inputs, labels in itertools.islice(iter(dl), n):
        out.append((inputs["input"].clone(), labels.clone(), [t.to_json() for t in dl.take_tags()]))
    return out


@pytest.mark.parametrize("streaming", [False, True])
def test_loader_resume_skip_and_dp_change(tok, shards, streaming):
    ref = _take(_loader(tok, shards, dp=2, rank=1, streaming=streaming), 9)
    assert all(t[1] == "pq" for b in ref for t in b[2])
    dl = _loader(tok, shards, dp=2, rank=1, streaming=streaming)
    _take(dl, 4)
    state = dl.state_dict()  # (what a checkpoint holds; the rest is discarded as on kill -9)
    new = _loader(tok, shards, dp=2, rank=1, streaming=streaming)
    new.load_state_dict(state)
    got = _take(new, 5)
    for a, b in zip(got, ref[4:]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    # skip == consume
    sk = _loader(tok, shards, dp=2, rank=1, streaming=streaming)
    info = sk.skip(3)
    assert [t.to_json() for t in info.tags] == [t for b in ref[:3] for t in b[2]]
    assert torch.equal(_take(sk, 1)[0][0], ref[3][0])
    # workers give the same batches
    w = _take(_loader(tok, shards, dp=2, rank=1, workers=2, streaming=streaming), 5)
    assert all(torch.equal(a[0], b[0]) and a[2] == b[2] for a, b in zip(w, ref))
    other = _loader(tok, shards, dp=1, rank=0, streaming=streaming)
    with pytest.raises(DataStateError, match="per DP rank"):
        other.load_state_dict(state)


def test_fingerprint_follows_the_files(tok, shards):
    a = _loader(tok, shards).fingerprint
    assert a == _loader(tok, shards).fingerprint
    assert a != _loader(tok, shards, data_files=[str(shards / "pq" / "part-0.parquet")]).fingerprint
    assert a != _loader(tok, shards, streaming=True).fingerprint


@pytest.mark.parametrize("kw,flag", [
    ({"source": "hf"}, "data_files"),
    ({"source": "text", "streaming": True}, "streaming"),
    ({"source": "hf", "data_files": ["x.parquet"], "paths": ["a/b"]}, "paths"),
])
def test_config_errors_name_the_flag(kw, flag):
    with pytest.raises(ConfigError, match=f"--dataloader.{flag}"):
        LedgerDataLoader.Config(**kw)


def test_missing_files_and_text_key_are_one_line_errors(tok, shards):
    with pytest.raises(ConfigError, match="no such file"):
        _loader(tok, shards, data_files=[str(shards / "nope*.parquet")])
    from titan_ledger.errors import CorpusError
    with pytest.raises(CorpusError, match="text_key 'body'"):
        _take(_loader(tok, shards, text_key="body"), 1)


def test_any_base_config_takes_a_ledger_source():
    from titan_ledger.config.toml_frontend import parse, read_job

    c = parse(read_job(["--module", "torchtitan.models.llama3", "--config", "llama3_debugmodel",
                        "--dataloader.source", "hf", "--dataloader.data_files", "a.parquet,b.parquet",
                        "--dataloader.streaming"]))
    assert isinstance(c.dataloader, LedgerDataLoader.Config)
    assert c.dataloader.data_files == ["a.parquet", "b.parquet"] and c.dataloader.streaming


def test_a_recipe_switches_to_hf_from_the_command_line():
    from helpers import CONFIGS

    from titan_ledger.config.toml_frontend import parse, read_job

    c = parse(read_job(["--job.config_file", str(CONFIGS / "llama3_8b.toml"), "--dataloader.source",
                        "hf", "--dataloader.data_files", "x.parquet", "--dataloader.paths", ""]))
    assert c.dataloader.source == "hf" and c.dataloader.paths == [] and c.dataloader.data_files


def test_document_text_from_the_ledger_spec(tok, shards):
    from titan_ledger.data.hf import document_text

    dl = _loader(tok, shards, streaming=True)
    assert dl.spec["dataset"] == "hf:pq"
    assert document_text(dl.spec, doc_id(1, 5)) == _docs(1, ROWS[1])[5]
