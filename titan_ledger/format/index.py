"""Random access into an append-only ledger file: a segment index and a bisection by step.

Design decision: a tool costs what its answer needs, not what the run has written. The
JSONL stays the one source of truth (human-readable, torn-line rules of
:mod:`titan_ledger.format.records`); beside each ledger file the writer keeps
``<file>.idx``, one JSON line per *segment* (not per row: a launch or rewind costs one
line, a step none): ``{"offset": byte offset of the segment's header line, "seq": its
seq}``. Within a segment the rows are in increasing step order (a skipped window is one
row, ``step`` .. ``last_step``), so the rows of one step are found by bisecting the
segment's bytes: O(log n) lines read per segment, whatever the run's length. The
supersession rule is not re-implemented here: a point query hands the rows it found
(one per segment) to :func:`records.resolve`, the rule's only owner.

A reader never trusts the index blindly, and never returns a wrong row:

* the writer appends an entry *before* its header (:func:`records.note_segment`), so a crash
  between the two leaves an entry at the end of the file (a segment being opened: no
  rows), never a header without an entry;
* every entry must point at a header line of its ``seq`` (read when the segment is
  used); an entry that does not, an index that is missing, torn or names offsets past
  the file (a folder copied without it, a JSONL restored from elsewhere) is rebuilt
  from the JSONL by one scan of its bytes (headers are the only lines whose object has
  a ``schema`` key; raw newlines never occur inside a JSON line) and written back when
  the folder is writable;
* a header met inside a segment while bisecting (a writer that kept no index appended
  to the file) makes the reader rebuild the index and answer again.

Every byte a point query reads is counted (:attr:`IndexedFile.bytes_read`), so tests
assert the complexity, not a time.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_ledger.errors import LedgerCorrupt, LedgerError, LedgerWarning
from titan_ledger.format import records
from titan_ledger.format.records import index_line, index_path

#: below this many bytes between two bisection bounds, the rest is read line by line
BLOCK = 4 * 1024
_CHUNK = 8 * 1024 * 1024  # the rebuild's read size


@dataclass
class Segment:
    """One segment of one file, located but not read: ``offset`` of its header line,
    ``start`` of its first row, ``end`` (the next header's offset or the file's size)."""

    header: records.Header
    offset: int
    start: int
    end: int
    file_pos: int

    def as_file_segment(self, rows: list[dict[str, Any]] | None = None) -> records.FileSegment:
        return records.FileSegment(self.header, rows or [], self.file_pos)


class _Stale(Exception):
    """The index disagrees with its JSONL: rebuild and answer again."""


class IndexedFile:
    """One ledger file read by offsets: its segments from the index, the rows of a step by
    bisection, a range of steps or a whole segment by streaming."""

    def __init__(self, path: str | os.PathLike, schema: records.Schema, launch_seq: int | None = None):
        self.path = Path(path)
        self.schema = schema
        # the largest seq of the run's launch log: a launch past the index's last segment
        # may have been written by a titan_ledger that kept no index (checked once, below)
        self.launch_seq = launch_seq
        self.bytes_read = 0  # every byte this object read from the JSONL and its index
        self.lines_read = 0
        self.rebuilt = False
        self._segments: list[Segment] | None = None
        self._torn: list[int] | None = None

    # ------------------------------------------------------------------ segments
    @property
    def segments(self) -> list[Segment]:
        if self._segments is None:
            if not self.path.is_file():
                raise LedgerError(f"{self.path}: no such ledger file")
            try:
                self._segments = self._from_index()
            except _Stale:
                self._segments = self._rebuild()
        return self._segments

    def _from_index(self) -> list[Segment]:
        idx = index_path(self.path)
        try:
            raw = idx.read_bytes()
        except OSError:
            raise _Stale from None
        self.bytes_read += len(raw)
        size = self.path.stat().st_size
        entries, checked = [], 0
        lines = raw.split(b"\n")
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                if "checked" in e:
                    checked = max(checked, int(e["checked"]))
                    continue
                entries.append((int(e["offset"]), e.get("seq")))
            except (ValueError, KeyError, TypeError):
                if n == len(lines) - 1:
                    continue  # a torn last entry (no newline): its header was never written
                raise _Stale from None
        # (the first entry is past 0 when the file's first header was torn: that line is no
        # segment; each entry is checked against its header below)
        if not entries or any(b[0] <= a[0] for a, b in zip(entries, entries[1:])):
            raise _Stale
        segs = []
        with open(self.path, "rb") as f:
            for pos, (off, seq) in enumerate(entries):
                if off == size and pos == len(entries) - 1:
                    break  # a segment being opened right now: its header is not written yet
                if off >= size:
                    raise _Stale
                f.seek(off)
                line = f.readline()
                self._count(line)
                hdr = self._header(line, off)
                if hdr is None or hdr.seq != seq:
                    raise _Stale
                segs.append(Segment(hdr, off, off + len(line), 0, pos))
        for a, b in zip(segs, segs[1:]):
            a.end = b.offset
        if segs:
            segs[-1].end = size
        top = max([checked, *(q for _, q in entries if isinstance(q, int))])
        if self.launch_seq is not None and self.launch_seq > top:
            # launches after the last indexed segment: did one append a header without an
            # entry? One scan of the last segment's bytes, then remembered in the index
            if header_offsets(self.path, start=segs[-1].start if segs else 0):
                raise _Stale
            _append_checked(self.path, self.launch_seq)
        return segs

    def _header(self, line: bytes, offset: int) -> records.Header | None:
        # (a header cut before its newline still parses: a header, as ``records`` reads it)
        try:
            obj = records.parse_line(line)
        except records.BAD_LINE:
            return None
        if not isinstance(obj, dict) or "schema" not in obj:
            return None
        records.check_schema(str(obj["schema"]), self.schema, self.path)
        seq = obj.get("seq")
        if not self.schema.row_per_launch and (not isinstance(seq, int) or isinstance(seq, bool)):
            raise LedgerCorrupt(f"{self.path}: the segment header at byte {offset} has no integer "
                                f"'seq' (was the file edited?); restore the file from the run's dump folder")
        return records.Header.from_json(obj)

    def _rebuild(self) -> list[Segment]:
        """Every header of the file, by one scan of its bytes; the index written back."""
        offsets = header_offsets(self.path)
        segs = []
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            for pos, off in enumerate(offsets):
                f.seek(off)
                line = f.readline()
                hdr = self._header(line, off)
                segs.append(Segment(hdr, off, off + len(line), 0, pos))  # type: ignore[arg-type]
        for a, b in zip(segs, segs[1:]):
            a.end = b.offset
        if segs:
            segs[-1].end = size
        self.bytes_read += size
        self.rebuilt = True
        _write_index(self.path, [(s.offset, s.header.seq) for s in segs], self.launch_seq)
        return segs

    def _count(self, line: bytes) -> None:
        self.bytes_read += len(line)
        self.lines_read += 1

    # ------------------------------------------------------------------ rows
    def _parse(self, seg: Segment, off: int, line: bytes) -> dict[str, Any] | None:
        """A row of ``seg`` read at ``off`` (None: a torn line, legal only as the last line
        of its segment, or a blank line, passed over as ``records`` passes it)."""
        if not line.strip():
            return None
        try:
            obj = records.parse_line(line)
        except records.BAD_LINE:
            obj = records.UNPARSED
        if obj is records.UNPARSED:
            if off + len(line) >= seg.end:
                return None  # the segment's last line, torn by a kill -9
            raise records.corrupt_row(self.path, line_number(self.path, off), "not JSON")
        if type(obj) is dict and type(obj.get("step")) is int and "schema" not in obj \
                and ("last_step" not in obj or type(obj["last_step"]) is int):
            return records.row_value(obj, line)  # the common case, checked inline
        if isinstance(obj, dict) and "schema" in obj:
            raise _Stale  # a header the index does not know
        why = records.row_problem(obj)
        if why is not None:
            raise records.corrupt_row(self.path, line_number(self.path, off), why)
        return records.row_value(obj, line)

    def torn(self) -> list[int]:
        """Byte offsets of the torn lines (a kill -9 mid-write): the last line of each
        segment that is not JSON, and a file's content before its first header. Reads
        each segment's last line only."""
        if self._torn is not None:
            return self._torn
        out = []
        size = self.path.stat().st_size
        segs = self.segments
        first = segs[0].offset if segs else size
        if first > 0:  # content before the first header: one torn line (a header cut short) ...
            with open(self.path, "rb") as f:
                head = f.read(min(first, 1 << 20))
            nl = head.find(b"\n")
            if 0 <= nl < len(head) - 1:  # ... or rows without a header: corrupt
                raise records.corrupt_row(self.path, 2, "a row before the file's first header")
            out.append(0)
        with open(self.path, "rb") as f:
            for seg in segs:
                if seg.end <= seg.start:
                    continue
                back = 1024
                while True:
                    lo = max(seg.start, seg.end - back)
                    f.seek(lo)
                    tail = f.read(seg.end - lo)
                    self.bytes_read += len(tail)
                    cut = tail.rfind(b"\n", 0, len(tail) - 1)
                    if cut >= 0 or lo == seg.start:
                        break
                    back *= 4
                line = tail[cut + 1:]
                try:
                    json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    out.append(lo + cut + 1)
        self._torn = out
        return out

    def warn_torn(self) -> None:
        """One :class:`LedgerWarning` for the file's torn lines, worded as the strict
        reading words it (``records``); line numbers are counted only when there are any."""
        torn = self.torn()
        if torn:
            lines = [line_number(self.path, off) for off in torn]
            last = line_number(self.path, self.path.stat().st_size - 1)
            warnings.warn(LedgerWarning(records.torn_note(self.path, lines, last)), stacklevel=3)

    def _line_from(self, f, pos: int, seg: Segment) -> tuple[int, bytes]:
        """The first whole line of ``seg`` starting at or after byte ``pos``."""
        if pos <= seg.start:
            f.seek(seg.start)
            return seg.start, f.readline()
        f.seek(pos - 1)
        skip = f.readline()  # the rest of the line ``pos`` falls in
        self.bytes_read += len(skip)
        q, line = pos - 1 + len(skip), f.readline()
        while line and not line.strip() and q + len(line) < seg.end:  # blank lines carry nothing
            q, line = q + len(line), f.readline()
        return q, line

    def _first_not_below(self, f, seg: Segment, step: int) -> int:
        """Bisection: a line start ``lo`` in ``seg`` at or before the first row that covers
        ``step``: every line from ``lo`` on that covers it is met by reading forward. Kept:
        the line at ``lo`` has a step below ``step`` (or ``lo`` is the segment's start),
        every line starting at or after ``hi`` has one at or above it."""
        lo, hi = seg.start, seg.end
        while hi - lo > BLOCK:
            mid = (lo + hi) // 2
            q, line = self._line_from(f, mid, seg)
            self._count(line)
            if q >= hi or not line:
                hi = mid
                continue
            row = self._parse(seg, q, line)
            if row is not None and row["step"] < step:
                lo = q
            else:
                hi = q
        return lo

    def _scan(self, f, seg: Segment, pos: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(the byte after it, row)`` for each row of ``seg`` from the line start ``pos``
        on, in file order (torn and blank lines passed over): every forward read's loop."""
        f.seek(pos)
        while pos < seg.end:
            line = f.readline()
            if not line:
                break
            self._count(line)
            row = self._parse(seg, pos, line)
            pos += len(line)
            if row is not None:
                yield pos, row

    def rows_between(self, seg: Segment, first: int, last: int) -> Iterator[dict[str, Any]]:
        """Rows of ``seg`` that cover a step in ``first``..``last`` (a window row covering
        ``first`` included), in file order, reading O(log n) lines plus the answer."""
        if seg.start >= seg.end:
            return
        with _RetryStale(self), open(self.path, "rb") as f:
            for _, row in self._scan(f, seg, self._first_not_below(f, seg, first)):
                if row["step"] > last:
                    break
                if row.get("last_step", row["step"]) >= first:
                    yield row

    def rows_at(self, seg: Segment, step: int) -> list[dict[str, Any]]:
        """Rows of ``seg`` that cover ``step`` (its step row, or the window holding it)."""
        return list(self.rows_between(seg, step, step))

    def iter_rows(self, seg: Segment) -> Iterator[dict[str, Any]]:
        """Every row of ``seg``, streamed (torn lines skipped as in ``records``)."""
        with _RetryStale(self), open(self.path, "rb") as f:
            for _, row in self._scan(f, seg, seg.start):
                yield row

    def first_row(self, seg: Segment) -> dict[str, Any] | None:
        """The first row of ``seg`` (None: it has none)."""
        return next(self.iter_rows(seg), None)

    def last_row(self, seg: Segment, upto: int | None = None) -> dict[str, Any] | None:
        """The last row of ``seg`` whose step is at most ``upto`` (None: no limit), by
        bisection; None when it has none."""
        if seg.start >= seg.end:
            return None
        target = (1 << 62) if upto is None else upto + 1
        last = None
        with _RetryStale(self), open(self.path, "rb") as f:
            for _, row in self._scan(f, seg, self._first_not_below(f, seg, target)):
                if row["step"] >= target:
                    break
                last = row
        return last

    def reset(self) -> None:
        """Forget the segments (the index was stale): the next use rebuilds them."""
        self._segments = self._rebuild()
        self._torn = None


class _RetryStale:
    """Turns a stale index met mid-read into one rebuild and a clear error if it recurs
    (the caller asks again: a point query is cheap)."""

    def __init__(self, f: IndexedFile):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if typ is _Stale:
            self.f.reset()
            raise StaleIndex(f"{self.f.path}: its offset index {index_path(self.f.path).name} missed a "
                             f"segment header (the file was appended by a writer that kept no index); the "
                             f"index is rebuilt now: run the command again") from None
        return False


class StaleIndex(LedgerError):
    """An index found stale mid-read (a header it did not know): it has been rebuilt and
    written back, and the command is refused with this one line rather than answered from
    segments that were wrong (the next run reads the rebuilt index)."""


def line_number(path: str | os.PathLike, offset: int) -> int:
    """The 1-based line number of the line starting at byte ``offset`` (errors and
    warnings only: it counts the newlines before it)."""
    n = 1
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def header_offsets(path: str | os.PathLike, start: int = 0) -> list[int]:
    """Byte offsets of every segment header line of ``path`` (from the line start
    ``start`` on), by one scan of its bytes: a line is a header when it parses as an
    object with a ``schema`` key (only lines holding the bytes ``"schema"`` are parsed)."""
    out = []
    with open(path, "rb") as f:
        f.seek(start)
        base = start
        carry = b""
        while True:
            chunk = f.read(_CHUNK)
            buf = carry + chunk
            if not chunk:
                cut = len(buf)
            else:
                cut = buf.rfind(b"\n") + 1
            block, carry = buf[:cut], buf[cut:]
            i = block.find(b'"schema"')
            while i >= 0:
                start = block.rfind(b"\n", 0, i) + 1
                stop = block.find(b"\n", i)
                stop = len(block) if stop < 0 else stop + 1
                line = block[start:stop]
                try:  # a torn header does not parse: no header
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    obj = None
                if isinstance(obj, dict) and "schema" in obj:
                    out.append(base + start)
                i = block.find(b'"schema"', stop)
            base += len(block)
            if not chunk:
                break
    return out


def _append_checked(path: Path, seq: int) -> None:
    """Remember in the index that no launch up to ``seq`` left a header it lacks."""
    idx = index_path(path)
    try:
        with open(idx, "ab") as f:
            f.write(json.dumps({"checked": seq}, separators=(",", ":")).encode() + b"\n")
    except OSError:
        pass  # a read-only folder: checked again next time


def _write_index(path: Path, entries: list[tuple[int, int | None]], checked: int | None = None) -> None:
    """Write a rebuilt index atomically (a temporary file renamed over it); a read-only
    folder keeps it in memory only."""
    idx = index_path(path)
    tmp = idx.with_name(f".{idx.name}.{os.getpid()}.tmp")
    body = "".join(index_line(o, s) for o, s in entries)
    if checked is not None:
        body += json.dumps({"checked": checked}, separators=(",", ":")) + "\n"
    try:
        tmp.write_text(body)
        os.replace(tmp, idx)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


# --------------------------------------------------------------------------- many files


def point(files: dict[Any, IndexedFile], step: int) -> tuple[dict[Any, dict], dict[Any, list[dict]]]:
    """The rows of ``step`` in every file of one kind, as the supersession rule leaves
    them: ``(current, by_segment)``. ``current[key]`` is the current row covering
    ``step`` (a step row or a window); ``by_segment[key]`` every row covering it, one per
    segment, in the run's order (the rows of launches a later resume superseded
    included). Reads O(segments × log n) lines per file."""
    found: dict[Any, list[records.FileSegment]] = {}
    for key, f in files.items():
        found[key] = _segments_at(f, step)
    current, _ = records.resolve(found)
    by_segment = {key: [r for s in sorted(segs, key=records.order_key) for r in s.rows]
                  for key, segs in found.items()}
    return {k: rows[-1] for k, rows in current.items() if rows}, by_segment


def _segments_at(f: IndexedFile, step: int) -> list[records.FileSegment]:
    return [seg.as_file_segment(f.rows_at(seg, step)) for seg in f.segments]


def between(files: dict[Any, IndexedFile], first: int, last: int) -> dict[Any, list[dict]]:
    """The current rows of every file that cover a step in ``first``..``last``, by the
    supersession rule (:func:`records.resolve`), in history order."""
    found = {key: [seg.as_file_segment(list(f.rows_between(seg, first, last))) for seg in f.segments]
             for key, f in files.items()}
    current, _ = records.resolve(found)
    return current


class Cursor:
    """One file's current history read forward in chunks of steps (:meth:`take`), each
    call opening the file at the byte where the last one stopped: a whole-run reader
    holds no file open between chunks and reads every byte once."""

    def __init__(self, f: IndexedFile, key: Any, lims: dict[tuple[Any, int], int | None]):
        self.f = f
        self.segs = [(seg, lims[(key, seg.file_pos)])
                     for seg in sorted(f.segments, key=lambda s: (s.header.seq, s.file_pos))]
        self.i = 0
        self.pos = self.segs[0][0].start if self.segs else 0
        self.ahead: tuple[Segment, dict] | None = None  # a row read past the last chunk's end
        # windows that also cover the next chunk (several: a later launch's window can start
        # inside an earlier one that stays current)
        self.carry: list[tuple[Segment, dict]] = []

    def take(self, last: int) -> list[tuple[Segment, dict[str, Any]]]:
        """``(segment, row)`` of the rows that cover a step up to ``last`` not yet taken (a
        window that reaches past ``last`` is given again by the next call)."""
        with _RetryStale(self.f):
            return self._take(last)

    def _take(self, last: int) -> list[tuple[Segment, dict[str, Any]]]:
        out = list(self.carry)
        self.carry = [c for c in self.carry if c[1].get("last_step", 0) > last]
        if self.ahead is not None:
            if self.ahead[1]["step"] > last:
                return out
            out.append(self.ahead)
            if self.ahead[1].get("last_step", 0) > last:
                self.carry.append(self.ahead)
            self.ahead = None
        if self.i >= len(self.segs):
            return out
        with open(self.f.path, "rb") as fh:
            while self.i < len(self.segs):
                seg, lim = self.segs[self.i]
                for end, row in self.f._scan(fh, seg, self.pos):
                    self.pos = end
                    if lim is not None and row["step"] > lim:
                        break  # the rest of the segment is superseded
                    if row["step"] > last:
                        self.ahead = (seg, row)
                        return out
                    out.append((seg, row))
                    if row.get("last_step", 0) > last:
                        self.carry.append((seg, row))
                self.i += 1
                self.pos = self.segs[self.i][0].start if self.i < len(self.segs) else self.pos
        return out


def limits(files: dict[Any, IndexedFile]) -> dict[tuple[Any, int], int | None]:
    """``(file key, file_pos) -> ``the largest step of that segment that stays current
    (None: all), by :func:`records.keep_limits` over every segment of every file."""
    flat = [(key, seg) for key, f in files.items() for seg in f.segments]
    lims = records.keep_limits([((seg.header.seq, seg.file_pos), seg.header.run_id, seg.header.resumed_from)
                                for _, seg in flat])
    return {(key, seg.file_pos): lim for (key, seg), lim in zip(flat, lims)}


def iter_history(files: dict[Any, IndexedFile], key: Any,
                 lims: dict[tuple[Any, int], int | None] | None = None
                 ) -> Iterator[tuple[Segment, dict[str, Any]]]:
    """The current history of file ``key`` streamed, ``(segment, row)`` in the order of
    :func:`records.resolve` (segments in run order, rows in file order): memory O(1)
    in the run's length."""
    lims = limits(files) if lims is None else lims
    f = files[key]
    for seg in sorted(f.segments, key=lambda s: (s.header.seq, s.file_pos)):
        lim = lims[(key, seg.file_pos)]
        for row in f.iter_rows(seg):
            if lim is not None and row["step"] > lim:
                break  # rows are in step order: the rest of the segment is superseded
            yield seg, row


def build_index(path: str | os.PathLike) -> list[int]:
    """Write ``<path>.idx`` from the JSONL (one scan of its bytes), as the writer would have
    kept it; returns the header offsets. For ledgers written or copied without one (the
    readers rebuild a missing index on their own; this does it ahead of them)."""
    offsets = header_offsets(path)
    seqs = []
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            seqs.append(json.loads(f.readline()).get("seq"))
    _write_index(Path(path), list(zip(offsets, seqs)))
    return offsets
