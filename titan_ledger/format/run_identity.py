"""Which run a ledger file belongs to: the launch log's segments and the check every reader
makes of a file's headers against it.

Design decision: a run's identity is its launch log (``segments.jsonl``: one row per launch or
rewind, each with the run id); every file a reader opens is checked against it once, so a
file copied in from another dump folder is refused with one line naming it, whichever reader
(the run's, the data ledger's, the column reader) opened it first.
"""

from __future__ import annotations

from pathlib import Path

from titan_ledger.errors import LedgerCorrupt
from titan_ledger.format import records


def launch_ids(folder: str | Path) -> dict[int, str]:
    """``seq -> run id`` of every segment (launch or rewind) the run's launch log
    (``segments.jsonl``) recorded; empty for ledgers written before it existed."""
    path = Path(folder) / records.SEGMENTS_FILE
    if not path.is_file():
        return {}
    rows = records.read_ledger(path, records.SEGMENTS).history
    return {r["seq"]: str(r.get("run_id", "")) for r in rows if isinstance(r.get("seq"), int)}


def same_run(path: Path, segments: list[records.FileSegment], launches: dict[int, str]) -> None:
    """LedgerError naming ``path`` if its segments are of another run: none of its
    ``(run id, seq)`` is a segment of this run's launch log (a file copied in from
    another dump folder). Every file of a run is checked here once, on read. A file
    whose only segment is one past the log is a launch opening right now; files
    without ``seq`` (older writers) or runs without a launch log are not checked."""
    numbered = [s.header for s in segments if s.header.seq is not None]
    if not launches or not numbered or any(launches.get(h.seq) == h.run_id for h in numbered):
        return
    if len(segments) == 1 and numbered[0].seq > max(launches):
        return
    h = numbered[0]
    ours = launches.get(h.seq)
    theirs = f"run {ours!r} at segment {h.seq}" if ours is not None else f"no segment {h.seq}"
    runs = ", ".join(repr(r) for r in dict.fromkeys(launches.values()))
    raise LedgerCorrupt(f"{path}: holds run {h.run_id!r} (segment {h.seq}), but this run's launch log "
                        f"{path.parent / records.SEGMENTS_FILE} records {theirs} (runs {runs}): a "
                        f"file copied in from another run? Restore this run's own {path.name}")
