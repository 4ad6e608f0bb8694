"""Content, not ids: a document's token shingles, how much of it other data holds, and
what trained recently.

Design decision: a conviction asks three questions of content, never of ids (issue 68):
did a copy of it train unmasked in the same step (then masking it explains nothing a mask
of the copy would not), did content like it train before without a flag (then it is not
what made this step abnormal), and is a fetched document a near-copy of a quarantined one.
Dolma, FineWeb and RedPajama compare documents by their token shingles (MinHash over
shingles), never by ids; two runs of one character of different lengths are the same
content, and a 381-``*`` document is the ``*`` runs that trained before it. Here:

* :func:`shingles` -- the distinct hashes of a document's ``k``-token windows (``k`` = 13;
  a document shorter than ``k`` is one shingle), 64-bit, mixed (splitmix64): a set whose
  overlap with another's is their content overlap;
* :func:`covered` -- the share of one shingle set another holds (a near-copy: >= ``NEAR``);
* :class:`ContentMemory` -- a fixed table of step stamps indexed by shingle hash, written
  with every fetched batch's shingles (vectorised, on the host: the batch is there before it
  is moved to the device) and read at a conviction: the share of the suspect's shingles
  stamped by an earlier step that was not flagged, within ``window`` steps. Its size is
  fixed (``slots``); a slot two shingles share keeps the later stamp, so a crowded table
  reads "seen" more often (a look-back that clears more, never one that convicts more).

Pure numpy over token ids: no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

#: shingle width (tokens): a dozen BPE tokens, about ten words of English -- and a few
#: characters of a script the tokenizer splits into bytes (5 tokens made any two Cyrillic texts
#: "near-copies": their byte pairs repeat); a run of one character is one shingle at any width
K = 13
#: a document is a near-copy of another when this share of its shingles is in the other's
NEAR = 0.5
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 in, uint64 out, wrapping)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def window_hashes(tokens, k: int = K) -> np.ndarray:
    """The hash of each ``k``-token window of ``tokens`` (uint64, one per window, repeats
    kept: what :class:`ContentMemory` stamps); a sequence shorter than ``k`` is one window."""
    t = np.asarray(tokens, dtype=np.int64).astype(np.uint64).ravel()
    n = t.size
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    width = min(k, n)
    m = _mix(t)
    h = m[:n - width + 1].copy()
    with np.errstate(over="ignore"):
        for j in range(1, width):  # a polynomial hash of the mixed tokens of each window, then mixed again
            h = h * np.uint64(1_000_003) + m[j:n - width + 1 + j]
    return _mix(h)


def shingles(tokens, k: int = K) -> np.ndarray:
    """The distinct hashes of ``tokens``' ``k``-token windows (sorted uint64); a sequence
    shorter than ``k`` is one shingle; an empty one has none."""
    return np.unique(window_hashes(tokens, k))


def covered(these: np.ndarray, by: np.ndarray) -> float:
    """The share of ``these`` shingles that ``by`` holds (0.0 for an empty ``these``)."""
    if these.size == 0:
        return 0.0
    return float(np.isin(these, by, assume_unique=True).mean())


def segments_of(tokens, tags) -> dict[tuple[str, int], np.ndarray]:
    """Each document's tokens in a microbatch (``tokens`` ``[B, L]``, the rows'
    ``RowTag`` s), joined over its segments: ``{(source, doc): token ids}``."""
    tok = np.asarray(tokens)
    out: dict[tuple[str, int], list] = {}
    for r, tag in enumerate(tags):
        if r >= tok.shape[0]:
            break
        start = 0
        for seg in tag.segments:
            n = len(seg)
            out.setdefault((tag.source, int(seg.doc)), []).append(tok[r, start:start + n])
            start += n
    return {d: np.concatenate(parts) for d, parts in out.items()}


class ContentMemory:
    """What trained recently, by content: a table of ``slots`` slots (a power of two), each
    holding the last two steps that fetched a shingle hashing there (0: none). Two, so that
    the step fetched after a flagged one (a deferred decision is made once the next batch is
    in) does not hide the earlier steps the look-back asks about."""

    def __init__(self, slots: int = 1 << 22, window: int = 1000):
        if slots & (slots - 1) or slots <= 0:
            raise ValueError(f"slots must be a power of two, got {slots}")
        self.table = np.zeros((slots, 2), dtype=np.int32)
        self.mask = np.uint64(slots - 1)
        self.window = int(window)

    def record(self, step: int, hashes: np.ndarray) -> None:
        """``hashes`` (a batch's window hashes, repeats allowed) fetched at ``step``."""
        if not hashes.size:
            return
        idx = (hashes & self.mask).astype(np.int64)
        last = self.table[idx, 0]  # (a repeated slot reads the same value each time: no unique needed)
        moved = last != step  # a slot this step already stamped keeps its previous step
        self.table[idx[moved], 1] = last[moved]
        self.table[idx, 0] = np.int32(step)

    def seen_before(self, hashes: np.ndarray, step: int, flagged: Iterable[int] = ()) -> np.ndarray:
        """Per hash, whether a step before ``step`` (within ``window``) that is not in
        ``flagged`` fetched it (bool array)."""
        if hashes.size == 0:
            return np.zeros(0, dtype=bool)
        stamps = self.table[(hashes & self.mask).astype(np.int64)]
        ok = (stamps > 0) & (stamps < step) & (stamps >= step - self.window)
        bad = np.fromiter(flagged, dtype=np.int64)
        if bad.size:
            ok &= ~np.isin(stamps, bad)
        return ok.any(axis=1)

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)
