"""The ledger's on-disk format: the one owner of schemas, rows, segments and supersession.

Design decision: one file per ledger, append-only, one JSON object per line, each
line written with a single ``write`` (unbuffered). A process killed with -9 can
tear at most the line it was writing: the file's last line, with no newline, or --
after a resume appended a new segment behind it -- the last line of its segment
(the writer ends it with a newline before its header). Reading is strict in one
place (:func:`read_segments`): such a torn line is skipped, counted and reported as a
:class:`~titan_ledger.errors.LedgerWarning` (each tool prints it as one ``warning:``
line); any other line that is not a ledger row (not JSON, not an object, no
integer ``step``, a row before the first header) is a ``LedgerError`` naming
``FILE:LINE``. Every writer and every reader of ledger files goes
through this module (writers through :class:`RecordWriter`, readers through
:func:`read_ledger` or :class:`titan_ledger.format.reader.RunLedger`); no tool parses
ledger JSON itself.

**Segments.** Each process launch (and each in-process rewind) starts a *segment*
in every file it writes with a header line, the only kind of line with a
``schema`` key. A header carries the schema id (``titan_ledger.<kind>/<version>``,
:data:`SCHEMAS`), the run id, ``resumed_from`` (the step of the checkpoint the
launch resumed from, 0 for a fresh start) and ``seq``, the segment's position in
the run: all files written by one launch share its ``seq``, and a later launch or
rewind has a larger one (:func:`next_seq` reads the run's launch log,
``segments.jsonl``); a header without ``seq`` is refused on read.

**The supersession rule** (:func:`resolve`, the only implementation): segments are
taken in ``seq`` order; a segment with ``resumed_from = k`` supersedes every row
with ``step > k`` of every earlier segment, in every file of the same kind (after a
resume with fewer DP ranks, the files of ranks that no longer exist still hold
rows of the lost run). Superseded rows stay in the files as the history of the
lost run; readers return them separately. Event logs (spikes, rejected steps)
are never superseded: a spike that caused a rewind stays on record.

**Rows.** Signal rows have exactly :data:`SIGNAL_KEYS` (plus
:data:`PER_LAYER_KEY` when per-layer norms are on), declared with their types in
:mod:`titan_ledger.format.signal_columns`. A skipped window is ONE row,
``step`` = its first step, with ``last_step`` and ``skip_lr``, model signals null,
so a skip of 10^6 steps costs one line. Data rows (one file per DP rank) are
``{"step", "skipped", "rows": [[sample_id, source, [[doc, start, end], ...]], ...]}``
and a window row with ``last_step`` and ``samples: [first, end)``. Since schema
``titan_ledger.data/2`` a deterministic source (indexed corpus) writes a step as
``{"step", "skipped", "samples": [first, end), "digest"}``: the rows are derived from
the corpus and checked against the digest (``reader.DataLedger``); version 1 files read.
JSON has no NaN/inf: they are stored as the strings "nan", "inf", "-inf".
"""

from __future__ import annotations

import gc
import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_ledger.errors import LedgerCorrupt, LedgerError, LedgerWarning

# the signals row's keys and types, declared once in signal_columns (the table every view
# derives from), re-exported here where rows are written and read
from titan_ledger.format.signal_columns import PER_LAYER_KEY as PER_LAYER_KEY
from titan_ledger.format.signal_columns import SIGNAL_KEYS as SIGNAL_KEYS
from titan_ledger.format.signal_columns import SignalRow as SignalRow

if TYPE_CHECKING:
    import numpy as np

try:  # a ledger line is parsed ~3x faster by orjson (measured: bench/bench_ledger_scale.py)
    from orjson import loads as parse_line
except ImportError:  # pragma: no cover - orjson is a dependency; the standard library reads the same
    parse_line = json.loads

#: what parsing a line that is not JSON raises, with either parser
BAD_LINE = (json.JSONDecodeError, UnicodeDecodeError, ValueError)

@contextmanager
def no_cycle_gc():
    """Pause Python's cyclic garbage collector while a reader holds many rows: ledger rows
    are dicts of plain values (no reference cycles), and collecting while 10^5 of them are
    alive cost 3.5x the parse itself (measured: ``replay check`` 24.8 -> 7.1 us a row)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# --------------------------------------------------------------------------- schemas


@dataclass(frozen=True)
class Schema:
    """One kind of ledger file: its schema id and whether rows can be superseded."""

    kind: str
    version: int
    event_log: bool = False  # events are never superseded
    # every row is appended by another launch (the launch log): a torn row is the last
    # line of its launch even when the next launch's row follows it
    row_per_launch: bool = False

    @property
    def id(self) -> str:
        return f"titan_ledger.{self.kind}/{self.version}"


SIGNALS = Schema("signals", 1)
RANK = Schema("rank", 1)
DATA = Schema("data", 2)  # 2: a step row may hold only its sample range + digest (derived rows)
SPIKES = Schema("spikes", 1, event_log=True)
REJECTED = Schema("rejected", 1, event_log=True)
SEGMENTS = Schema("segments", 1, event_log=True, row_per_launch=True)
EPISODES = Schema("episodes", 1, event_log=True)  # what diagnose --rerun measured of each episode
SCHEMAS = {s.kind: s for s in (SIGNALS, RANK, DATA, SPIKES, REJECTED, SEGMENTS, EPISODES)}


#: file names inside the ledger folder (``<dump_folder>/<ledger.folder>``)
SIGNALS_FILE = "signals.jsonl"
SPIKES_FILE = "spikes.jsonl"
REJECTED_FILE = "rejected_steps.jsonl"
SEGMENTS_FILE = "segments.jsonl"
EPISODES_FILE = "episodes.jsonl"  # one row per episode proof (``{"step": onset, ...}``), the last for an onset wins


def data_file(dp_rank: int) -> str:
    return f"data_dp{dp_rank}.jsonl"


def rank_file(rank: int) -> str:
    return f"rank{rank}.jsonl"


#: ``<ledger>/rerun/``: the rerun summaries (one ``step<T>.json`` per proven step), and
#: ``<dump>/rerun/``: the rerun variants' own dump folders
RERUN_FOLDER = "rerun"


def rerun_summary_file(ledger_folder: str | os.PathLike, step: int) -> Path:
    """``<ledger>/rerun/step<T>.json``: the verdict of ``replay rerun`` at step T."""
    return Path(ledger_folder) / RERUN_FOLDER / f"step{step}.json"


#: the ledger folder inside the dump folder when ``[ledger] folder`` is not set (the
#: tools' ``--ledger-folder`` default)
LEDGER_FOLDER = "ledger"

#: glob patterns matching every DP rank's data file (:func:`data_file`) and every
#: rank's loss file (:func:`rank_file`)
DATA_GLOB = "data_dp*.jsonl"
RANK_GLOB = "rank*.jsonl"

#: with W&B on: the W&B run id and last ``_step`` (``components.dashboards``)
WANDB_STATE_FILE = "wandb.json"

#: in each rerun variant's own dump folder (``<dump>/rerun/<variant>/``): the launch's
#: record (what it ran, its return code)
RERUN_RECORD_FILE = "rerun.json"
#: a quarantine file's name: a ``quarantine`` variant's, in its folder, and the one
#: ``diagnose`` suggests writing (``--write-quarantine``, ``--ledger.filter.quarantine``)
QUARANTINE_FILE = "quarantine.jsonl"
#: the run's own quarantine: documents a proof at the alarm convicted (``bad_data``), one
#: ``{"source", "doc", "step"}`` per line, in the ledger folder (a valid quarantine file;
#: a relaunch masks those convicted at or before the step it resumes from)
PROVEN_FILE = "proven_documents.jsonl"


def _files_by_rank(ledger_folder: str | os.PathLike, pattern: str) -> dict[int, Path]:
    head, tail = pattern.split("*")
    found = {}
    for p in Path(ledger_folder).glob(pattern):
        r = p.name[len(head):len(p.name) - len(tail)]
        if r.isdigit():
            found[int(r)] = p
    return dict(sorted(found.items()))


def data_files(ledger_folder: str | os.PathLike) -> dict[int, Path]:
    """Every ``data_dp<r>.jsonl`` in the ledger folder, by DP rank (ascending)."""
    return _files_by_rank(ledger_folder, DATA_GLOB)


def rank_files(ledger_folder: str | os.PathLike) -> dict[int, Path]:
    """Every ``rank<r>.jsonl`` in the ledger folder, by rank (ascending)."""
    return _files_by_rank(ledger_folder, RANK_GLOB)


@dataclass
class Header:
    """The fields every segment header has; kind-specific fields ride in ``extra``."""

    schema: str
    run_id: str = ""
    seq: int | None = None
    resumed_from: int | None = None
    time: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Header:
        known = {"schema", "run_id", "seq", "resumed_from", "time"}
        return cls(schema=obj["schema"], run_id=obj.get("run_id", ""), seq=obj.get("seq"),
                   resumed_from=obj.get("resumed_from"), time=float(obj.get("time") or 0.0),
                   extra={k: v for k, v in obj.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        out = {"schema": self.schema, "run_id": self.run_id, "seq": self.seq,
               "resumed_from": self.resumed_from, "time": self.time, **self.extra}
        return {k: v for k, v in out.items() if v is not None}

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style access over the common fields and ``extra``."""
        if key in ("schema", "run_id", "seq", "resumed_from", "time"):
            v = getattr(self, key)
            return default if v is None else v
        return self.extra.get(key, default)

    def __getitem__(self, key: str) -> Any:
        v = self.get(key, _MISSING)
        if v is _MISSING:
            raise KeyError(key)
        return v

    def __contains__(self, key: str) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def as_dict(self) -> dict[str, Any]:
        return self.to_json()


_MISSING = object()


def check_schema(found: str, expected: Schema, path: Path) -> None:
    """A header's schema id must be of the expected kind, at a version we can read."""
    name, _, version = found.partition("/")
    if name != f"titan_ledger.{expected.kind}":
        raise LedgerError(f"{path}: holds {found!r}, not a {expected.kind} ledger "
                          f"({expected.id}); is it the right file?")
    try:
        v = int(version)
    except ValueError:
        raise LedgerError(f"{path}: unreadable schema id {found!r}") from None
    if v > expected.version:
        raise LedgerError(f"{path}: written by a newer titan_ledger (schema {found}, this version "
                          f"reads up to {expected.id}); upgrade titan_ledger to read it")


# --------------------------------------------------------------------------- writing


def _json_value(v: Any) -> Any:
    # JSON has no NaN/inf; keep them readable and round-trippable as strings.
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _json_value(x) for k, x in v.items()}
    return v


def row_value(obj: dict[str, Any], raw: bytes) -> dict[str, Any]:
    """A parsed row with its non-finite strings made floats again (:func:`from_json_value`),
    walked only when its line holds one (most lines hold none)."""
    if b'"nan"' in raw or b'inf"' in raw:
        return from_json_value(obj)
    return obj


def from_json_value(v: Any) -> Any:
    if v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, dict):
        return {k: from_json_value(x) for k, x in v.items()}
    return v


class RecordWriter:
    """Append one segment (a header, then rows) to a ledger file; one ``write`` per line."""

    def __init__(self, path: str | os.PathLike, header: Header | dict[str, Any]):
        hdr = header.to_json() if isinstance(header, Header) else dict(header)
        if "schema" not in hdr:
            raise ValueError("a segment header needs a 'schema' key")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab", buffering=0)
        self.rows = 0
        # A torn last line (kill -9 mid-write) must not swallow our header.
        if self._f.tell() > 0 and not ends_with_newline(self.path):
            self._f.write(b"\n")
        # the segment index entry goes first: a crash between the two leaves an entry
        # past the file's end (no rows), never a header the index does not know
        hdr = {"schema": hdr.pop("schema"), **hdr}  # headers start with "schema" (index rebuild scans for it)
        note_segment(self.path, self._f.tell(), hdr.get("seq"))
        self._write(hdr)

    def _write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(_json_value(obj), separators=(",", ":"), allow_nan=False) + "\n"
        try:
            self._f.write(line.encode())  # unbuffered: one write(2) per line
        except OSError as e:  # write(2) names no path: the error must (a full disk: which file)
            if e.filename is None:
                raise OSError(e.errno, e.strerror, str(self.path)) from e
            raise

    def write(self, row: dict[str, Any]) -> None:
        if "schema" in row:
            raise ValueError("rows must not carry the header key 'schema'")
        self._write(row)
        self.rows += 1

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


#: beside each ledger file, its segment index (read by :mod:`titan_ledger.format.index`)
INDEX_SUFFIX = ".idx"


def index_path(path: str | os.PathLike) -> Path:
    """``<file>.idx``: the segment index kept beside a ledger file: one line per segment,
    ``{"offset": byte offset of its header line, "seq": its seq}`` (and, from readers,
    ``{"checked": seq}``: no header of a launch up to that seq is missing from it)."""
    p = Path(path)
    return p.with_name(p.name + INDEX_SUFFIX)


def index_line(offset: int, seq: int | None) -> str:
    return json.dumps({"offset": offset, "seq": seq}, separators=(",", ":")) + "\n"


def note_segment(path: str | os.PathLike, offset: int, seq: int | None) -> None:
    """The writer's half of the index: record that a segment header will be written at
    ``offset`` of ``path`` (called just before the header is written). A file that
    already has rows but no index (written by a titan_ledger before the index, or copied
    without it) gets none here: a launch reads O(1) of the ledger, and the first reader
    rebuilds it whole."""
    idx = index_path(path)
    if offset > 0 and not idx.exists():
        return
    with open(idx, "ab", buffering=0) as f:
        if f.tell() > 0 and not ends_with_newline(idx):
            f.write(b"\n")  # a torn entry (kill -9 mid-write) must not swallow ours
        f.write(index_line(offset, seq).encode())


def ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


# --------------------------------------------------------------------------- reading


@dataclass
class FileSegment:
    """One segment of one ledger file: its header and rows, in file order."""

    header: Header
    rows: list[dict[str, Any]] = field(default_factory=list)
    file_pos: int = 0  # index of this segment in its file
    lines: list[int] = field(default_factory=list)  # the line number of each row (1-based)
    line: int = 0  # the header's line number


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, Any, bool]]:
    """``(line number, parsed JSON or UNPARSED, ends with a newline)`` for each line;
    blank lines carry nothing and are passed over (as the column reader's pyarrow does)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = parse_line(raw)
            except BAD_LINE:
                obj = UNPARSED
            yield n, obj, raw.endswith(b"\n")


UNPARSED = object()  # a line that is not JSON (torn, or garbage)


def row_problem(obj: Any) -> str | None:
    """Why a parsed line is not a ledger row (None: it is one). Every row of every kind
    is a JSON object with an integer ``step`` (and an integer ``last_step`` if any)."""
    if obj is UNPARSED:
        return "not JSON"
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    for key in ("step", "last_step"):
        v = obj.get(key)
        if (key == "step" or key in obj) and (not isinstance(v, int) or isinstance(v, bool)):
            return f"no integer {key!r}" if v is None else f"{key!r} is {v!r}, not an integer"
    return None


def corrupt_row(path: Path, n: int, why: str) -> LedgerCorrupt:
    return LedgerCorrupt(f"{path}:{n}: not a ledger row ({why}); the file is corrupt (edited, or "
                         f"written by another tool?): only a torn last line is skipped; restore the "
                         f"file from the run's dump folder")


def rows_after(path: str | os.PathLike, offset: int) -> Iterator[dict[str, Any]]:
    """Rows (not headers) appended to ``path`` after byte ``offset``, for watching a
    file that a run is writing; a missing file has none, torn lines are skipped."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        f.seek(offset)
        for raw in f:
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # live tail: the line being written now
            if isinstance(obj, dict) and "schema" not in obj and isinstance(obj.get("step"), int):
                yield from_json_value(obj)


def read_segments(path: str | os.PathLike, schema: Schema | str | None = None
                  ) -> tuple[list[FileSegment], int]:
    with no_cycle_gc():
        return _read_segments(path, schema)


def _read_segments(path: str | os.PathLike, schema: Schema | str | None = None
                   ) -> tuple[list[FileSegment], int]:
    """The segments of one file and its number of torn lines: THE strict reading.

    A line that is not JSON is torn (a kill -9 mid-write) when it is the last line of
    the file without its newline, or the last line of its segment: the next line is a
    header (a resume appended after it; in the launch log, whose every row is one
    launch, the next row). Torn lines are skipped and reported as ONE
    :class:`LedgerWarning` for the file. Raises LedgerError for a missing file, one of
    another kind or of a newer schema version, and -- naming ``FILE:LINE`` -- for any
    other line that is not a ledger row (:func:`row_problem`, a row before the first
    header)."""
    path = Path(path)
    if not path.is_file():
        raise LedgerError(f"{path}: no such ledger file")
    expected = _schema_of(schema)
    segments: list[FileSegment] = []
    torn: list[int] = []
    pending: tuple[int, str] | None = None  # a line not JSON, ended by a newline
    last = 0
    for n, obj, complete in iter_lines(path):
        last = n
        is_header = isinstance(obj, dict) and "schema" in obj
        if pending is not None:
            if is_header or (segments and _kind(segments[-1], expected).row_per_launch):
                torn.append(pending[0])  # the last line of its segment
                pending = None
            else:
                raise corrupt_row(path, *pending)
        if obj is UNPARSED:
            if not complete:
                torn.append(n)  # the file's last line, cut before its newline
            else:
                pending = (n, "not JSON")
            continue
        if is_header:
            if expected is not None:
                check_schema(str(obj["schema"]), expected, path)
            seg = FileSegment(Header.from_json(obj), file_pos=len(segments), line=n)
            seq = obj.get("seq")
            if not _kind(seg, expected).row_per_launch and (not isinstance(seq, int) or isinstance(seq, bool)):
                # every writer numbers its segments (the launch log numbers its rows): a
                # header without seq was edited
                raise corrupt_row(path, n, "a segment header without an integer 'seq'")
            segments.append(seg)
            continue
        why = row_problem(obj)
        if why is None and not segments:
            why = "a row before the file's first header"
        if why is not None:
            raise corrupt_row(path, n, why)
        segments[-1].rows.append(from_json_value(obj))
        segments[-1].lines.append(n)
    if pending is not None:
        raise corrupt_row(path, *pending)
    if torn:
        warnings.warn(LedgerWarning(torn_note(path, torn, last)), stacklevel=3)
    return segments, len(torn)


def _kind(seg: FileSegment, expected: Schema | None) -> Schema:
    if expected is not None:
        return expected
    return SCHEMAS.get(str(seg.header.schema).split("/")[0].removeprefix("titan_ledger."), SIGNALS)


def torn_note(path: Path, torn: list[int], last: int) -> str:
    if torn == [last]:
        return f"{path}:{last}: torn last line skipped (a kill -9 mid-write)"
    lines = ", ".join(map(str, torn))
    return (f"{path}: torn line{'s' if len(torn) > 1 else ''} {lines} skipped (a kill -9 mid-write; "
            f"each the last line of its launch's segment)")


def _schema_of(schema: Schema | str | None) -> Schema | None:
    if schema is None or isinstance(schema, Schema):
        return schema
    kind = schema.split("/")[0].removeprefix("titan_ledger.")
    if kind not in SCHEMAS:
        raise ValueError(f"unknown schema {schema!r}")
    return SCHEMAS[kind]


def order_key(seg: FileSegment) -> tuple:
    """Where a segment stands in its run: its ``seq`` (every header has one, checked on
    read), then its position in the file."""
    return (seg.header.seq, seg.file_pos)


def keep_limits(entries: list[tuple[tuple, str, int | None]]) -> list[int | None]:
    """THE supersession rule (see the module docstring), per segment.

    ``entries``: one per segment, ``(order_key, run_id, resumed_from)``. Returns, per
    entry, the largest step of its rows that stays current (None: every row does): the
    smallest ``resumed_from`` of the launches after it. Segments are taken in
    ``order_key`` order; consecutive segments of one run id form one launch (one per
    file it wrote), so a rank's header never supersedes its sibling ranks' rows of the
    same launch. A limit per segment, not a mask per row, so that a streaming reader
    applies the rule as it reads (:mod:`titan_ledger.format.index`).
    """
    order = sorted(range(len(entries)), key=lambda i: entries[i][0])
    limits: list[int | None] = [None] * len(entries)
    seen: list[int] = []
    i = 0
    while i < len(order):
        j = i
        run_id = entries[order[i]][1]
        while j < len(order) and entries[order[j]][1] == run_id:
            j += 1
        resumed = entries[order[i]][2]
        if resumed is not None:
            for e in seen:
                limits[e] = resumed if limits[e] is None else min(limits[e], resumed)
        seen += order[i:j]
        i = j
    return limits


def supersession_masks(entries: list[tuple[tuple, str, int | None, np.ndarray]]) -> list[np.ndarray]:
    """:func:`keep_limits` on step arrays: per entry ``(order_key, run_id,
    resumed_from, steps)``, a boolean mask of its rows that are current."""
    import numpy as np

    limits = keep_limits([e[:3] for e in entries])
    return [np.ones(len(e[3]), dtype=bool) if lim is None else e[3] <= lim
            for e, lim in zip(entries, limits)]


def resolve(files: dict[Any, list[FileSegment]]) -> tuple[dict[Any, list[dict]], list[dict]]:
    """Apply the supersession rule over all files of one kind.

    ``files`` maps a file key (e.g. the DP rank) to its segments. Returns the
    current history per file key (rows in segment order) and the superseded rows,
    each with ``superseded_by`` (the run id of the first later launch that resumed
    before it).
    """
    import numpy as np

    flat = [(key, seg) for key, segs in files.items() for seg in segs]
    entries = [(order_key(seg), seg.header.run_id, seg.header.resumed_from,
                np.fromiter((r["step"] for r in seg.rows), dtype=np.int64, count=len(seg.rows)))
               for _, seg in flat]
    masks = supersession_masks(entries)
    later = sorted(range(len(flat)), key=lambda i: entries[i][0])
    current: dict[Any, list[dict]] = {key: [] for key in files}
    superseded: list[dict] = []
    for pos, i in enumerate(later):
        key, seg = flat[i]
        for row, keep in zip(seg.rows, masks[i].tolist()):
            if keep:
                current[key].append(row)
            else:
                by = next((flat[k][1].header.run_id for k in later[pos + 1:]
                           if flat[k][1].header.run_id != seg.header.run_id
                           and flat[k][1].header.resumed_from is not None
                           and row["step"] > flat[k][1].header.resumed_from), None)
                superseded.append(dict(row, superseded_by=by))
    return current, superseded


@dataclass
class LedgerFile:
    """A parsed single ledger file: current history, superseded rows, segments, torn lines."""

    path: Path
    segments: list[FileSegment]
    history: list[dict[str, Any]]
    superseded: list[dict[str, Any]]
    torn_lines: int

    def by_step(self) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in self.history}

    def history_as_of(self, step: int) -> list[dict[str, Any]] | None:
        """The history as it stood when ``step`` ran: the current history if the
        step is in it, else -- for a step a later resume or rewind superseded -- the
        history of the segment that ran it (its last occurrence); None if no
        segment ran it. A step that trained in an earlier segment and is now in a
        skipped window (a rollback skipped it) is answered with the segment that
        trained it, not the window."""
        trained = lambda r: r["step"] == step and not r.get("skipped")  # noqa: E731
        if any(trained(r) for r in self.history):
            return self.history
        last = None
        for i, seg in enumerate(self.segments):
            if any(trained(r) for r in seg.rows):
                last = i
        if last is None:
            if any(r["step"] == step for r in self.history):
                return self.history  # never trained: the window (or skipped row) that holds it
            for i, seg in enumerate(self.segments):
                if any(r["step"] == step for r in seg.rows):
                    last = i
        if last is None:
            return None
        hist, _ = resolve({0: self.segments[:last + 1]})
        return hist[0]


def read_ledger(path: str | os.PathLike, schema: Schema | str | None = None) -> LedgerFile:
    """Read one ledger file; an event log's rows are never superseded."""
    path = Path(path)
    segments, torn = read_segments(path, schema)
    kind = _schema_of(schema) or (SCHEMAS.get(segments[0].header.schema.split("/")[0]
                                               .removeprefix("titan_ledger."))
                                  if segments else None)
    if kind is not None and kind.event_log:
        return LedgerFile(path, segments, [r for s in segments for r in s.rows], [], torn)
    current, superseded = resolve({0: segments})
    return LedgerFile(path, segments, current[0], superseded, torn)


def read_many(paths: dict[Any, Path], schema: Schema) -> tuple[dict[Any, list[FileSegment]], dict[Any, int]]:
    """Segments and torn-line counts of several files of one kind."""
    segs, torn = {}, {}
    for key, p in paths.items():
        segs[key], torn[key] = read_segments(p, schema)
    return segs, torn


def headers(segments: Iterable[FileSegment]) -> list[Header]:
    return [s.header for s in segments]


# --------------------------------------------------------------------------- the launch log


def next_seq(folder: str | os.PathLike) -> int:
    """The ``seq`` of the next segment of the run in ``folder``: one past the largest
    recorded in its launch log (``segments.jsonl``), 1 for a new run. The launch log
    is one line per segment, so this is cheap however long the run."""
    path = Path(folder) / SEGMENTS_FILE
    if not path.exists():
        return 1
    best = 0
    for _, obj, _ in iter_lines(path):  # lenient: the tools, not the trainer, judge the file
        if isinstance(obj, dict) and isinstance(obj.get("seq"), int):
            best = max(best, obj["seq"])
    return best + 1


def append_segment(folder: str | os.PathLike, header: Header) -> None:
    """Record a new segment in the run's launch log (rank 0, at open and on rewinds)."""
    path = Path(folder) / SEGMENTS_FILE
    fresh = not path.exists() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab", buffering=0) as f:
        if fresh:
            f.write((json.dumps({"schema": SEGMENTS.id}) + "\n").encode())
        elif not ends_with_newline(path):
            f.write(b"\n")
        row = {k: v for k, v in header.to_json().items() if k != "schema"}
        row.setdefault("step", header.resumed_from or 0)
        f.write((json.dumps(_json_value(row), separators=(",", ":")) + "\n").encode())
