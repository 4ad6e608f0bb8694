"""Text stream source: HF ``datasets`` documents tokenized on the fly, per DP rank.

Design decision: the state of a stream is a *cursor* -- (epoch, index into the
epoch's document order, token offset into that document) -- at the start of the
next row, i.e. three integers instead of torchtitan's pickled token buffers. The
rows are exactly those of torchtitan 0.3.0's ``HuggingFaceTextDataset`` in the first
epoch (same documents per DP rank, same BOS/EOS, same next-token shift inside a
document, same per-document positions; a test compares them), but every row also
knows which documents and token spans it holds.

A stream has no random access to row ``k`` without tokenizing what precedes it,
so (unlike the indexed corpus) its position is per DP rank and the DP size cannot
change on resume, and skipping walks the documents (tokenizer only: no model,
no batch tensors). Documents are identified by their row index in the dataset,
which needs a map-style dataset; streaming datasets are refused with a pointer
to ``titan_ledger.prepare``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_ledger.data.layout import EpochOrder, pack_rows
from titan_ledger.errors import ConfigError, CorpusError


@dataclass(frozen=True, slots=True)
class Cursor:
    epoch: int = 0
    index: int = 0  # position in the epoch's document order
    offset: int = 0  # input tokens of that document already used

    def to_json(self) -> list[int]:
        return [self.epoch, self.index, self.offset]

    @staticmethod
    def from_json(v) -> Cursor:
        return Cursor(*(int(x) for x in v))


def contiguous_shard(n: int, shards: int, index: int) -> tuple[int, int]:
    """``datasets.Dataset.shard(contiguous=True)``'s bounds (what torchtitan's
    ``split_dataset_by_node`` gives a map-style dataset)."""
    div, mod = divmod(n, shards)
    start = div * index + min(index, mod)
    return start, start + div + (1 if index < mod else 0)


BUNDLED_DATASET = "stdlib_docs"
"""The bundled corpus's name in torchtitan's dataset registry, and so in the data ledger,
``lookup`` and the incident page: CPython standard-library docstrings, one document per
module (``titan_ledger/assets/README.md``)."""

BUNDLED_CORPUS = Path(__file__).resolve().parents[1] / "assets" / "corpus"
"""Its folder of JSONL (``{"id", "source", "text"}`` per line)."""


def _train_split(path: str):
    from datasets import load_dataset

    return load_dataset(path, split="train")


def _text(sample) -> str:
    return sample["text"]


def register_bundled() -> None:
    """Add the bundled corpus to torchtitan's ``DATASETS`` (the registry its text datasets
    and validator read; torchtitan's documented way to add a dataset). Idempotent."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS.setdefault(BUNDLED_DATASET, DatasetConfig(
        path=str(BUNDLED_CORPUS), loader=_train_split, sample_processor=_text))


def locate_dataset(dataset_name: str, dataset_path: str | None):
    """torchtitan's dataset registry (``_validate_dataset``): ``(path, loader, processor)``
    of ``--dataloader.dataset`` read from ``dataset_path`` (default: the registry's path).
    Opens nothing; an unknown name is a ``ConfigError`` naming the flag."""
    from torchtitan.hf_datasets.text_datasets import _validate_dataset

    register_bundled()
    try:
        return _validate_dataset(dataset_name.lower(), dataset_path)
    except ValueError as e:
        raise ConfigError(f"--dataloader.dataset {dataset_name!r}: {e}") from None


def is_local_path(path: str) -> bool:
    """Whether ``load_dataset`` will read ``path`` from disk: it exists, or it cannot be a
    hub id (``name`` or ``org/name``): absolute, ``./``/``~`` relative, or deeper."""
    p = str(path)
    return (Path(p).expanduser().exists() or Path(p).is_absolute()
            or p.startswith((".", "~")) or p.count("/") >= 2 or "\\" in p)


def has_text(path: Path, probe: int = 1 << 16) -> bool:
    """A non-empty file: more than whitespace in its first ``probe`` bytes, or larger than
    ``probe`` (``datasets`` fails on an empty or blank JSON file with no useful message)."""
    if path.stat().st_size > probe:
        return True
    with open(path, "rb") as f:
        return bool(f.read(probe).strip())


def check_local_input(flag: str, path: str, suffixes) -> list[Path]:
    """A local corpus input: the file, or a folder's files with one of ``suffixes``
    (recursive, as ``load_dataset`` and ``prepare`` find them), exists and holds text.
    Returns the data files; raises ``CorpusError`` naming ``flag`` and ``path``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CorpusError(f"{flag} {path}: no such file or folder")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and set(f.suffixes) & set(suffixes))
        if not files:
            raise CorpusError(f"{flag} {path}: no {'/'.join(sorted(suffixes))} files in this folder")
        if not any(has_text(f) for f in files):
            raise CorpusError(f"{flag} {path}: every data file in this folder is empty "
                              f"({', '.join(f.name for f in files[:3])}{' ...' if len(files) > 3 else ''})")
        return files
    if not has_text(p):
        raise CorpusError(f"{flag} {path}: empty file")
    return [p]


class TextStream:
    """The documents of one DP rank as a stream of packed rows."""

    def __init__(self, dataset_name: str, dataset_path: str | None, tokenizer, seq_len: int,
                 dp_rank: int, dp_size: int, seed: int):
        from datasets import Dataset

        path, loader, processor = locate_dataset(dataset_name, dataset_path)
        ds = loader(path)
        if not isinstance(ds, Dataset):
            raise ConfigError(
                f"--dataloader.dataset {dataset_name!r} is a streaming dataset: its documents have "
                f"no stable ids, so rows cannot be tagged or skipped exactly. Tokenize it once with "
                f"`python -m titan_ledger.prepare` and set --dataloader.source indexed")
        self.name = dataset_name
        self.ds = ds
        self.processor = processor
        self.tokenizer = tokenizer
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.lo, self.hi = contiguous_shard(len(ds), dp_size, dp_rank)
        if self.hi <= self.lo:
            raise CorpusError(f"--dataloader.dataset {dataset_name!r} has {len(ds)} documents, "
                              f"fewer than the {dp_size} DP ranks; use a larger dataset or fewer "
                              f"DP ranks")
        self._order = EpochOrder(self.lo, self.hi, self.seed)
        self._cache: tuple[int, list[int]] | None = None

    def describe(self) -> str:
        h = hashlib.sha256(f"{self.name}:{len(self.ds)}:{self.ds._fingerprint}".encode())
        return f"text:{self.name}:{h.hexdigest()[:16]}"

    def order(self, epoch: int) -> np.ndarray:
        """Document ids of this rank in epoch order (epoch 0: dataset order, like torchtitan;
        :class:`~titan_ledger.data.layout.EpochOrder`)."""
        return self._order(epoch)

    def doc_tokens(self, doc: int) -> list[int]:
        if self._cache is not None and self._cache[0] == doc:
            return self._cache[1]
        text = self.processor(self.ds[int(doc)])
        toks = self.tokenizer.encode(text, add_bos=True, add_eos=True)
        self._cache = (doc, toks)
        return toks

    def documents(self, epoch: int, index: int) -> Iterator[tuple[tuple[int, int], int, list[int]]]:
        """``((epoch, index), doc, tokens)`` of this rank's documents from ``index`` of
        ``epoch``'s order on, epoch after epoch (``layout.pack_rows``'s input)."""
        while True:
            order = self.order(epoch)
            if index >= len(order):
                epoch, index = epoch + 1, 0
                continue
            doc = int(order[index])
            yield (epoch, index), doc, self.doc_tokens(doc)
            index += 1

    def rows(self, cursor: Cursor, build=True) -> Iterator[tuple]:
        """Yield ``(segments, cursor_after, inputs, labels)`` from ``cursor`` on
        (``layout.pack_rows``).

        ``build`` is a bool or a function of the row count since ``cursor``; where
        it is false the token lists are not assembled (``inputs`` and ``labels``
        are None): what a skip, or a worker passing another worker's rows, needs.
        """
        yield from pack_rows(self.documents(cursor.epoch, cursor.index), self.seq_len,
                             cursor.offset, build, _after)


def _after(where: tuple[int, int], doc: int, offset: int, done: bool) -> Cursor:
    """The cursor after a row that ends ``offset`` input tokens into the document at
    ``where`` (``done``: all of them, so the next row starts at the next index)."""
    epoch, index = where
    return Cursor(epoch, index + 1, 0) if done else Cursor(epoch, index, offset)
