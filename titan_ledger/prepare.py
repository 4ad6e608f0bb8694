"""``python -m titan_ledger.prepare``: tokenize text into a Megatron .bin/.idx corpus.

Design decision: tokenize offline, once, with the *run's* tokenizer (torchtitan's
``HuggingFaceTokenizer`` loaded from the same ``hf_assets_path``), so a row of the
indexed corpus holds exactly the tokens the text stream would have produced.

EOS/BOS policy: every document is stored as ``BOS + tokens + EOS`` (torchtitan's
``encode(add_bos=True, add_eos=True)``, the text stream's policy); empty texts are
stored too (just BOS EOS) so document ids equal input order. ``--no-bos`` /
``--no-eos`` drop either. Token dtype: uint16 when the vocabulary has fewer than
65500 entries, else int32 (Megatron's rule). Document ``i`` of the corpus is the
``i``-th text read, over the inputs in the order given (files of a folder sorted).

Errors: bad input (a missing or unreadable input, a line that is not JSON, a
missing text key, no documents at all, an ``--output-prefix`` that names a folder)
raises ``CorpusError`` / ``ConfigError`` from the library functions; ``main``
prints ``titan_ledger.prepare: error: ...`` and returns 2. ``--output-prefix`` is
a file prefix (``prep/corpus`` writes ``prep/corpus.bin``, ``.idx``, ``.json``);
``prep/`` or an existing folder is refused. Outputs are written to ``.tmp`` files
and renamed when complete (``.idx`` after ``.bin``, ``.json`` last); a failed or
interrupted prepare removes its ``.tmp`` files and leaves earlier outputs alone.

Examples::

    python -m titan_ledger.prepare --input data/*.jsonl --output-prefix corpora/web
    python -m titan_ledger.prepare --input shard.parquet --text-key content \\
        --output-prefix corpora/code --tokenizer ./assets/hf/Llama-3.1-8B --workers 8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from titan_ledger.data.indexed import IndexedWriter, token_dtype
from titan_ledger.cli import ToolParser
from titan_ledger.errors import ConfigError, CorpusError, TitanLedgerError, fail_line

PROG = "titan_ledger.prepare"

_TOK = None  # per worker process


def default_tokenizer_dir() -> Path:
    return Path(__file__).resolve().parent / "assets" / "tokenizer"


def load_tokenizer(path: str | os.PathLike):
    from titan_ledger import backend

    backend.ensure_installed()
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    if not (Path(path) / "tokenizer.json").exists() and not Path(path).is_file():
        raise ConfigError(f"--tokenizer {path}: no tokenizer.json there; give the run's "
                          f"hf_assets_path (default: the bundled tokenizer)")
    return HuggingFaceTokenizer(tokenizer_path=str(path))


def iter_texts(inputs: list[str], text_key: str) -> Iterator[str]:
    """Texts of JSONL / Parquet files, folders of them, or a ``datasets`` save_to_disk folder."""
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise CorpusError(f"--input {raw}: no such file or folder")
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
            from datasets import load_from_disk

            ds = load_from_disk(str(p))
            if hasattr(ds, "keys"):  # DatasetDict: take "train"
                ds = ds["train"]
            _need_key(text_key, ds.column_names, raw)
            for row in ds:
                yield row[text_key]
            continue
        files = sorted(f for f in p.rglob("*") if f.suffix in (".jsonl", ".json", ".parquet")) \
            if p.is_dir() else [p]
        if not files:
            raise CorpusError(f"--input {raw}: no .jsonl/.json/.parquet files in this folder")
        for f in files:
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq

                try:
                    pf = pq.ParquetFile(f)
                except Exception as e:  # pyarrow's ArrowInvalid, OSError, ...
                    raise CorpusError(f"{f}: not a readable Parquet file ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
                _need_key(text_key, pf.schema_arrow.names, str(f))
                for batch in pf.iter_batches(columns=[text_key]):
                    yield from batch.column(0).to_pylist()
            else:
                with open(f, "rb") as fh:
                    for n, raw_line in enumerate(fh, 1):
                        try:
                            line = raw_line.decode("utf-8")
                        except UnicodeDecodeError:
                            raise CorpusError(f"{f}:{n}: not UTF-8 text; --input takes JSONL, "
                                              f"Parquet or a datasets folder") from None
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise CorpusError(f"{f}:{n}: not JSON ({e.msg})") from None
                        if not isinstance(obj, dict) or text_key not in obj:
                            raise CorpusError(f"{f}:{n}: no {text_key!r} key; set --text-key")
                        text = obj[text_key]
                        if text is not None and not isinstance(text, str):
                            raise CorpusError(f"{f}:{n}: {text_key!r} is a "
                                              f"{type(text).__name__}, not text; set --text-key")
                        yield text


def _need_key(key: str, names, where: str) -> None:
    if key not in names:
        raise CorpusError(f"{where}: no column {key!r} (columns: {list(names)}); set --text-key")


def _chunks(it: Iterator[str], n: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for x in it:
        chunk.append(x or "")
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _init_worker(tokenizer_dir: str) -> None:
    global _TOK
    _TOK = load_tokenizer(tokenizer_dir)


def _encode(tok, texts: list[str], bos: bool, eos: bool) -> list[list[int]]:
    return [tok.encode(t, add_bos=bos, add_eos=eos) for t in texts]


def _encode_in_worker(args) -> list[list[int]]:
    texts, bos, eos = args
    return _encode(_TOK, texts, bos, eos)


def check_prefix(prefix: str | os.PathLike) -> str:
    """``--output-prefix`` must name files, not a folder (``prep/corpus``, not ``prep/``)."""
    raw = os.fspath(prefix)
    if not raw or raw.endswith(("/", os.sep)) or Path(raw).is_dir() or Path(raw).name in (".", ".."):
        raise ConfigError(f"--output-prefix {raw!r}: a folder, not a file prefix; give a prefix "
                          f"like {os.path.join(raw or '.', 'corpus')} (writes corpus.bin, corpus.idx, "
                          f"corpus.json there)")
    return raw


def prepare(inputs: list[str], prefix: str, *, tokenizer=None, tokenizer_dir: str | None = None,
            workers: int = 0, text_key: str = "text", bos: bool = True, eos: bool = True,
            chunk: int = 256, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into ``prefix.bin/.idx`` (+ ``prefix.json`` metadata). Returns the metadata.

    Raises ``CorpusError`` (inputs) or ``ConfigError`` (flags); on any failure no
    ``.tmp`` file is left behind and existing outputs are untouched."""
    prefix = check_prefix(prefix)
    if workers < 0:
        raise ConfigError(f"--workers {workers}: must be >= 0 (0: tokenize in this process)")
    if not inputs:
        raise ConfigError("--input: give at least one JSONL/Parquet file or folder")
    tokenizer_dir = str(tokenizer_dir or default_tokenizer_dir())
    tok = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
    dtype = token_dtype(tok.get_vocab_size())
    start = time.perf_counter()
    writer = IndexedWriter(prefix, dtype)
    meta_tmp = Path(prefix + ".json.tmp")
    bar = None
    pool = None
    try:
        if progress:
            from tqdm import tqdm

            # only on a terminal, and only once it has run a moment: an input refused at
            # once prints its one error line and no bar
            bar = tqdm(unit="tok", unit_scale=True, desc=f"prepare {Path(prefix).name}",
                       file=sys.stderr, disable=None, delay=1.0)
        work = ((c, bos, eos) for c in _chunks(iter_texts(inputs, text_key), chunk))
        if workers > 0:
            pool = mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_dir,))
            results = pool.imap(_encode_in_worker, work, chunksize=1)  # ordered
        else:
            results = (_encode(tok, *w) for w in work)
        for docs in results:
            for d in docs:
                writer.add(d)
            if bar is not None:
                bar.update(sum(len(d) for d in docs))
        if not writer.lengths:
            raise CorpusError(f"--input {' '.join(map(str, inputs))}: no documents (0 texts read); "
                              f"nothing to write to {prefix}.bin/.idx")
        elapsed = time.perf_counter() - start
        meta = {"inputs": [str(i) for i in inputs], "documents": len(writer.lengths),
                "tokens": writer.tokens, "dtype": np.dtype(dtype).name, "bos": bos, "eos": eos,
                "tokenizer": tokenizer_dir if tokenizer is None else "<run tokenizer>",
                "seconds": round(elapsed, 3),
                "tokens_per_s": round(writer.tokens / elapsed) if elapsed > 0 else None}
        meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        writer.finish()  # .bin, then .idx: the corpus appears whole
        os.replace(meta_tmp, prefix + ".json")
    except BaseException:
        if bar is not None:
            bar.leave = False  # clear the bar's line; the error line follows
        writer.abort()
        meta_tmp.unlink(missing_ok=True)
        raise
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(
        prog="python -m titan_ledger.prepare",
        description="Tokenize JSONL / Parquet / HF datasets text into a Megatron .bin/.idx corpus.",
        epilog=__doc__.split("Examples::", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True,
                    help="JSONL/Parquet files, folders of them, or a datasets save_to_disk folder")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer folder (the run's hf_assets_path); default: the bundled tokenizer")
    ap.add_argument("--text-key", default="text", help="JSON key / column holding the text")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)),
                    help="tokenizer processes (0: in this process)")
    ap.add_argument("--no-bos", action="store_true", help="do not prepend BOS to each document")
    ap.add_argument("--no-eos", action="store_true", help="do not append EOS to each document")
    a = ap.parse_args(argv)  # argparse itself exits 2 on a malformed command line
    try:
        meta = prepare(a.input, a.output_prefix, tokenizer_dir=a.tokenizer, workers=a.workers,
                       text_key=a.text_key, bos=not a.no_bos, eos=not a.no_eos)
    except TitanLedgerError as e:
        print(fail_line(PROG, e), file=sys.stderr)
        return e.exit_code
    print(f"wrote {a.output_prefix}.bin/.idx: {meta['documents']} documents, {meta['tokens']} "
          f"tokens, {meta['dtype']}, {meta['seconds']} s ({meta['tokens_per_s']} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
