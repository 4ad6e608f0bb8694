"""titan_ledger.prepare, in-process: inputs, errors (exit 2, one line, no SystemExit from
the library), atomic outputs and no ``.tmp`` leftovers."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from titan_ledger.config_registry import TOKENIZER_DIR
from titan_ledger.data import prepare as prep
from titan_ledger.data.indexed import IndexedCorpus
from titan_ledger.errors import ConfigError, CorpusError
from titan_ledger.tools import prepare as prep_cli

TEXTS = ["def f():\n    return 1", "", "Return the singleton screen object. " * 20, "x"]


@pytest.fixture(scope="module")
def tok():
    return prep.load_tokenizer(TOKENIZER_DIR)


def _jsonl(path, texts=TEXTS, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return path


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def run(argv, capsys):
    rc = prep_cli.main(argv + ["--workers", "0"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_main_writes_a_corpus_atomically(tmp_path, capsys, tok):
    src = _jsonl(tmp_path / "in.jsonl")
    rc, out, err = run(["--input", str(src), "--output-prefix", str(tmp_path / "out" / "c")], capsys)
    assert rc == 0 and "wrote" in out
    assert _files(tmp_path / "out") == ["c.bin", "c.idx", "c.json"]
    c = IndexedCorpus(tmp_path / "out" / "c", seq_len=4, seed=0, shuffle=False)
    assert [c.doc_tokens(i).tolist() for i in range(c.n_docs)] == \
        [tok.encode(t, add_bos=True, add_eos=True) for t in TEXTS]
    assert json.loads((tmp_path / "out" / "c.json").read_text())["documents"] == 4


@pytest.mark.parametrize("case, message", [
    ("empty_file", r"--input .*empty\.jsonl: no documents \(0 texts read\)"),
    ("blank_lines", r"--input .*empty\.jsonl: no documents"),
    ("missing", r"--input .*nope\.jsonl: no such file or folder"),
    ("empty_folder", r"--input .*emptydir: no \.jsonl/\.json/\.parquet files"),
    ("bad_json", r"bad\.jsonl:3: not JSON"),
    ("no_key", r"bad\.jsonl:1: no 'text' key; set --text-key"),
    ("not_text", r"bad\.jsonl:2: 'text' is a int, not text"),
    ("prefix_slash", r"--output-prefix '.*prep/': a folder, not a file prefix; give a prefix like "
                     r".*prep/corpus"),
    ("prefix_folder", r"--output-prefix '.*prep': a folder, not a file prefix"),
    ("tokenizer", r"--tokenizer .*: no tokenizer.json there"),
    ("workers", r"--workers -1: must be >= 0"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, case, message):
    (tmp_path / "prep").mkdir()
    out = tmp_path / "prep" / "c"
    args = ["--output-prefix", str(out)]
    src = tmp_path / "bad.jsonl"
    if case == "empty_file":
        src = tmp_path / "empty.jsonl"
        src.write_text("")
    elif case == "blank_lines":
        src = tmp_path / "empty.jsonl"
        src.write_text("\n\n  \n")
    elif case == "missing":
        src = tmp_path / "nope.jsonl"
    elif case == "empty_folder":
        src = tmp_path / "emptydir"
        src.mkdir()
    elif case == "bad_json":
        src.write_text('{"text": "a"}\n{"text": "b"}\n{"text": \n')
    elif case == "no_key":
        _jsonl(src, key="content")
    elif case == "not_text":
        src.write_text('{"text": "a"}\n{"text": 7}\n')
    else:
        src = _jsonl(src)
        if case == "prefix_slash":
            args = ["--output-prefix", str(tmp_path / "prep") + "/"]
        elif case == "prefix_folder":
            args = ["--output-prefix", str(tmp_path / "prep")]
        elif case == "tokenizer":
            args += ["--tokenizer", str(tmp_path)]
        elif case == "workers":
            args += ["--workers", "-1"]
    argv = ["--input", str(src)] + args
    if case == "workers":
        rc = prep_cli.main(argv)
        err = capsys.readouterr().err
    else:
        rc, _, err = run(argv, capsys)
    assert rc == 2
    line = err.rstrip("\n").split("\n")[-1]  # (after the progress bar, if it started)
    assert line.startswith("titan_ledger.prepare: error: ") and "\r" not in line, err
    assert re.search(message, line), err
    assert _files(tmp_path / "prep") == []  # no outputs, no .bin.tmp / .idx.tmp / .json.tmp


def test_library_raises_instead_of_exiting(tmp_path, tok):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(CorpusError, match="no documents"):
        prep.prepare([str(tmp_path / "e.jsonl")], str(tmp_path / "c"), tokenizer=tok, progress=False)
    with pytest.raises(ConfigError, match="--output-prefix"):
        prep.prepare([str(tmp_path / "e.jsonl")], str(tmp_path) + "/", tokenizer=tok, progress=False)
    with pytest.raises(ConfigError, match="--tokenizer"):
        prep.load_tokenizer(tmp_path)


def test_a_failed_prepare_keeps_the_previous_outputs_and_leaves_no_tmp(tmp_path, tok, monkeypatch):
    src = _jsonl(tmp_path / "in.jsonl", TEXTS * 300)
    prefix = str(tmp_path / "c")
    prep.prepare([str(src)], prefix, tokenizer=tok, progress=False)
    before = {f: (tmp_path / f).read_bytes() for f in ("c.bin", "c.idx", "c.json")}
    calls = []
    real = prep._encode

    def dies_on_the_third_chunk(*a):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # even an interrupt cleans up
        return real(*a)

    monkeypatch.setattr(prep, "_encode", dies_on_the_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([str(src)], prefix, tokenizer=tok, progress=False, chunk=100)
    assert len(calls) == 3
    assert _files(tmp_path) == ["c.bin", "c.idx", "c.json", "in.jsonl"]
    assert {f: (tmp_path / f).read_bytes() for f in before} == before


def test_reads_jsonl_parquet_and_saved_datasets_alike(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    _jsonl(tmp_path / "a.jsonl")
    pq.write_table(pa.table({"content": TEXTS}), tmp_path / "a.parquet")
    Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    got = []
    for name, src, key in (("j", tmp_path / "a.jsonl", "text"), ("p", tmp_path / "a.parquet", "content"),
                           ("s", tmp_path / "saved", "text")):
        prep.prepare([str(src)], str(tmp_path / name), tokenizer=tok, text_key=key, progress=False)
        c = IndexedCorpus(tmp_path / name, seq_len=4, seed=0, shuffle=False)
        got.append([c.doc_tokens(i).tolist() for i in range(c.n_docs)])
    assert got[0] == got[1] == got[2]
    assert got[0] == [tok.encode(t, add_bos=True, add_eos=True) for t in TEXTS]
    assert got[0][1] == [tok.bos_id, tok.eos_id]  # empty texts keep their document id
    assert c.dtype == np.uint16


# --------------------------------------------------------------------------- at scale
def _many(tmp_path, n_files=5):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n_files):
        _jsonl(src / f"part-{i:02d}.jsonl", [f"file {i} doc {j} " * (1 + (i + j) % 7) for j in range(9)])
    return src


def _corpus_bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_sharded_prepare_and_merge_equal_one_prepare(tmp_path, capsys):
    src = _many(tmp_path)
    one = str(tmp_path / "one" / "c")
    assert run(["--input", str(src), "--output-prefix", one, "--workers", "0"], capsys)[0] == 0
    sharded = str(tmp_path / "sh" / "c")
    for i in range(3):  # the Slurm array: one task per shard, then the merge
        assert run(["--input", str(src), "--output-prefix", sharded, "--num-shards", "3",
                    "--shard", str(i), "--workers", "0"], capsys)[0] == 0
    assert run(["--input", str(src), "--output-prefix", sharded, "--num-shards", "3", "--merge"],
               capsys)[0] == 0
    assert _corpus_bytes(sharded) == _corpus_bytes(one)  # byte for byte, Megatron's layout
    meta = json.loads(open(sharded + ".json").read())
    assert meta["documents"] == 45 and meta["shards"] == 3
    IndexedCorpus(sharded, 16, 0).row(3)  # opens and reads


def test_a_killed_sharded_prepare_keeps_finished_shards(tmp_path, capsys, monkeypatch):
    src = _many(tmp_path)
    out = str(tmp_path / "o" / "c")
    real = prep.prepare
    calls = []

    def dies_on_shard_2(inputs, prefix, **kw):
        calls.append(prefix)
        if prefix.endswith("shard-00002-of-00003"):
            raise KeyboardInterrupt  # (as a kill would: the shard's .tmp files are left or removed)
        return real(inputs, prefix, **kw)

    monkeypatch.setattr(prep, "prepare", dies_on_shard_2)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare_sharded([str(src)], out, 3, workers=0, progress=False)
    open(prep.shard_prefix(out, 2, 3) + ".bin.tmp", "wb").write(b"junk")  # a kill -9 leftover
    monkeypatch.setattr(prep, "prepare", lambda *a, **k: (calls.append(a[1]), real(*a, **k))[1])
    calls.clear()
    meta = prep.prepare_sharded([str(src)], out, 3, workers=0, progress=False)
    assert calls == [prep.shard_prefix(out, 2, 3)]  # shards 0 and 1 kept
    assert meta["documents"] == 45
    one = str(tmp_path / "one" / "c")
    real([str(src)], one, workers=0, progress=False)
    assert _corpus_bytes(out) == _corpus_bytes(one)


def test_merge_names_the_missing_shards(tmp_path):
    src = _many(tmp_path)
    out = str(tmp_path / "o" / "c")
    prep.prepare_sharded([str(src)], out, 3, shard=1, workers=0, progress=False)
    with pytest.raises(CorpusError, match=r"shard\(s\) \[0, 2\] of 3 not prepared"):
        prep.prepare_sharded([str(src)], out, 3, only_merge=True)
    with pytest.raises(ConfigError, match="only 5 input files"):
        prep.prepare_sharded([str(src)], out, 6, workers=0, progress=False)


def test_workers_keep_a_bounded_window_and_the_order(tmp_path):
    src = _many(tmp_path, 3)
    a, b = str(tmp_path / "a" / "c"), str(tmp_path / "b" / "c")
    prep.prepare([str(src)], a, workers=0, progress=False, chunk=2)
    prep.prepare([str(src)], b, workers=2, progress=False, chunk=2)
    assert _corpus_bytes(a) == _corpus_bytes(b)
