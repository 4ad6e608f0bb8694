"""Where every sample goes: global sample ids, skip windows, row provenance.

Design decision: a data position is ONE integer, the number of samples consumed
by training (Megatron's ``consumed_train_samples``), and a sample id is the
position at which the sample is consumed. A "round" is one dataloader batch on
every DP rank (``mbs`` rows each); in the round that starts at position ``P``,
row ``j`` of DP rank ``r`` is sample ``P + r*mbs + j`` (Megatron's layout:
consumed + m*mbs*dp + r*mbs + j). So sample ids are unique, ordered, the same on
every rank, and skipping is an addition. Whether an id's *content* is fixed by
the id alone depends on the source: the indexed corpus maps ids to tokens
globally (so the DP size may change on resume); a text stream reads documents
per DP rank (so it may not).

Pure Python: no torch, no processes; unit-tested directly.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field


# --------------------------------------------------------------------------- ids
def sample_id(position: int, dp_rank: int, mbs: int, row: int) -> int:
    """Id of ``row`` of DP rank ``dp_rank``'s batch in the round starting at ``position``."""
    return position + dp_rank * mbs + row


def round_start(sample: int, dp_rank: int, mbs: int) -> int:
    """The position of the round holding ``sample``, the first row of DP rank
    ``dp_rank``'s batch in it (``sample_id``'s inverse)."""
    return sample - dp_rank * mbs


def round_size(mbs: int, dp_size: int) -> int:
    """Samples one dataloader batch on every DP rank consumes."""
    return mbs * dp_size


# --------------------------------------------------------------------------- provenance
@dataclass(frozen=True, slots=True)
class Segment:
    """Data provenance: one piece of a packed training row, tokens ``[start, end)``
    of document ``doc`` (offsets into the document's input tokens, i.e. its tokens
    without the last one). A ``RowTag`` lists a row's segments in order. (Not a
    ledger-file segment: this is about documents inside a row.)"""

    doc: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class RowTag:
    """Provenance of one training row: its sample id, source and document spans."""

    sample_id: int
    source: str
    segments: tuple[Segment, ...]
    #: 64-bit hash of the row's tokens (``row_digest``), set by the loader for
    #: deterministic sources; not part of the JSON form nor of equality
    digest: int | None = field(default=None, compare=False)

    def to_json(self) -> list:
        """Compact form stored in the data ledger: ``[id, source, [[doc, s, e], ...]]``."""
        return [self.sample_id, self.source, [[s.doc, s.start, s.end] for s in self.segments]]

    @staticmethod
    def from_json(obj: list) -> RowTag:
        sid, src, segs = obj
        return RowTag(int(sid), str(src), tuple(Segment(int(d), int(s), int(e)) for d, s, e in segs))

    def as_dict(self) -> dict:
        return {"sample_id": self.sample_id, "source": self.source,
                "segments": [{"doc": s.doc, "start": s.start, "end": s.end} for s in self.segments]}


def distinct_documents(tags, min_tokens: int = 1) -> int:
    """How many documents a batch's rows hold (``RowTag`` s or their JSON form), counting a
    document once however many rows slice it, and only its segments of at least
    ``min_tokens`` tokens (the per-document loss ranks no shorter segment). The spike
    rules' rank separation needs it: four slices of one long document are one document."""
    docs = set()
    for t in tags:
        if not isinstance(t, RowTag):
            t = RowTag.from_json(t)
        docs.update((t.source, s.doc) for s in t.segments if len(s) >= min_tokens)
    return len(docs)


def row_digest(inputs, labels) -> int:
    """64-bit blake2b of a row's input and label token ids (int64 numpy arrays)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(memoryview(inputs.astype("<i8", copy=False)).cast("B"))
    h.update(memoryview(labels.astype("<i8", copy=False)).cast("B"))
    return int.from_bytes(h.digest(), "little")


def step_digest(row_digests) -> str:
    """One DP rank's step: the 64-bit blake2b of its rows' digests in order (hex)."""
    h = hashlib.blake2b(digest_size=8)
    for d in row_digests:
        h.update(int(d).to_bytes(8, "little"))
    return h.hexdigest()


def positions_of(segments: tuple[Segment, ...] | list[Segment]) -> list[int]:
    """Per-document positions of a packed row: every segment restarts at 0.

    Matches torchtitan 0.3.0's HuggingFaceTextDataset (positions reset at document
    starts and a row's first segment is renormalised to 0), so block-causal masks
    and the CPU attention see the same documents.
    """
    out: list[int] = []
    for s in segments:
        out.extend(range(len(s)))
    return out


# --------------------------------------------------------------------------- packing
# The indexed corpus packs by arithmetic on a global token stream (``pack_span``); the
# streamed sources walk their documents (``pack_rows``); unshuffled at one DP rank, the
# two give the same rows.
def pack_span(cum, start: int, length: int) -> list[tuple[int, int, int]]:
    """Split the stream interval ``[start, start+length)`` into per-document pieces.

    ``cum[i]`` is the stream offset where the i-th document (in stream order)
    starts (``len(cum) == n_docs + 1``; a list or a numpy array). Returns
    ``[(i, doc_offset_start, doc_offset_end), ...]`` in stream order.
    """
    out = []
    i = bisect.bisect_right(cum, start) - 1  # works on lists and numpy arrays
    pos, end = start, start + length
    n = len(cum) - 1
    while pos < end:
        while i < n and cum[i + 1] <= pos:  # skip empty documents
            i += 1
        if i >= n:
            raise IndexError(f"stream interval [{start}, {end}) runs past the last document")
        take = min(int(cum[i + 1]), end) - pos
        off = pos - int(cum[i])
        out.append((i, off, off + take))
        pos += take
        i += 1
    return out


def pack_rows(documents, seq_len: int, offset: int, build, after) -> Iterator[tuple]:
    """THE packing loop of the streamed sources (``text``, ``hf`` map-style and streaming):
    documents, one after the other, cut into rows of ``seq_len`` input tokens.

    ``documents`` yields ``(where, doc, tokens)`` in stream order, starting with the
    document the stream resumes in, of which ``offset`` input tokens are already used:
    ``tokens`` the document's token ids (BOS ... EOS), ``doc`` its id, ``where`` whatever
    the caller needs to say where it is. A document's inputs are ``tokens[:-1]`` and its
    labels ``tokens[1:]`` (the next-token shift stays inside the document); a row takes
    what is left of the current document and goes on with the next one; a document with
    no input token gives no segment. A document is drawn only when a row needs it (never
    one ahead). ``build`` is a bool or a function of the row count; where it is false the
    token lists are not assembled (``inputs`` and ``labels`` are None).

    Yields ``(segments, after(where, doc, offset, done), inputs, labels)`` per row:
    ``where`` and ``doc`` of the row's last document, ``offset`` its input tokens used
    after the row, ``done`` whether that is all of them (the next row starts at the next
    document). ``after`` makes the caller's cursor out of them.
    """
    wants = build if callable(build) else (lambda k, _b=bool(build): _b)
    docs = iter(documents)
    where, doc, toks = next(docs)
    k = -1
    while True:
        k += 1
        b = wants(k)
        segs: list[Segment] = []
        inputs: list[int] = []
        labels: list[int] = []
        need = seq_len
        while need:
            avail = len(toks) - 1 - offset
            if avail <= 0:
                where, doc, toks = next(docs)
                offset = 0
                continue
            take = min(avail, need)
            segs.append(Segment(doc, offset, offset + take))
            if b:
                inputs.extend(toks[offset:offset + take])
                labels.extend(toks[offset + 1:offset + take + 1])
            offset += take
            need -= take
        yield (tuple(segs), after(where, doc, offset, offset >= len(toks) - 1),
               inputs if b else None, labels if b else None)


class EpochOrder:
    """THE epoch order of the streamed sources' documents (``text``, ``hf`` map-style):
    one DP rank's documents ``[lo, hi)``, epoch 0 in stored order (like torchtitan), epoch
    ``e > 0`` permuted by ``numpy.random.default_rng([seed, e])``. ``ids`` maps an array
    of those positions to the source's document ids (default: the positions themselves).
    Calling it with an epoch returns that epoch's ids (int64); one epoch is kept (a
    stream reads its epochs in turn)."""

    def __init__(self, lo: int, hi: int, seed: int, ids=None):
        self.lo, self.hi, self.seed, self.ids = int(lo), int(hi), int(seed), ids
        self._epoch: int | None = None
        self._ids = None

    def __call__(self, epoch: int):
        if self._epoch != epoch:
            import numpy as np  # here, not at the top: the rest of this module is pure Python

            pos = np.arange(self.lo, self.hi, dtype=np.int64)
            if epoch > 0:
                pos = pos[np.random.default_rng([self.seed, epoch]).permutation(len(pos))]
            self._ids = pos if self.ids is None else self.ids(pos)
            self._epoch = epoch
        return self._ids


# --------------------------------------------------------------------------- skip windows
from titan_ledger.errors import SkipError  # noqa: E402  (one error hierarchy)


def parse_skip_steps(entries: list[str] | tuple[str, ...] | str,
                     flag: str = "--ledger.skip.steps") -> list[tuple[int, int]]:
    """``["137000-137300", "140001"]`` (or the comma-separated CLI form) -> sorted,
    merged, inclusive ``(first, last)`` windows of absolute 1-indexed steps (``flag``:
    the flag an error names)."""
    if isinstance(entries, str):
        entries = [entries]
    windows: list[tuple[int, int]] = []
    for entry in entries:
        for part in str(entry).split(","):
            part = part.strip()
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                a = int(lo)
                b = int(hi) if sep else a
            except ValueError:
                raise SkipError(
                    f"{flag}: {part!r} is not a step or an inclusive range; "
                    f'write e.g. "137000-137300" or "140001"') from None
            if a < 1 or b < a:
                raise SkipError(
                    f"{flag}: {part!r} must be absolute 1-indexed steps with "
                    f"first <= last")
            windows.append((a, b))
    windows.sort()
    merged: list[tuple[int, int]] = []
    for a, b in windows:
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def window_at(windows: list[tuple[int, int]], step: int) -> tuple[int, int] | None:
    """The skip window containing ``step``, if any."""
    i = bisect.bisect_right(windows, (step, float("inf"))) - 1
    if i >= 0 and windows[i][0] <= step <= windows[i][1]:
        return windows[i]
    return None
