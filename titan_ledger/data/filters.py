"""Loss masks on the batch: document quarantine and the repetition filter.

Design decision: a bad document is removed from training by masking its labels
(``IGNORE_INDEX``), not by changing what is read. The sample sequence, the sample
ids and every other row stay exactly as they were, so ``replay check`` against an
unquarantined run still matches, a resume after a spike can add a quarantine file
without it counting as a data change, and the masked tokens are simply not
trained (they drop out of the token counts, as any ignored label does). Both
filters work on one microbatch on the host, before the step counts its tokens:

* **quarantine**: documents named by ``(source, doc)`` -- the form ``lookup --json``
  and ``diagnose --write-quarantine`` print -- are masked wherever they appear;
* **repetition filter** (OLMo-core's instance filter rule): a document segment
  holding an n-gram of period 1..``max_period`` repeated at least ``min_repeats``
  times in a row is masked (vectorised over the batch: one comparison per period).

Each returns the ``(row, segment)`` pairs it masked, for the data ledger.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from titan_ledger.data.layout import RowTag
from titan_ledger.errors import ConfigError

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX (not imported: no torchtitan here)


class Quarantine:
    """The documents of ``--ledger.filter.quarantine`` files."""

    def __init__(self, paths: list[str]):
        self.paths = [str(p) for p in paths]
        self.docs: set[tuple[str, int]] = set()
        for p in self.paths:
            path = Path(p)
            if not path.is_file():
                raise ConfigError(f"--ledger.filter.quarantine {p}: no such file (write one with "
                                  f"python -m titan_ledger.diagnose DUMP --step T --write-quarantine {p})")
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    key = (str(obj["source"]), int(obj["doc"]))
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(f"--ledger.filter.quarantine {p}:{n}: expected one JSON object "
                                      f'{{"source": ..., "doc": ...}} per line, got {line[:80]!r}') from None
                self.docs.add(key)
        self.add(())

    def __bool__(self) -> bool:
        return bool(self.docs)

    def add(self, docs) -> None:
        """More documents, e.g. those a proof at the alarm convicted (``(source, doc)``)."""
        self.docs.update((str(s), int(d)) for s, d in docs)
        h = hashlib.sha256()
        for source, doc in sorted(self.docs):
            h.update(f"{source}\0{doc}\n".encode())
        self.digest = h.hexdigest()[:16] if self.docs else ""

    def mask(self, tags: list[RowTag], labels: torch.Tensor) -> list[list[int]]:
        """Set the labels of quarantined segments to IGNORE_INDEX in place; returns
        ``[[row, segment], ...]`` masked."""
        out = []
        for r, tag in enumerate(tags):
            start = 0
            for i, seg in enumerate(tag.segments):
                if (tag.source, seg.doc) in self.docs:
                    labels[r, start:start + len(seg)] = IGNORE_INDEX
                    out.append([r, i])
                start += len(seg)
        return out


def segment_index(positions: torch.Tensor) -> torch.Tensor:
    """[B, L] positions -> [B, L] index of the document segment within its row."""
    return torch.cumsum((positions == 0).to(torch.int64), dim=1) - 1


def repetitive_segments(tokens: torch.Tensor, positions: torch.Tensor, min_repeats: int = 32,
                        max_period: int = 13) -> torch.Tensor:
    """[B, L] bool: tokens of segments that hold an n-gram of period 1..max_period
    repeated >= min_repeats times in a row (OLMo-core's repetition rule).

    A period-p n-gram repeated R times is a run of ``(R - 1) * p`` consecutive
    positions with ``x[i] == x[i + p]``, all inside one segment.
    """
    b, length = tokens.shape
    seg = segment_index(positions)
    hit_seg = torch.zeros(b, length, dtype=torch.bool)
    for p in range(1, max_period + 1):
        need = (min_repeats - 1) * p
        if need >= length:
            break
        eq = (tokens[:, p:] == tokens[:, :-p]) & (seg[:, p:] == seg[:, :-p])
        # run length of consecutive True ending at each position
        c = torch.cumsum(eq.to(torch.int64), dim=1)
        reset = torch.where(eq, torch.zeros_like(c), c)
        run = c - torch.cummax(reset, dim=1).values
        ends = run >= need
        if ends.any():
            rows, cols = ends.nonzero(as_tuple=True)
            hit_seg[rows, cols] = True
    # a hit anywhere in a segment masks the whole segment
    seg_hit = torch.zeros(b, length + 1, dtype=torch.bool)
    seg_hit.scatter_(1, torch.where(hit_seg, seg, length), True)
    return torch.gather(seg_hit[:, :length], 1, seg)


def mask_repetitive(tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
                    min_repeats: int, max_period: int) -> list[list[int]]:
    """Mask repetitive segments' labels in place; returns ``[[row, segment], ...]``."""
    m = repetitive_segments(tokens, positions, min_repeats, max_period)
    if not m.any():
        return []
    labels[m] = IGNORE_INDEX
    seg = segment_index(positions)
    rows, cols = torch.where(m)
    return [list(x) for x in sorted({(int(r), int(seg[r, c])) for r, c in zip(rows, cols)})]
