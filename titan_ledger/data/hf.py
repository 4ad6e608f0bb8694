"""Hugging Face ``datasets`` source: local parquet/json/arrow files and cached hub datasets.

Design decision: a document's id is *where it is stored*, not where a loader met
it: ``doc = file << 40 | row`` (``doc_id``), ``file`` the index of the data file
in the sorted ``data_files`` list (0 for one file or a hub dataset without
``data_files``), ``row`` its row in that file. With one file the id is the dataset
row index. Ids are therefore stable across loaders, DP sizes and map-style vs
streaming, and ``RowTag`` / per-document loss / quarantine use them unchanged.

Two modes, both packed by the text stream's loop (``titan_ledger.data.layout.pack_rows``:
BOS + tokens + EOS per document, next-token shift inside a document, positions
restart per document) and both per DP rank (the position is a per-rank cursor, so
the DP size is fixed on resume, as for ``text``):

- map-style (``streaming = false``, ``HFStream``): each file is a ``datasets.Dataset``
  (memory-mapped arrow); the concatenation of files is split into contiguous DP
  shards like torchtitan's ``split_dataset_by_node``; epochs after the first
  reshuffle with the seed. It *is* a ``TextStream`` with other document ids.
- streaming (``streaming = true``, ``HFStreaming``): each file is an
  ``IterableDataset``; DP rank ``r`` of ``n`` takes rows ``r, r+n, r+2n, ...`` of
  every file, in file order, epoch after epoch (no shuffle: a stream has no random
  access). The cursor is ``Cursor(epoch, index=doc_id of the next document,
  offset)``: (file, row, token offset). Resuming opens that file and skips ``row``
  rows without tokenizing them (``IterableDataset.skip``); the files before it are
  not opened.

``describe()`` (the data fingerprint) hashes the file names and sizes (or the hub
dataset's fingerprint), split, text key and mode: changed files stop a resume
unless ``--ledger.allow_data_change``.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from titan_ledger.data.layout import EpochOrder, pack_rows
from titan_ledger.data.text import (
    Cursor,
    TextStream,
    check_local_input,
    contiguous_shard,
    has_text,
    is_local_path,
)
from titan_ledger.errors import ConfigError, CorpusError

#: bits of a document id that hold the row (a file may hold up to 2**40 rows)
ROW_BITS = 40
ROW_MASK = (1 << ROW_BITS) - 1
#: rows read per batch from a stream (only the text column is kept)
STREAM_BATCH = 256
#: data file suffix -> ``datasets`` packaged builder
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow",
            ".csv": "csv", ".txt": "text"}


def doc_id(file: int, row: int) -> int:
    return (int(file) << ROW_BITS) | int(row)


def split_id(doc: int) -> tuple[int, int]:
    """``doc_id``'s inverse: (file index, row)."""
    return int(doc) >> ROW_BITS, int(doc) & ROW_MASK


def expand_files(data_files: list[str]) -> list[str]:
    """Globs and folders -> a sorted list of files (the file index of a doc id)."""
    out: list[str] = []
    for pattern in data_files:
        p = Path(pattern)
        if p.is_dir():
            hits = sorted(str(f) for f in p.rglob("*") if f.suffix in BUILDERS)
        else:
            hits = sorted(glob.glob(str(pattern), recursive=True)) or []
        if not hits:
            raise ConfigError(f"--dataloader.data_files {pattern!r}: no such file (or no "
                              f"{'/'.join(sorted(BUILDERS))} files in that folder)")
        out.extend(hits)
    if len(set(out)) != len(out):
        raise ConfigError(f"--dataloader.data_files: a file is listed twice ({out})")
    return out


def builder_of(hf_path: str, files: list[str]) -> str:
    """``hf_path`` if given, else the packaged builder the files' suffix names."""
    if hf_path:
        return hf_path
    kinds = {BUILDERS.get(Path(f).suffix) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise ConfigError(f"--dataloader.data_files: mixed or unknown file types "
                          f"{sorted(set(Path(f).suffix for f in files))}; set --dataloader.hf_path "
                          f"(parquet, json, arrow, ...)")
    return kinds.pop()


class _Spec:
    """What ``load_dataset`` is called with, one file at a time."""

    def __init__(self, hf_path: str, data_files: list[str], name: str, split: str, text_key: str):
        self.files = expand_files(data_files) if data_files else []
        self.builder = builder_of(hf_path, self.files)
        if not self.builder:
            raise ConfigError("--dataloader.source hf needs --dataloader.hf_path (a hub dataset "
                              "id or local folder) or --dataloader.data_files")
        self.name, self.split, self.text_key = name or None, split, text_key

    @property
    def n_files(self) -> int:
        return max(1, len(self.files))

    def load(self, f: int, streaming: bool):
        from datasets import load_dataset

        kw = {"data_files": [self.files[f]]} if self.files else {}
        try:
            return load_dataset(self.builder, self.name, split=self.split, streaming=streaming, **kw)
        except Exception as e:  # datasets raises many kinds; one line naming the input
            what = self.files[f] if self.files else self.builder
            raise CorpusError(f"--dataloader.source hf: cannot load {what} (split "
                              f"{self.split!r}): {type(e).__name__}: {e}") from None

    def text(self, sample: dict, where) -> str:
        try:
            return sample[self.text_key]
        except KeyError:
            raise CorpusError(f"--dataloader.text_key {self.text_key!r}: not a column of {where} "
                              f"(columns: {sorted(sample)})") from None

    def source_name(self) -> str:
        if self.files:
            parent = Path(self.files[0]).parent.name
            return parent or Path(self.files[0]).stem
        return self.builder.rstrip("/").split("/")[-1]

    def describe(self, mode: str, extra: str = "") -> str:
        h = hashlib.sha256(f"{self.builder}|{self.name}|{self.split}|{self.text_key}|{mode}|".encode())
        for f in self.files:
            h.update(f"{Path(f).name}:{os.path.getsize(f)};".encode())
        h.update(extra.encode())
        return f"hf:{self.source_name()}:{mode}:{h.hexdigest()[:16]}"


class HFStream(TextStream):
    """Map-style: the text stream's packing and cursor over (file, row) document ids."""

    def __init__(self, hf_path: str, data_files: list[str], name: str, split: str,
                 text_key: str, tokenizer, seq_len: int, dp_rank: int, dp_size: int, seed: int):
        self.spec = _Spec(hf_path, data_files, name, split, text_key)
        from datasets import Dataset

        self.parts = []
        for f in range(self.spec.n_files):
            ds = self.spec.load(f, streaming=False)
            if not isinstance(ds, Dataset):
                raise ConfigError(f"--dataloader.split {split!r}: load_dataset returned "
                                  f"{type(ds).__name__}, not one split")
            self.parts.append(ds)
        self.cum = np.zeros(len(self.parts) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in self.parts], out=self.cum[1:])
        self.name = self.spec.source_name()
        self.tokenizer = tokenizer
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        n = int(self.cum[-1])
        self.lo, self.hi = contiguous_shard(n, dp_size, dp_rank)
        if self.hi <= self.lo:
            raise CorpusError(f"--dataloader.source hf: {n} documents, fewer than the {dp_size} "
                              f"DP ranks; use more data or fewer DP ranks")
        self._order = EpochOrder(self.lo, self.hi, self.seed, ids=self._doc_ids)
        self._cache = None

    def describe(self) -> str:
        extra = "" if self.spec.files else ",".join(d._fingerprint for d in self.parts)
        return self.spec.describe("map", extra)

    def _doc_ids(self, pos: np.ndarray) -> np.ndarray:
        """Global row positions as (file, row) document ids: the text stream's order, as ids."""
        f = np.searchsorted(self.cum, pos, side="right") - 1
        return (f << ROW_BITS) | (pos - self.cum[f])

    def document(self, doc: int) -> str:
        f, row = split_id(doc)
        return self.spec.text(self.parts[f][row], self.spec.files[f] if self.spec.files else "")

    def doc_tokens(self, doc: int) -> list[int]:
        if self._cache is not None and self._cache[0] == doc:
            return self._cache[1]
        toks = self.tokenizer.encode(self.document(doc), add_bos=True, add_eos=True)
        self._cache = (doc, toks)
        return toks


class HFStreaming:
    """Streaming (``IterableDataset``): rows ``r, r+n, ...`` of each file for DP rank r of n."""

    def __init__(self, hf_path: str, data_files: list[str], name: str, split: str,
                 text_key: str, tokenizer, seq_len: int, dp_rank: int, dp_size: int, seed: int):
        self.spec = _Spec(hf_path, data_files, name, split, text_key)
        self.name = self.spec.source_name()
        self.tokenizer = tokenizer
        self.seq_len = int(seq_len)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.seed = int(seed)
        #: rows skipped without tokenizing when a stream is opened mid-file (tests read it)
        self.rows_skipped = 0

    def describe(self) -> str:
        return self.spec.describe("streaming")

    def start(self) -> Cursor:
        return Cursor(0, doc_id(0, self.dp_rank), 0)

    def _docs(self, epoch: int, key: int) -> Iterator[tuple[int, int, str]]:
        """(epoch, doc id, text) of this rank's documents from ``key`` on, forever."""
        f, row = split_id(key)
        idle = 0  # files in a row that gave this rank nothing
        while True:
            if f >= self.spec.n_files:
                epoch, f, row = epoch + 1, 0, self.dp_rank
                continue
            ds = self.spec.load(f, streaming=True)
            if row:
                ds = ds.skip(row)  # no tokenizing; parquet/json rows are only read
                self.rows_skipped += row
            got = False
            where = self.spec.files[f] if self.spec.files else self.spec.builder
            texts = self._texts(ds, where)
            for i, text in enumerate(itertools.islice(texts, 0, None, self.dp_size)):
                got = True
                yield epoch, doc_id(f, row + i * self.dp_size), text
            idle = 0 if got else idle + 1
            if idle > self.spec.n_files:
                raise CorpusError(f"--dataloader.source hf (streaming): no document for DP rank "
                                  f"{self.dp_rank} of {self.dp_size} in any file; use more data or "
                                  f"fewer DP ranks")
            f, row = f + 1, self.dp_rank

    def _texts(self, ds, where) -> Iterator[str]:
        # ds.iter(), not iter(ds): in a DataLoader worker iter(ds) would shard the
        # stream over the workers itself; here every worker walks the whole stream
        # and builds only its own batches (titan_ledger.data.batches.Rows)
        for batch in ds.iter(batch_size=STREAM_BATCH):
            if self.spec.text_key not in batch:
                self.spec.text(batch, where)  # raises, naming the columns
            yield from batch[self.spec.text_key]

    def rows(self, cursor: Cursor, build=True) -> Iterator[tuple]:
        """``(segments, cursor_after, inputs, labels)`` from ``cursor`` on (as ``TextStream``:
        ``layout.pack_rows``)."""
        if cursor == Cursor():
            cursor = self.start()
        docs = ((epoch, doc, self.tokenizer.encode(text, add_bos=True, add_eos=True))
                for epoch, doc, text in self._docs(cursor.epoch, cursor.index))
        yield from pack_rows(docs, self.seq_len, cursor.offset, build, self._after)

    def _after(self, epoch: int, doc: int, offset: int, done: bool) -> Cursor:
        """The cursor after a row that ends ``offset`` input tokens into ``doc`` (``done``:
        all of them, so the next row starts at this rank's next row of the file)."""
        if done:
            f, row = split_id(doc)
            return Cursor(epoch, doc_id(f, row + self.dp_size), 0)
        return Cursor(epoch, doc, offset)


def check_files(cfg) -> list[str]:
    """What an hf source of ``cfg`` (a ``LedgerDataLoader.Config``) reads, checked on disk
    without ``datasets`` or a process group (``LedgerDataLoader.check_inputs``): every
    ``data_files`` entry matches files (as the loader expands them) and none is empty
    (``datasets`` cannot load an empty JSON file); a local ``hf_path`` exists and, with no
    ``data_files``, holds data files. Returns the data files; raises ``ConfigError`` /
    ``CorpusError`` naming the flag and the path."""
    spec = _Spec(cfg.hf_path, list(cfg.data_files), cfg.hf_name, cfg.split, cfg.text_key)
    for f in spec.files:
        if not has_text(Path(f)):
            raise CorpusError(f"--dataloader.data_files {f}: empty file")
    hf_path = cfg.hf_path
    if hf_path and hf_path not in BUILDERS.values() and is_local_path(hf_path):
        if not spec.files:
            check_local_input("--dataloader.hf_path", hf_path, BUILDERS)
        elif not Path(hf_path).expanduser().exists():
            raise CorpusError(f"--dataloader.hf_path {hf_path}: no such file or folder")
    return spec.files


def open_source(cfg, tokenizer, seq_len: int, dp_rank: int, dp_size: int):
    """``HFStream`` or ``HFStreaming`` for a ``LedgerDataLoader.Config`` with source hf."""
    cls = HFStreaming if cfg.streaming else HFStream
    return cls(cfg.hf_path, list(cfg.data_files), cfg.hf_name, cfg.split, cfg.text_key,
               tokenizer, seq_len, dp_rank, dp_size, cfg.seed)


def document_text(spec: dict, doc: int) -> str:
    """The text of document ``doc`` of a run's hf source, from its data-ledger header's
    ``spec["hf"]`` (offline; for ``lookup --text``)."""
    hf = spec["hf"]
    s = _Spec(hf["builder"] if not hf["data_files"] else hf.get("hf_path") or "",
              hf["data_files"], hf.get("hf_name") or "", hf["split"], hf["text_key"])
    f, row = split_id(doc)
    return s.text(s.load(f, streaming=False)[row], s.files[f] if s.files else s.builder)
