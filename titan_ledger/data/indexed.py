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

Integrity: opening a corpus (training, ``lookup``, ``prepare``'s readers all open
through ``IndexedCorpus``) checks in constant time that the .idx holds its header
and the arrays it announces, that the dtype code is Megatron's, and that the .bin
is non-empty, a whole number of items and exactly as long as the last pointer
plus the last length say (``check_bin``); a negative length elsewhere is found by
the index build (one pass over the lengths) or when its document is read. Each
failure is a one-line ``CorpusError`` naming the file.

Blends: ``Blend`` reproduces Megatron-Core's ``build_blending_indices`` within a
repeating block of 4096 samples (see its docstring for what matches exactly).
"""

from __future__ import annotations

import array
import hashlib
import os
import shutil
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


from titan_ledger.errors import CorpusError  # noqa: E402  (one error hierarchy)


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


#: Bytes of the .idx header: magic (9), version (8), dtype code (1), two counts (8 + 8).
HEADER_BYTES = 9 + 8 + 1 + 8 + 8


def read_idx(path: str | os.PathLike):
    """Parse a Megatron .idx: returns (header, lengths i32, pointers i64, doc_indices i64),
    the arrays memory-mapped. Checks (constant time) that the header is whole and the
    file holds the arrays it announces; raises ``CorpusError`` naming the file."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: no such index file; write it with "
                          f"`python -m titan_ledger.prepare --output-prefix {path.with_suffix('')}`")
    size = path.stat().st_size
    redo = f"; re-run `python -m titan_ledger.prepare --output-prefix {path.with_suffix('')}`"
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[:len(MAGIC)] != MAGIC[:len(head)]:  # (a shorter file: as much as it has)
        raise CorpusError(f"{path}: not a Megatron .idx file (magic {head[:9]!r}, "
                          f"expected {MAGIC!r})")
    if size < HEADER_BYTES:
        raise CorpusError(f"{path}: truncated header ({size} bytes, a Megatron .idx header has "
                          f"{HEADER_BYTES}){redo}")
    (version,) = struct.unpack_from("<Q", head, 9)
    if version != VERSION:
        raise CorpusError(f"{path}: .idx version {version}; only version {VERSION} is supported")
    (code,) = struct.unpack_from("<B", head, 17)
    if code not in DTYPE_CODES:
        raise CorpusError(f"{path}: unknown dtype code {code} (Megatron's codes are "
                          f"{sorted(DTYPE_CODES)}): not a Megatron .idx or a damaged one{redo}")
    n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
    offset = HEADER_BYTES
    expect = offset + n_seq * 4 + n_seq * 8 + n_doc * 8
    if size < expect:
        raise CorpusError(f"{path}: truncated ({size} bytes, its header announces {n_seq} "
                          f"sequences and {n_doc} document indices: {expect} bytes){redo}")
    hdr = IdxHeader(np.dtype(DTYPE_CODES[code]), n_seq, n_doc, offset)
    if expect == offset:  # no arrays (np.memmap cannot map nothing)
        empty = np.zeros(0, dtype="<i8")
        return hdr, np.zeros(0, dtype="<i4"), empty, empty
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=offset)
    pointers = np.frombuffer(buf, dtype="<i8", count=n_seq, offset=offset + 4 * n_seq)
    docs = np.frombuffer(buf, dtype="<i8", count=n_doc, offset=offset + 12 * n_seq)
    return hdr, lengths, pointers, docs


def check_bin(prefix: str | os.PathLike, hdr: IdxHeader, lengths, pointers) -> None:
    """Constant-time consistency of ``PREFIX.bin`` with its index (header, sizes, the
    first and last pointer and the last length); ``CorpusError`` naming the file.

    Megatron stores the documents back to back, so the .bin holds exactly
    ``pointers[-1] + lengths[-1] * itemsize`` bytes. A length < 0 elsewhere in the
    index is found where the index is built (``IndexedCorpus``'s epoch arrays) or a
    document is read (``doc_tokens``), not here: that would read the whole index.
    """
    bin_path = Path(str(prefix) + ".bin")
    idx_path = Path(str(prefix) + ".idx")
    redo = (f"; re-run `python -m titan_ledger.prepare --output-prefix {prefix}` (or copy both "
            f"files again)")
    size = bin_path.stat().st_size
    item = hdr.dtype.itemsize
    if size == 0:
        raise CorpusError(f"{bin_path}: empty file ({hdr.n_sequences} documents in {idx_path})"
                          f"{redo}")
    if size % item:
        raise CorpusError(f"{bin_path}: {size} bytes is not a multiple of the item size {item} "
                          f"({hdr.dtype.name}, from {idx_path}): wrong dtype or a cut file{redo}")
    n = hdr.n_sequences
    if n == 0:
        raise CorpusError(f"{idx_path}: no documents, but {bin_path} has {size} bytes{redo}")
    first, last, last_len = int(pointers[0]), int(pointers[n - 1]), int(lengths[n - 1])
    if first != 0 or last % item or last < 0:
        raise CorpusError(f"{idx_path}: pointers do not start at 0 or are not multiples of the "
                          f"item size {item} (first {first}, last {last}): not written for "
                          f"{hdr.dtype.name} tokens{redo}")
    if last_len < 0:
        raise CorpusError(f"{idx_path}: document {n - 1} has negative length {last_len}{redo}")
    need = last + last_len * item
    if need > size:
        raise CorpusError(f"{bin_path}: cut: {size} bytes, but its index {idx_path} needs {need} "
                          f"(document {n - 1} ends past the end of the file){redo}")
    if need != size:
        raise CorpusError(f"{bin_path}: {size} bytes, but its index {idx_path} describes {need} "
                          f"({n} documents of {hdr.dtype.name}): the .bin and .idx are from "
                          f"different preparations or the item size is wrong{redo}")


def write_idx(path: str | os.PathLike, dtype, lengths, doc_indices=None, *,
              replace: bool = True) -> Path:
    """Write a Megatron .idx for sequences of ``lengths`` tokens stored back to back.

    Written to ``path.tmp`` first; with ``replace`` (default) renamed to ``path``,
    else the temporary path is returned for the caller to rename."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype="<i4")
    pointers = np.zeros(len(lengths), dtype="<i8")
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype("<i8") * dtype.itemsize, out=pointers[1:])
    if doc_indices is None:
        doc_indices = np.arange(len(lengths) + 1, dtype="<i8")
    doc_indices = np.asarray(doc_indices, dtype="<i8")
    tmp = Path(str(path) + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF[dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_indices.tobytes())
        if replace:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Path(path) if replace else tmp


class IndexedWriter:
    """Append documents to ``PREFIX.bin.tmp``; ``finish()`` writes ``PREFIX.idx.tmp``
    and then renames both (``.idx`` last), ``abort()`` removes the temporary files.
    A reader therefore never sees a half-written ``.bin`` or ``.idx``."""

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self._bin_tmp = Path(str(self.prefix) + ".bin.tmp")
        self._idx_tmp = Path(str(self.prefix) + ".idx.tmp")
        self._f = open(self._bin_tmp, "wb")
        self.lengths = array.array("i")  # 4 bytes per document, the only per-document state
        self.tokens = 0

    def add(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._f.write(arr.tobytes())
        self.lengths.append(len(arr))
        self.tokens += len(arr)

    def finish(self) -> None:
        try:
            self._f.close()
            write_idx(str(self.prefix) + ".idx", self.dtype, self.lengths, replace=False)
            os.replace(self._bin_tmp, str(self.prefix) + ".bin")
            os.replace(self._idx_tmp, str(self.prefix) + ".idx")
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Close and remove the temporary files (outputs of an earlier run stay)."""
        self._f.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)


def merge_corpora(prefixes: list[str], out: str | os.PathLike, chunk: int = 1 << 22) -> dict:
    """Megatron's ``merge_datasets``: concatenate corpora into ``out.bin/.idx``.

    Document ``i`` of the result is document ``i - offset`` of the corpus it came from,
    in the order given; ``doc_indices`` are concatenated with offsets as Megatron's
    ``IndexedDatasetBuilder.add_index`` does. Streams the .bin files and the index
    arrays in ``chunk``-element pieces: memory does not grow with the corpus. Written
    as ``.tmp`` and renamed (``.idx`` last). Returns ``{"documents", "tokens", "dtype"}``."""
    heads = []
    for p in prefixes:
        hdr, lengths, pointers, docs = read_idx(str(p) + ".idx")
        check_bin(p, hdr, lengths, pointers)
        heads.append((hdr, lengths, docs))
    dtypes = {h.dtype for h, _, _ in heads}
    if len(dtypes) != 1:
        raise CorpusError(f"cannot merge corpora of different token types "
                          f"({', '.join(sorted(d.name for d in dtypes))}): {prefixes}")
    dtype = dtypes.pop()
    n_seq = sum(h.n_sequences for h, _, _ in heads)
    n_doc = 1 + sum(max(h.n_doc_indices - 1, 0) for h, _, _ in heads)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bin_tmp, idx_tmp = Path(f"{out}.bin.tmp"), Path(f"{out}.idx.tmp")
    tokens = 0
    try:
        with open(bin_tmp, "wb") as fb:
            for p in prefixes:
                with open(f"{p}.bin", "rb") as fi:
                    shutil.copyfileobj(fi, fb, 1 << 24)
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF[dtype]))
            f.write(struct.pack("<QQ", n_seq, n_doc))
            for _, lengths, _ in heads:  # lengths
                for a in range(0, len(lengths), chunk):
                    f.write(np.asarray(lengths[a:a + chunk], dtype="<i4").tobytes())
            ptr = 0  # pointers: byte offsets, running over all corpora
            for _, lengths, _ in heads:
                for a in range(0, len(lengths), chunk):
                    ln = np.asarray(lengths[a:a + chunk], dtype="<i8") * dtype.itemsize
                    pos = np.empty(len(ln), dtype="<i8")
                    pos[0] = ptr
                    np.cumsum(ln[:-1], out=pos[1:])
                    pos[1:] += ptr
                    ptr += int(ln.sum())
                    f.write(pos.tobytes())
            tokens = ptr // dtype.itemsize
            f.write(np.zeros(1, dtype="<i8").tobytes())
            offset = 0  # document indices: Megatron's add_index (offset + doc_idx)[1:]
            for h, lengths, docs in heads:
                for a in range(1, len(docs), chunk):
                    f.write((np.asarray(docs[a:a + chunk], dtype="<i8") + offset).tobytes())
                offset += h.n_sequences
        os.replace(bin_tmp, f"{out}.bin")
        os.replace(idx_tmp, f"{out}.idx")
    except BaseException:
        bin_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
        raise
    return {"documents": n_seq, "tokens": tokens, "dtype": dtype.name}


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


def open_files(prefix: str | os.PathLike):
    """``PREFIX.bin`` and ``PREFIX.idx`` exist and agree (``read_idx`` + ``check_bin``:
    constant time, nothing written); returns ``read_idx``'s (header, lengths, pointers,
    doc_indices). What ``IndexedCorpus`` opens first, and what a launch checks before
    any process group (``titan_ledger.data.inputs.check_inputs``)."""
    prefix = Path(prefix)
    for suffix in (".bin", ".idx"):
        if not Path(str(prefix) + suffix).exists():
            raise CorpusError(
                f"{prefix}{suffix}: missing; prepare the corpus with `python -m "
                f"titan_ledger.prepare --input FILES --output-prefix {prefix}` or fix "
                f"--dataloader.paths")
    hdr, lengths, pointers, doc_indices = read_idx(str(prefix) + ".idx")
    check_bin(prefix, hdr, lengths, pointers)
    return hdr, lengths, pointers, doc_indices


class IndexedCorpus:
    """One Megatron corpus as a global sequence of fixed-length packed rows."""

    def __init__(self, prefix: str | os.PathLike, seq_len: int, seed: int,
                 cache_dir: str | os.PathLike | None = None, name: str | None = None,
                 shuffle: bool = True):
        self.prefix = Path(prefix)
        self.name = name or self.prefix.name
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        hdr, self.lengths, self.pointers, self.doc_indices = open_files(self.prefix)
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
            lengths = self.lengths.astype(np.int64)
            bad = np.flatnonzero(lengths < 0)  # this pass reads every length anyway
            if len(bad):
                raise CorpusError(
                    f"{self.prefix}.idx: document {int(bad[0])} has negative length "
                    f"{int(lengths[bad[0]])} ({len(bad)} such documents): a damaged index; "
                    f"re-run `python -m titan_ledger.prepare --output-prefix {self.prefix}`")
            contrib = np.maximum(lengths - 1, 0)[order]
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
        n, ptr = int(self.lengths[doc]), int(self.pointers[doc])
        p = ptr // self.dtype.itemsize
        if n < 0 or ptr < 0 or p + n > len(self.tokens):
            raise CorpusError(
                f"{self.prefix}.idx: document {doc} (length {n}, pointer {ptr}) does not fit "
                f"{self.prefix}.bin ({len(self.tokens)} tokens): a damaged index; re-run "
                f"`python -m titan_ledger.prepare --output-prefix {self.prefix}`")
        return self.tokens[p:p + n]

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
#: Version of the blending rule, part of a blend's fingerprint (so a run checkpointed
#: under another rule is not resumed silently with another sample order).
#: 1: titan_ledger <= 0.x: ``argmax(w * (j + 1) - counts)`` (not Megatron's).
#: 2: Megatron-Core's ``build_blending_indices`` per block (below).
BLEND_RULE = 2
BLEND_BLOCK = 4096


def blending_pattern(weights, size: int, rule: int = BLEND_RULE) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of the first ``size`` samples of a blend.

    ``rule = 2`` is Megatron-Core's ``build_blending_indices``
    (megatron/core/datasets/helpers.cpp), step for step: for sample ``j`` the
    error of dataset ``k`` is ``weights[k] * max(j, 1.0) - counts[k]`` in float64,
    the dataset with the largest error wins (the first on a tie: Megatron keeps the
    running max with a strict ``>``, like ``np.argmax``), its count is the sample's
    index in that dataset and then grows by one. ``weights`` must be normalised
    to sum 1 the way Megatron's ``normalize`` does (``w / sum(w)`` in float64).
    ``rule = 1`` is the former titan_ledger rule, kept only to read old ledgers.
    """
    w = np.asarray(weights, dtype=np.float64)
    if rule not in (1, 2):
        raise CorpusError(f"unknown blend rule {rule} (this titan_ledger knows 1 and {BLEND_RULE})")
    index = np.zeros(size, dtype=np.int64)
    within = np.zeros(size, dtype=np.int64)
    counts = np.zeros(len(w), dtype=np.int64)
    for j in range(size):
        x = float(j + 1) if rule == 1 else max(float(j), 1.0)
        k = int(np.argmax(w * x - counts))
        index[j], within[j] = k, counts[k]
        counts[k] += 1
    return index, within


class Blend:
    """A deterministic weighted mixture of corpora, O(1) per sample.

    What matches Megatron: within a block of ``block`` (4096) samples, the corpus of
    each sample and its index in that corpus are exactly Megatron-Core's
    ``build_blending_indices(weights, size=block)`` (``blending_pattern``; a unit
    test checks it against a transcription of the C++ loop). So the first 4096
    samples of a run equal Megatron's ``dataset_index`` / ``dataset_sample_index``.

    The one deliberate difference: the pattern restarts every block (block ``b``
    is block 0 with each corpus' indices shifted by ``b`` times its count per
    block), so global sample ``i`` maps to (corpus, index) by arithmetic instead
    of a ``size``-long array built up front; Megatron instead carries its counts
    across the whole run. Shares are therefore exact to 1/``block`` per block.
    Which rule is used (``BLEND_RULE``) enters ``fingerprint()`` when there is
    more than one corpus.
    """

    def __init__(self, corpora: list[IndexedCorpus], weights: list[float],
                 block: int = BLEND_BLOCK, rule: int = BLEND_RULE):
        if len(corpora) != len(weights) or not corpora:
            raise CorpusError("--dataloader.paths and --dataloader.weights must have the same, "
                              "non-zero length")
        if any(not (w > 0) for w in weights):
            raise CorpusError(f"--dataloader.weights must be positive, got {weights}")
        self.corpora = corpora
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / np.sum(w)
        self.rule = int(rule)
        self.block = block if len(corpora) > 1 else 1
        self.pattern, self.within = blending_pattern(self.weights, self.block, self.rule)
        self.counts = np.bincount(self.pattern, minlength=len(corpora)).astype(np.int64)
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
        if len(self.corpora) > 1:  # one corpus: no blending, the order never depended on it
            h.update(f"blend-rule{self.rule}/block{self.block};".encode())
        for c, w in zip(self.corpora, self.weights):
            h.update(f"{c.name}:{c.fingerprint}:{w:.12g}:{c.seed}:{c.shuffle}:{c.seq_len};".encode())
        return h.hexdigest()[:16]
