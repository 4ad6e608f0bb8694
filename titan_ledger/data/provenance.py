"""Reading the data ledger: which samples each DP rank consumed at each step.

Design decision: the data ledger files (``data_dp<r>.jsonl``, one per DP rank,
``records.DATA_SCHEMA``) are the only record of what was trained; lookup, replay
and the spike tools read them through this module. Runs that resumed supersede
rows of lost runs *across files* (after a resume with fewer DP ranks, the files
of the ranks that no longer exist still hold rows of the lost run), so
supersession is decided over all files together, in order of segment start.
Skipped windows of an indexed corpus hold only the sample range; their rows are
derived from the corpus recorded in the header (sample id -> content is global).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_ledger import records
from titan_ledger.data.layout import RowTag

FILE_RE = re.compile(r"data_dp(\d+)\.jsonl$")


from titan_ledger.errors import LedgerError  # noqa: E402,F401  (one error hierarchy)


@dataclass
class StepData:
    step: int
    dp_rank: int
    skipped: bool
    tags: list[RowTag]
    window: tuple[int, int] | None = None


class DataLedger:
    """All ``data_dp*.jsonl`` of one dump folder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("data_dp*.jsonl"),
                       key=lambda p: int(FILE_RE.search(p.name).group(1)))
        if not files:
            raise LedgerError(f"{self.folder}: no data ledger (data_dp<r>.jsonl); was the run "
                              f"trained with LedgerDataLoader and --dataloader.tagging?")
        self.files = {int(FILE_RE.search(p.name).group(1)): p for p in files}
        parsed = {r: records.read_ledger(p, schema=records.DATA_SCHEMA) for r, p in self.files.items()}
        self.torn = {r: f.torn_lines for r, f in parsed.items() if f.torn_lines}
        segs = [(seg.header.get("time", 0.0), r, seg) for r, f in parsed.items() for seg in f.segments]
        segs.sort(key=lambda x: (x[0], x[1]))
        hist: dict[int, list[tuple[str, dict]]] = {r: [] for r in parsed}
        for _, r, seg in segs:
            run, resumed = seg.header.get("run_id"), seg.header.get("resumed_from")
            if resumed is not None:
                for rr in hist:  # a resume supersedes other runs' later rows in every file
                    hist[rr] = [(rid, row) for rid, row in hist[rr]
                                if rid == run or row["step"] <= resumed]
            hist[r] += [(run, row) for row in seg.rows]
        self.history = {r: [row for _, row in h] for r, h in hist.items()}
        self.headers = {r: f.segments[-1].header for r, f in parsed.items() if f.segments}
        self._by_step = {r: {row["step"]: row for row in h} for r, h in self.history.items()}
        self._windows = {r: [row for row in h if "last_step" in row] for r, h in self.history.items()}
        self._blend = None

    @property
    def last_step(self) -> int:
        return max((row.get("last_step", row["step"]) for h in self.history.values() for row in h),
                   default=0)

    def header(self) -> dict[str, Any]:
        """The most recent segment header (any rank)."""
        return max(self.headers.values(), key=lambda h: h.get("time", 0.0))

    def ranks_at(self, step: int) -> list[int]:
        return [r for r in sorted(self.history) if self._row(r, step) is not None]

    def _row(self, r: int, step: int) -> dict | None:
        row = self._by_step[r].get(step)
        if row is not None:
            return row
        for w in self._windows[r]:
            if w["step"] <= step <= w["last_step"]:
                return w
        return None

    def at(self, step: int, dp_rank: int) -> StepData | None:
        row = self._row(dp_rank, step)
        if row is None:
            return None
        if "last_step" not in row:
            return StepData(step, dp_rank, bool(row.get("skipped")),
                            [RowTag.from_json(t) for t in row["rows"]])
        hdr = self._header_for(dp_rank, row)
        per_step = hdr["global_batch"] // hdr["dp_size"]  # rows of one rank per step
        k = step - row["step"]
        if "rows" in row:
            tags = [RowTag.from_json(t) for t in row["rows"][k * per_step:(k + 1) * per_step]]
        else:
            tags = [self.blend(hdr).tag(i) for i in self.step_ids(hdr, row["samples"][0], k, dp_rank)]
        return StepData(step, dp_rank, True, tags, (row["step"], row["last_step"]))

    def ids_at(self, step: int, dp_rank: int) -> tuple[int, ...]:
        """Sample ids ``dp_rank`` consumed at ``step`` (no corpus access)."""
        row = self._row(dp_rank, step)
        if row is None:
            raise LedgerError(f"{self.folder}: no data for step {step} on DP rank {dp_rank}")
        if "last_step" not in row:
            return tuple(t[0] for t in row["rows"])
        hdr = self._header_for(dp_rank, row)
        k = step - row["step"]
        if "rows" in row:
            per_step = hdr["global_batch"] // hdr["dp_size"]
            return tuple(t[0] for t in row["rows"][k * per_step:(k + 1) * per_step])
        return tuple(self.step_ids(hdr, row["samples"][0], k, dp_rank))

    @staticmethod
    def step_ids(hdr: dict, window_start: int, k: int, dp_rank: int) -> list[int]:
        """Sample ids of ``dp_rank`` at the ``k``-th step after ``window_start`` (Megatron layout)."""
        mbs, dp, gb = hdr["mbs"], hdr["dp_size"], hdr["global_batch"]
        base = window_start + k * gb
        out = []
        for m in range(gb // (mbs * dp)):
            first = base + m * mbs * dp + dp_rank * mbs
            out.extend(range(first, first + mbs))
        return out

    def _header_for(self, r: int, row: dict) -> dict:
        # a window row carries the layout it was consumed with (the DP size may
        # have changed in a later segment)
        return {**self.headers[r], **row.get("layout", {})}

    def blend(self, hdr: dict | None = None):
        """The indexed corpus the run read (sample id -> content), opened offline."""
        if self._blend is None:
            hdr = hdr or self.header()
            if hdr.get("source_kind") != "indexed":
                raise LedgerError(f"{self.folder}: the run read a text stream; only indexed "
                                  f"corpora map sample ids to content offline")
            from titan_ledger.data.indexed import Blend, IndexedCorpus

            spec = hdr["spec"]
            corpora = [IndexedCorpus(p, hdr["seq_len"], spec["seed"], spec.get("cache_dir") or None,
                                     shuffle=spec.get("shuffle", True)) for p in spec["paths"]]
            self._blend = Blend(corpora, spec["weights"])
        return self._blend
