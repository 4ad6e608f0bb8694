"""The ledger record format: append-only JSONL, shared by writer, replay, plot and lookup.

Design decision: one file per ledger, append-only, one JSON object per line, each
line written with a single ``write`` and flushed. A process killed with -9 can tear
at most the line it was writing; every reader skips a line that does not parse.
A run (a process launch) starts a *segment* with a header line (it carries the
``schema`` key, rows never do). When a run resumes from a checkpoint at step k,
its header says ``resumed_from: k``; rows with step > k written by earlier
segments are *superseded*: kept in the file as history of the lost run, never
mixed into the current history.

Signal rows have exactly the keys in :data:`SIGNAL_KEYS` (plus
``grad_norm_per_layer`` when per-layer norms are on). A skipped window is ONE
row, ``step`` = its first step, with ``last_step`` and ``skip_lr`` added and the
model signals null, so a skip of 10^6 steps costs one line; ``LedgerFile.at``
finds the row covering any step. The data ledger (``DATA_SCHEMA``, one file per
DP rank) follows the same rules: ``{"step", "skipped", "rows": [[sample_id,
source, [[doc, start, end], ...]], ...]}`` per step, and a window row with
``last_step`` and ``samples: [first, end)`` for skips.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

SIGNALS_SCHEMA = "titan_ledger.signals/1"
RANK_SCHEMA = "titan_ledger.rank/1"
DATA_SCHEMA = "titan_ledger.data/1"
SPIKES_SCHEMA = "titan_ledger.spikes/1"
REJECTED_SCHEMA = "titan_ledger.rejected/1"

SIGNAL_KEYS = (
    "step",
    "consumed_samples",
    "consumed_tokens",
    "loss",
    "loss_max",
    "loss_max_rank",
    "grad_norm",
    "grad_norm_clipped",
    "num_zeros",
    "param_norm",
    "max_logit",
    "lr",
    "skipped",
    "skipped_samples",
    "spike",
    "update_skipped",
    "step_time_s",
    "data_loading_s",
)
PER_LAYER_KEY = "grad_norm_per_layer"
RANK_KEYS = ("step", "loss", "tokens")


def _json_value(v: Any) -> Any:
    # JSON has no NaN/inf; keep them readable and round-trippable as strings.
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _json_value(x) for k, x in v.items()}
    return v


def _from_json(v: Any) -> Any:
    if v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, dict):
        return {k: _from_json(x) for k, x in v.items()}
    return v


class RecordWriter:
    """Append rows to a JSONL ledger file; one ``write`` + flush per row."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]):
        if "schema" not in header:
            raise ValueError("a segment header needs a 'schema' key")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab", buffering=0)
        # A torn last line (kill -9 mid-write) must not swallow our header.
        if self._f.tell() > 0 and not _ends_with_newline(self.path):
            self._f.write(b"\n")
        self._write(header)

    def _write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(_json_value(obj), separators=(",", ":"), allow_nan=False) + "\n"
        self._f.write(line.encode())  # unbuffered: one write(2) per line

    def write(self, row: dict[str, Any]) -> None:
        if "schema" in row:
            raise ValueError("rows must not carry the header key 'schema'")
        self._write(row)

    def sync(self) -> None:
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


@dataclass
class Segment:
    header: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class LedgerFile:
    """A parsed ledger: current history, superseded rows, segments, torn lines."""

    path: Path
    segments: list[Segment]
    history: list[dict[str, Any]]
    superseded: list[dict[str, Any]]
    torn_lines: int

    def by_step(self) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in self.history}

    def at(self, step: int) -> dict[str, Any] | None:
        """The current row covering ``step`` (a step row or a skipped window)."""
        for r in reversed(self.history):
            if r["step"] <= step <= r.get("last_step", r["step"]):
                return r
        return None


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, parsed object or None if torn/corrupt) for each line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                yield n, None
                continue
            yield n, obj if isinstance(obj, dict) else None


def read_ledger(path: str | os.PathLike, schema: str | None = None) -> LedgerFile:
    """Read a ledger file; rows of lost runs (after a resume point) are superseded."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no ledger file")
    segments: list[Segment] = []
    torn = 0
    for _, obj in iter_lines(path):
        if obj is None:
            torn += 1
        elif "schema" in obj:
            if schema is not None and obj["schema"] != schema:
                raise ValueError(f"{path}: schema {obj['schema']!r}, expected {schema!r}")
            segments.append(Segment(obj))
        elif segments:
            segments[-1].rows.append(_from_json(obj))
        else:
            torn += 1  # rows before any header: not ours
    history: list[dict[str, Any]] = []
    superseded: list[dict[str, Any]] = []
    for seg in segments:
        resumed = seg.header.get("resumed_from")
        if resumed is not None:
            keep = [r for r in history if r["step"] <= resumed]
            superseded += [dict(r, superseded_by=seg.header.get("run_id")) for r in history
                           if r["step"] > resumed]
            history = keep
        history += seg.rows
    return LedgerFile(path, segments, history, superseded, torn)
