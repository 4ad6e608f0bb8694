"""titan_ledger.prepare, in-process: inputs, errors (exit 2, one line, no SystemExit from
the library), atomic outputs and no ``.tmp`` leftovers."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from titan_ledger import prepare as prep
from titan_ledger.config_registry import TOKENIZER_DIR
from titan_ledger.data.indexed import IndexedCorpus
from titan_ledger.errors import ConfigError, CorpusError

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
    rc = prep.main(argv + ["--workers", "0"])
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
        rc = prep.main(argv)
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
