"""What a DataLoader worker runs: batches of packed rows, each row tagged with where it came from.

Design decision: the unit a worker builds is a whole batch (``mbs`` rows of one DP rank),
and worker ``w`` of ``n`` builds the batches ``q`` with ``q % n == w`` -- the order torch's
DataLoader returns them in -- so ``num_workers`` 0 and 2 give the same sequence and no
document is read twice. :class:`Rows` starts at a sample position (and, for the text and
hf streams, a cursor) that ``LedgerDataLoader`` sets before every fresh iterator: the
loader's state is the position training consumed, never a worker's.

Its own module: this is the loader's only code that runs in the worker processes; the loader
(``titan_ledger.data.loader``) keeps the position, the state and the skip in the
process that trains. Each batch carries its rows' provenance (``RowTag``) beside the
tensors; the loader strips it before torchtitan sees the batch. The provenance work runs
inside ``torch.profiler.record_function(TAGGING_SPAN)`` spans (host only, no device sync),
so a profile can sum the ledger's data-side cost.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from titan_ledger.data.layout import RowTag, positions_of, round_size, row_digest, sample_id
from titan_ledger.data.text import Cursor

#: Profiler span around the data ledger's per-batch provenance work.
TAGGING_SPAN = "titan_ledger.tagging"


class Rows(IterableDataset):
    """Batches of ``mbs`` packed rows for one DP rank, from ``start_position``."""

    def __init__(self, kind: str, source, mbs: int, dp_rank: int, dp_size: int, tagging: bool):
        self.kind, self.source = kind, source
        self.mbs, self.dp_rank, self.dp_size, self.tagging = mbs, dp_rank, dp_size, tagging
        self.start_position = 0
        self.start_cursor = Cursor()

    def ids(self, position: int) -> list[int]:
        return [sample_id(position, self.dp_rank, self.mbs, j) for j in range(self.mbs)]

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        R = round_size(self.mbs, self.dp_size)
        if self.kind == "indexed":
            q = wid
            while True:
                rows = [self.source.row(i) for i in self.ids(self.start_position + q * R)]
                with torch.profiler.record_function(TAGGING_SPAN):
                    # (the blend builds each RowTag with its row); the token hash lets the
                    # data ledger store a step as (sample range, hash) and derive the rows
                    tags = ([RowTag(r[3].sample_id, r[3].source, r[3].segments,
                                    row_digest(r[0], r[1])) for r in rows]
                            if self.tagging else [r[3] for r in rows])
                yield self._collate([r[:3] for r in rows], tags, None)
                q += nw
        else:
            mbs = self.mbs
            # every worker walks the stream; only the owner of a batch builds it
            stream = self.source.rows(self.start_cursor, build=lambda k: (k // mbs) % nw == wid)
            q = 0
            while True:
                got = [next(stream) for _ in range(mbs)]
                if q % nw == wid:
                    with torch.profiler.record_function(TAGGING_SPAN):
                        ids = self.ids(self.start_position + q * R)
                        tags = [RowTag(i, self.source.name, g[0]) for i, g in zip(ids, got)]
                    yield self._collate([(g[2], g[3], None) for g in got], tags, got[-1][1])
                q += 1

    def _collate(self, rows, tags, cursor: Cursor | None):
        inputs = torch.as_tensor(np.asarray([r[0] for r in rows], dtype=np.int64))
        labels = torch.as_tensor(np.asarray([r[1] for r in rows], dtype=np.int64))
        if rows[0][2] is not None:
            positions = torch.as_tensor(np.asarray([r[2] for r in rows], dtype=np.int64))
        else:
            positions = torch.as_tensor(np.asarray([positions_of(t.segments) for t in tags],
                                                   dtype=np.int64))
        meta = {"tags": tags if self.tagging else None,
                "cursor": cursor.to_json() if cursor is not None else None}
        return {"input": inputs, "positions": positions}, labels, meta
