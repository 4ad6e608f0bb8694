"""``python -m titan_ledger.prepare``: tokenize JSONL / Parquet / HF datasets text into a Megatron .bin/.idx corpus.

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

At scale: ``--workers N`` tokenizer processes with at most ``2 N`` chunks in flight
(memory bounded by the chunk size, not the corpus: the writer keeps 4 bytes per
document). ``--num-shards S`` splits the input *files* (sorted) into S contiguous
groups, each prepared into ``PREFIX.shard-IIIII-of-SSSSS.bin/.idx/.json`` (a shard
is finished when its ``.json`` exists: a rerun after ``kill -9`` keeps finished
shards and redoes the others), then merged into ``PREFIX`` (``merge_corpora``,
Megatron's ``merge_datasets``: documents in shard order, so the merged corpus equals
an unsharded prepare). ``--shard I`` prepares one shard (a Slurm array task,
``launch/prepare_array.sbatch``), ``--merge`` only merges.

Examples::

    python -m titan_ledger.prepare --input data/*.jsonl --output-prefix corpora/web
    python -m titan_ledger.prepare --input data/ --output-prefix corpora/web --num-shards 64 \\
        --shard $SLURM_ARRAY_TASK_ID --workers 16      # then: --num-shards 64 --merge
    python -m titan_ledger.prepare --input shard.parquet --text-key content \\
        --output-prefix corpora/code --tokenizer ./assets/hf/Llama-3.1-8B --workers 8
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from titan_ledger.data.indexed import IndexedWriter, merge_corpora, token_dtype
from titan_ledger.errors import ConfigError, CorpusError

_TOK = None  # per worker process


def default_tokenizer_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "tokenizer"


def load_tokenizer(path: str | os.PathLike):
    # the one import of data/ above errors (an import-linter exception in pyproject.toml):
    # torchtitan's tokenizer import pulls torchtitan modules that bind the device, and the
    # backend must be chosen before that, or a later training or text-source import in this
    # process cannot install it (lookup --text did exactly that)
    from titan_ledger.rehearsal import backend

    backend.ensure_installed()
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    if not (Path(path) / "tokenizer.json").exists() and not Path(path).is_file():
        raise ConfigError(f"--tokenizer {path}: no tokenizer.json there; give the run's "
                          f"hf_assets_path (default: the bundled tokenizer)")
    return HuggingFaceTokenizer(tokenizer_path=str(path))


def load_decoder(path: str | os.PathLike):
    """The run's tokenizer for decoding only (``tokenizers.Tokenizer``, the object
    torchtitan's ``HuggingFaceTokenizer.decode`` calls): the same text from the same ids,
    without importing torch or torchtitan -- what an offline tool showing a document needs."""
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not f.exists():
        raise ConfigError(f"--tokenizer {path}: no tokenizer.json there; give the run's "
                          f"hf_assets_path (default: the bundled tokenizer)")
    return Tokenizer.from_file(str(f))


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


def _bounded_imap(pool, fn, work, window: int):
    """``pool.imap(fn, work)`` in order, but with at most ``window`` tasks in flight
    (``imap`` would read all of ``work`` ahead: memory would grow with the corpus)."""
    pending: deque = deque()
    for w in work:
        pending.append(pool.apply_async(fn, (w,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def input_files(inputs: list[str]) -> list[str]:
    """The files ``iter_texts`` reads, in its order (for sharding by file)."""
    out = []
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise CorpusError(f"--input {raw}: no such file or folder")
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
            raise ConfigError(f"--input {raw}: a datasets save_to_disk folder cannot be sharded by "
                              f"file; prepare it without --num-shards")
        out += ([str(f) for f in sorted(f for f in p.rglob("*")
                                        if f.suffix in (".jsonl", ".json", ".parquet"))]
                if p.is_dir() else [str(p)])
    return out


def shard_prefix(prefix: str, shard: int, num_shards: int) -> str:
    return f"{prefix}.shard-{shard:05d}-of-{num_shards:05d}"


def prepare_sharded(inputs: list[str], prefix: str, num_shards: int, *, shard: int | None = None,
                    merge: bool = True, only_merge: bool = False, **kw) -> dict:
    """Prepare ``num_shards`` file groups (or only ``shard``) and merge them into ``prefix``.

    Finished shards (their ``.json`` exists) are kept, so a rerun after ``kill -9``
    redoes only the unfinished ones. Returns the merged (or the one shard's) metadata."""
    prefix = check_prefix(prefix)
    if num_shards < 1:
        raise ConfigError(f"--num-shards {num_shards}: must be >= 1")
    if shard is not None and not 0 <= shard < num_shards:
        raise ConfigError(f"--shard {shard}: must be in [0, {num_shards})")
    from titan_ledger.data.text import contiguous_shard

    todo = [] if only_merge else ([shard] if shard is not None else range(num_shards))
    if todo:
        files = input_files(inputs)
        if len(files) < num_shards:
            raise ConfigError(f"--num-shards {num_shards}: only {len(files)} input files; shards "
                              f"are groups of files (use at most {len(files)} shards)")
    meta = None
    for i in todo:
        sp = shard_prefix(prefix, i, num_shards)
        if Path(sp + ".json").exists():
            meta = json.loads(Path(sp + ".json").read_text())
            print(f"titan_ledger.prepare: shard {i} of {num_shards} already prepared ({sp}.json), kept",
                  file=sys.stderr)
            continue
        lo, hi = contiguous_shard(len(files), num_shards, i)
        meta = prepare(files[lo:hi], sp, **kw)
    if shard is not None or not merge:
        return meta
    parts = [shard_prefix(prefix, i, num_shards) for i in range(num_shards)]
    missing = [i for i, p in enumerate(parts) if not Path(p + ".json").exists()]
    if missing:
        raise CorpusError(f"--merge: shard(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} "
                          f"of {num_shards} not prepared (no {parts[missing[0]]}.json); run "
                          f"their --shard tasks first")
    start = time.perf_counter()
    merged = merge_corpora(parts, prefix)
    metas = [json.loads(Path(p + ".json").read_text()) for p in parts]
    meta = {"inputs": [str(i) for i in inputs], **merged, "shards": num_shards,
            "bos": metas[0].get("bos"), "eos": metas[0].get("eos"),
            "tokenizer": metas[0].get("tokenizer"),
            "seconds": round(sum(m.get("seconds") or 0 for m in metas), 3),
            "merge_seconds": round(time.perf_counter() - start, 3)}
    meta["tokens_per_s"] = round(meta["tokens"] / meta["seconds"]) if meta["seconds"] else None
    tmp = Path(prefix + ".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, prefix + ".json")
    return meta


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
            results = _bounded_imap(pool, _encode_in_worker, work, 2 * workers)  # ordered
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
