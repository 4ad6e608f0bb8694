"""Indexed token corpora: Megatron's .bin/.idx, a global sample order, blends.

Design decision: a corpus is Megatron-LM's ``MMapIndexedDataset`` layout, byte for
byte (files other tools already hold read as-is; files we write are readable by
Megatron). On top of it, a *global* sample order that is a pure function of
(corpus, seq_len, seed): sample ``k`` is fixed by ``k`` alone, so skipping is an
addition, any process can look a sample up offline, and a resumed run may use
another DP size.

Sample construction (same as torchtitan 0.3.0's text dataset, so block-causal
masks and per-document positions behave identically): each document ``d`` of
``n`` tokens contributes inputs ``d[0:n-1]`` and labels ``d[1:n]`` (a label never
crosses into the next document); contributions are concatenated in a seeded
per-epoch document order and cut into rows of ``seq_len``; the rows of an epoch
are visited in a second seeded order. The remainder of an epoch (< seq_len
tokens) is dropped. Epoch ``e`` uses its own permutations, so any number of
epochs is available without precomputing them.

Index arrays (document order, stream offsets, row order) are built once per
epoch, saved as ``.npy`` under a name that encodes every input they depend on
(corpus fingerprint, seed, seq_len, epoch) and memory-mapped on reopen.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_ledger.data.layout import RowTag, Segment, pack_span

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py DType).
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


from titan_ledger.errors import CorpusError  # noqa: E402,F401  (one error hierarchy)


def token_dtype(vocab_size: int) -> type:
    """Megatron's rule: uint16 when the vocabulary fits, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


# --------------------------------------------------------------------------- the file format
@dataclass
class IdxHeader:
    dtype: np.dtype
    n_sequences: int
    n_doc_indices: int
    header_bytes: int  # offset of the lengths array


def read_idx(path: str | os.PathLike):
    """Parse a Megatron .idx: returns (header, lengths i32, pointers i64, doc_indices i64),
    the arrays memory-mapped."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: no such index file; write it with "
                          f"`python -m titan_ledger.prepare --output-prefix {path.with_suffix('')}`")
    with open(path, "rb") as f:
        magic = f.read(9)
        if magic != MAGIC:
            raise CorpusError(f"{path}: not a Megatron .idx file (magic {magic!r}, "
                              f"expected {MAGIC!r})")
        (version,) = struct.unpack("<Q", f.read(8))
        if version != VERSION:
            raise CorpusError(f"{path}: .idx version {version}; only version {VERSION} is supported")
        (code,) = struct.unpack("<B", f.read(1))
        if code not in DTYPE_CODES:
            raise CorpusError(f"{path}: unknown dtype code {code}")
        (n_seq,) = struct.unpack("<Q", f.read(8))
        (n_doc,) = struct.unpack("<Q", f.read(8))
        offset = f.tell()
    expect = offset + n_seq * 4 + n_seq * 8 + n_doc * 8
    size = path.stat().st_size
    if size < expect:
        raise CorpusError(f"{path}: truncated ({size} bytes, header says {expect})")
    hdr = IdxHeader(np.dtype(DTYPE_CODES[code]), n_seq, n_doc, offset)
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=offset)
    pointers = np.frombuffer(buf, dtype="<i8", count=n_seq, offset=offset + 4 * n_seq)
    docs = np.frombuffer(buf, dtype="<i8", count=n_doc, offset=offset + 12 * n_seq)
    return hdr, lengths, pointers, docs


def write_idx(path: str | os.PathLike, dtype, lengths, doc_indices=None) -> None:
    """Write a Megatron .idx for sequences of ``lengths`` tokens stored back to back."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype="<i4")
    pointers = np.zeros(len(lengths), dtype="<i8")
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype("<i8") * dtype.itemsize, out=pointers[1:])
    if doc_indices is None:
        doc_indices = np.arange(len(lengths) + 1, dtype="<i8")
    doc_indices = np.asarray(doc_indices, dtype="<i8")
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_indices)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_indices.tobytes())
    os.replace(tmp, path)


class IndexedWriter:
    """Append documents to ``PREFIX.bin``; ``finish()`` writes ``PREFIX.idx``."""

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self._bin_tmp = Path(str(self.prefix) + ".bin.tmp")
        self._f = open(self._bin_tmp, "wb")
        self.lengths: list[int] = []
        self.tokens = 0

    def add(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._f.write(arr.tobytes())
        self.lengths.append(len(arr))
        self.tokens += len(arr)

    def finish(self) -> None:
        self._f.close()
        os.replace(self._bin_tmp, str(self.prefix) + ".bin")
        write_idx(str(self.prefix) + ".idx", self.dtype, self.lengths)


# --------------------------------------------------------------------------- one corpus
def fingerprint_files(prefix: str | os.PathLike) -> str:
    """Cheap identity of a corpus: basename, file sizes, and the .idx header and
    ends (hashing a multi-GB .idx on every launch would cost seconds)."""
    prefix = Path(prefix)
    h = hashlib.sha256(prefix.name.encode())
    for suffix in (".bin", ".idx"):
        h.update(str(os.path.getsize(str(prefix) + suffix)).encode())
    with open(str(prefix) + ".idx", "rb") as f:
        h.update(f.read(1 << 16))
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - (1 << 16)))
        h.update(f.read())
    return h.hexdigest()[:16]


class IndexedCorpus:
    """One Megatron corpus as a global sequence of fixed-length packed rows."""

    def __init__(self, prefix: str | os.PathLike, seq_len: int, seed: int,
                 cache_dir: str | os.PathLike | None = None, name: str | None = None,
                 shuffle: bool = True):
        self.prefix = Path(prefix)
        self.name = name or self.prefix.name
        for suffix in (".bin", ".idx"):
            if not Path(str(self.prefix) + suffix).exists():
                raise CorpusError(
                    f"{self.prefix}{suffix}: missing; prepare the corpus with `python -m "
                    f"titan_ledger.prepare --input FILES --output-prefix {self.prefix}` or fix "
                    f"--dataloader.paths")
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        hdr, self.lengths, self.pointers, self.doc_indices = read_idx(str(self.prefix) + ".idx")
        self.dtype = hdr.dtype
        self.tokens = np.memmap(str(self.prefix) + ".bin", dtype=self.dtype, mode="r")
        self.fingerprint = fingerprint_files(self.prefix)
        self.cache_dir = Path(cache_dir) if cache_dir else Path(str(self.prefix) + ".cache")
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        total = int(np.maximum(self.lengths.astype(np.int64) - 1, 0).sum())
        self.samples_per_epoch = total // self.seq_len
        if self.samples_per_epoch == 0:
            raise CorpusError(f"{self.prefix}: {total} trainable tokens, fewer than one row of "
                              f"seq_len {self.seq_len}")

    @property
    def n_docs(self) -> int:
        return len(self.lengths)

    def _cache_name(self, epoch: int) -> str:
        mode = f"seed{self.seed}" if self.shuffle else "ordered"
        return f"{self.name}-{self.fingerprint}-{mode}-L{self.seq_len}-e{epoch}"

    def _epoch(self, epoch: int):
        got = self._epochs.get(epoch)
        if got is not None:
            return got
        base = self.cache_dir / self._cache_name(epoch)
        files = [Path(f"{base}.{k}.npy") for k in ("docs", "cum", "rows")]
        if not all(f.exists() for f in files):
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch, 0]).permutation(self.n_docs)
            else:
                order = np.arange(self.n_docs)
            order = order.astype(np.int64)
            contrib = np.maximum(self.lengths.astype(np.int64) - 1, 0)[order]
            cum = np.zeros(self.n_docs + 1, dtype=np.int64)
            np.cumsum(contrib, out=cum[1:])
            rows = (np.random.default_rng([self.seed, epoch, 1]).permutation(self.samples_per_epoch)
                    if self.shuffle else np.arange(self.samples_per_epoch)).astype(np.int64)
            for f, arr in zip(files, (order, cum, rows)):
                # concurrent builders (ranks, workers) write the same bytes; replace is atomic
                tmp = f.with_suffix(f".{os.getpid()}.tmp.npy")
                np.save(tmp, arr)
                os.replace(tmp, f)
        got = tuple(np.load(f, mmap_mode="r") for f in files)
        self._epochs[epoch] = got
        return got

    def pieces(self, k: int) -> list[tuple[int, int, int]]:
        """Row ``k`` as ``[(doc, start, end), ...]`` (offsets into the doc's input tokens)."""
        epoch, j = divmod(int(k), self.samples_per_epoch)
        order, cum, rows = self._epoch(epoch)
        start = int(rows[j]) * self.seq_len
        return [(int(order[i]), a, b) for i, a, b in pack_span(cum, start, self.seq_len)]

    def doc_tokens(self, doc: int) -> np.ndarray:
        p = int(self.pointers[doc]) // self.dtype.itemsize
        return self.tokens[p:p + int(self.lengths[doc])]

    def row(self, k: int):
        """(inputs, labels, positions, segments) of row ``k``; numpy int64 arrays."""
        segs = self.pieces(k)
        inputs = np.empty(self.seq_len, dtype=np.int64)
        labels = np.empty(self.seq_len, dtype=np.int64)
        positions = np.empty(self.seq_len, dtype=np.int64)
        o = 0
        for doc, a, b in segs:
            toks = self.doc_tokens(doc)
            n = b - a
            inputs[o:o + n] = toks[a:b]
            labels[o:o + n] = toks[a + 1:b + 1]
            positions[o:o + n] = np.arange(n)
            o += n
        return inputs, labels, positions, tuple(Segment(d, a, b) for d, a, b in segs)


# --------------------------------------------------------------------------- blends
class Blend:
    """A deterministic weighted mixture of corpora, O(1) per sample.

    Megatron's greedy blending (pick the corpus furthest below its share) is run
    once over a block of ``block`` samples; the pattern repeats every block, so
    global sample ``i`` maps to (corpus, index) by arithmetic. Shares are exact
    to 1/``block``.
    """

    def __init__(self, corpora: list[IndexedCorpus], weights: list[float], block: int = 4096):
        if len(corpora) != len(weights) or not corpora:
            raise CorpusError("--dataloader.paths and --dataloader.weights must have the same, "
                              "non-zero length")
        if any(w <= 0 for w in weights):
            raise CorpusError(f"--dataloader.weights must be positive, got {weights}")
        self.corpora = corpora
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.block = block if len(corpora) > 1 else 1
        pattern = np.zeros(self.block, dtype=np.int64)
        within = np.zeros(self.block, dtype=np.int64)
        counts = np.zeros(len(corpora), dtype=np.int64)
        for j in range(self.block):
            k = int(np.argmax(self.weights * (j + 1) - counts))
            pattern[j], within[j] = k, counts[k]
            counts[k] += 1
        self.pattern, self.within, self.counts = pattern, within, counts
        names = [c.name for c in corpora]
        if len(set(names)) != len(names):
            raise CorpusError(f"corpus names must be distinct, got {names}")

    def locate(self, i: int) -> tuple[IndexedCorpus, int]:
        b, j = divmod(int(i), self.block)
        k = int(self.pattern[j])
        return self.corpora[k], b * int(self.counts[k]) + int(self.within[j])

    def row(self, i: int):
        """(inputs, labels, positions, RowTag) of global sample ``i``."""
        corpus, k = self.locate(i)
        inputs, labels, positions, segs = corpus.row(k)
        return inputs, labels, positions, RowTag(int(i), corpus.name, segs)

    def tag(self, i: int) -> RowTag:
        corpus, k = self.locate(i)
        return RowTag(int(i), corpus.name, tuple(Segment(*p) for p in corpus.pieces(k)))

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for c, w in zip(self.corpora, self.weights):
            h.update(f"{c.name}:{c.fingerprint}:{w:.12g}:{c.seed}:{c.shuffle}:{c.seq_len};".encode())
        return h.hexdigest()[:16]
