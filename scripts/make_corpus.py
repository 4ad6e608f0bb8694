#!/usr/bin/env python
"""Regenerate the titan_ledger real-text corpus and its BPE tokenizer.

Outputs (paths relative to the repository root):

* ``titan_ledger/assets/corpus/data.jsonl``   one JSON object per line:
  ``{"id": int, "source": str, "text": str}``
* ``titan_ledger/assets/corpus/LICENSE``      provenance + PSF licence text
  (deliberately without an extension: ``datasets.load_dataset(folder)``
  only considers files with data extensions, whereas a ``LICENSE.txt`` next
  to ``data.jsonl`` makes older ``datasets`` releases pick the *text*
  builder and load the licence instead of the corpus)
* ``titan_ledger/assets/tokenizer/tokenizer.json``
* ``titan_ledger/assets/tokenizer/tokenizer_config.json``

Text source: the docstrings of the CPython standard library that ships with
the running interpreter (the directory of the ``os`` module).  Every ``.py``
file is parsed with :mod:`ast` (never imported); one document per module is
the module docstring followed by its class/function docstrings in source
order, each cleaned with :func:`inspect.cleandoc`.  Test packages,
site-packages and documents shorter than ``MIN_DOC_CHARS`` are skipped.

Tokenizer: byte-level BPE (Llama-3 style pre-tokenisation) trained with the
``tokenizers`` library on the corpus, vocab size exactly ``VOCAB_SIZE``
including the special tokens, single-threaded so that the output is
deterministic.

The output depends only on the Python version (stdlib contents) and the
``tokenizers`` version; those used for the committed files are recorded in
``EXPECTED_PYTHON`` / ``EXPECTED_TOKENIZERS``.

Usage (from the repository root)::

    python scripts/make_corpus.py            # (re)write the committed files
    python scripts/make_corpus.py --check    # regenerate into a temp dir and
                                             # fail if anything differs
"""

from __future__ import annotations

import os

# Must be set before ``tokenizers`` is imported (rayon pool / parallel
# iterators): single-threaded training for byte-for-byte reproducibility.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["RAYON_RS_NUM_CPUS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import ast
import filecmp
import inspect
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

CORPUS_REL = Path("titan_ledger/assets/corpus")
TOKENIZER_REL = Path("titan_ledger/assets/tokenizer")
DATA_REL = CORPUS_REL / "data.jsonl"
LICENSE_REL = CORPUS_REL / "LICENSE"
TOKENIZER_JSON_REL = TOKENIZER_REL / "tokenizer.json"
TOKENIZER_CONFIG_REL = TOKENIZER_REL / "tokenizer_config.json"
GENERATED = (DATA_REL, LICENSE_REL, TOKENIZER_JSON_REL, TOKENIZER_CONFIG_REL)

EXPECTED_PYTHON = "3.11.7"
EXPECTED_TOKENIZERS = "0.23.3"

MIN_DOC_CHARS = 200
MAX_DATA_BYTES = 4_500_000  # hard cap on data.jsonl size

# Directory names skipped anywhere below the stdlib root.
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib-dynload"}
)

VOCAB_SIZE = 2048  # llama3 "debugmodel" vocab_size: every id must be < 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2

# Llama-3 pre-tokenisation regex (as in Meta-Llama-3 tokenizer.json).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# --------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------
def stdlib_dir() -> Path:
    return Path(os.path.dirname(os.__file__)).resolve()


def iter_stdlib_files(root: Path) -> list[Path]:
    """All stdlib ``.py`` files (relative, POSIX-sorted), tests excluded."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")
        ]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            if fn.startswith("test_") or fn.endswith("_test.py"):
                continue
            out.append(rel_dir / fn)
    out.sort(key=lambda p: p.as_posix())
    return out


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def module_document(source: bytes) -> str:
    """Module docstring + class/function docstrings, in source order."""
    tree = ast.parse(source)
    docs: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                doc = inspect.cleandoc(doc).strip()
                if doc:
                    docs.append(doc)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return "\n\n".join(docs)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # e.g. lone surrogates from escapes
        return False
    return True


def build_records(root: Path) -> list[dict]:
    records: list[dict] = []
    total = 0
    for rel in iter_stdlib_files(root):
        try:
            text = module_document((root / rel).read_bytes())
        except (SyntaxError, ValueError):
            continue
        if len(text) < MIN_DOC_CHARS or not _encodable(text):
            continue
        rec = {"id": len(records), "source": module_name(rel), "text": text}
        nbytes = len(_jsonl_line(rec))
        if total + nbytes > MAX_DATA_BYTES:
            break  # cap reached (modules are in sorted order)
        records.append(rec)
        total += nbytes
    return records


def _jsonl_line(rec: dict) -> bytes:
    return (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")


def license_text(root: Path, n_docs: int) -> str:
    psf = (root / "LICENSE.txt").read_text(encoding="utf-8")
    header = f"""\
Provenance and licence of data.jsonl
====================================

data.jsonl contains {n_docs} documents made of docstrings extracted (with the
`ast` module, without importing anything) from the Python standard library
source files of CPython {platform.python_version()}, as installed with the
interpreter used to run scripts/make_corpus.py. Only docstrings were taken;
they were cleaned with inspect.cleandoc and joined per module. The "source"
field of each record is the dotted name of the module it came from.

CPython and its standard library are Copyright (c) 2001-2023 Python Software
Foundation; All Rights Reserved (see the history and the copyright notices in
the licence text below). This derived text is distributed under the terms of
the PSF LICENSE AGREEMENT FOR PYTHON {platform.python_version()}, reproduced
verbatim below from the LICENSE.txt file shipped with that interpreter.

The tokenizer in ../tokenizer/ was trained on this text and carries no
additional third-party content.

------------------------------------------------------------------------------

"""
    return header + psf


def write_corpus(out_root: Path, root: Path) -> list[dict]:
    records = build_records(root)
    data_path = out_root / DATA_REL
    data_path.parent.mkdir(parents=True, exist_ok=True)
    with open(data_path, "wb") as f:
        for rec in records:
            f.write(_jsonl_line(rec))
    assert data_path.stat().st_size <= MAX_DATA_BYTES
    (out_root / LICENSE_REL).write_text(
        license_text(root, len(records)), encoding="utf-8", newline="\n"
    )
    return records


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------
def train_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=True, use_regex=False
            ),
        ]
    )
    # No BOS/EOS template: torchtitan's HuggingFaceTokenizer adds them itself
    # via encode(text, add_bos=..., add_eos=...).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"vocab size {tok.get_vocab_size()} != {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def tokenizer_config() -> dict:
    def entry(content: str) -> dict:
        return {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    return {
        "added_tokens_decoder": {str(i): entry(t) for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # BOS/EOS are not added by default; callers (torchtitan's text
        # datasets) request them with encode(text, add_bos=True, add_eos=True).
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer(out_root: Path, texts: list[str]) -> None:
    tok = train_tokenizer(texts)
    tdir = out_root / TOKENIZER_REL
    tdir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tdir / "tokenizer.json"), pretty=True)
    (tdir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8",
        newline="\n",
    )


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------
def _version_warnings() -> list[str]:
    import tokenizers

    warns = []
    if platform.python_version() != EXPECTED_PYTHON:
        warns.append(
            f"running Python {platform.python_version()}, committed files were "
            f"generated with {EXPECTED_PYTHON}: output will differ"
        )
    if tokenizers.__version__ != EXPECTED_TOKENIZERS:
        warns.append(
            f"running tokenizers {tokenizers.__version__}, committed files were "
            f"generated with {EXPECTED_TOKENIZERS}: tokenizer.json may differ"
        )
    return warns


def generate(out_root: Path) -> list[dict]:
    records = write_corpus(out_root, stdlib_dir())
    write_tokenizer(out_root, [r["text"] for r in records])
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temporary directory and exit 1 if the "
        "committed files differ byte-for-byte",
    )
    ap.add_argument(
        "--out-root",
        type=Path,
        default=REPO_ROOT,
        help="root under which titan_ledger/assets/... is written "
        "(default: the repository root)",
    )
    args = ap.parse_args(argv)

    for w in _version_warnings():
        print(f"WARNING: {w}", file=sys.stderr)

    t0 = time.perf_counter()
    if args.check:
        tmp = Path(tempfile.mkdtemp(prefix="make_corpus_check_"))
        try:
            records = generate(tmp)
            bad = []
            for rel in GENERATED:
                committed = args.out_root / rel
                if not committed.exists():
                    bad.append(f"{rel}: missing")
                elif not filecmp.cmp(committed, tmp / rel, shallow=False):
                    bad.append(f"{rel}: differs")
            # Any other file in the corpus folder could change what
            # datasets.load_dataset(folder) picks up.
            corpus_dir = args.out_root / CORPUS_REL
            expected = {DATA_REL.name, LICENSE_REL.name}
            if corpus_dir.is_dir():
                for extra in sorted(set(os.listdir(corpus_dir)) - expected):
                    bad.append(f"{CORPUS_REL / extra}: unexpected file in corpus dir")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        dt = time.perf_counter() - t0
        if bad:
            print("make_corpus --check FAILED:", file=sys.stderr)
            for b in bad:
                print(f"  {b}", file=sys.stderr)
            print("Run `python scripts/make_corpus.py` to regenerate.", file=sys.stderr)
            return 1
        print(f"make_corpus --check OK ({len(records)} docs, {dt:.1f}s)")
        return 0

    records = generate(args.out_root)
    dt = time.perf_counter() - t0
    n_chars = sum(len(r["text"]) for r in records)
    size = (args.out_root / DATA_REL).stat().st_size
    print(
        f"wrote {len(records)} docs, {n_chars} chars, {size} bytes "
        f"-> {DATA_REL}; tokenizer -> {TOKENIZER_REL} ({dt:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
