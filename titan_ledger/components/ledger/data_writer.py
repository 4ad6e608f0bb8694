"""The data-ledger writer: which samples this DP rank trained on, step by step.

Design decision: one file per DP rank (``data_dp<r>.jsonl``), written by the one
rank of that DP group with tp = cp = 0 on the first PP stage (``Topology``), so
a step's row is written once however the model is sharded. Host-only: the tags
come from the dataloader on the host, so writing costs no device work and no
synchronisation. A skipped window is one row holding its sample range (and
explicit rows for text streams, whose content is not a function of the id).

O(1) per step for deterministic sources: when the loader derives rows
(``LedgerDataLoader.derive_rows``: an indexed corpus) and the step's tags are
exactly the layout's sample ids, a trained step's row is ``{"step", "skipped":
false, "samples": [P, P + global_batch], "digest": <16 hex>}`` (+ ``doc_loss`` /
``masked``, which index the rows by position): the digest is ``step_digest`` of
the rows' token hashes, and ``reader.DataLedger`` derives the rows and checks it.
Injected steps (rehearsal) and anything else keep explicit ``rows``.
"""

from __future__ import annotations

from pathlib import Path

from torch.profiler import record_function

from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.topology import Topology
from titan_ledger.data.layout import RowTag, round_size, round_start, sample_id, step_digest
from titan_ledger.format import records


class DataLedgerWriter:
    def __init__(self, topo: Topology, loader, *, global_batch: int, skip_lr: str, tokenizer: str):
        self.topo = topo
        self.loader = loader  # a LedgerDataLoader with tagging on
        self.global_batch = global_batch
        self.skip_lr = skip_lr
        self.tokenizer = tokenizer
        self._writer: records.RecordWriter | None = None

    @property
    def active(self) -> bool:
        return self.topo.data_writer

    def open(self, folder: Path, header: records.Header, skip_windows: list[tuple[int, int]]) -> None:
        if not self.active:
            return
        extra = {**header.extra, **self.loader.header(), "global_batch": self.global_batch,
                 "skip_lr": self.skip_lr, "tokenizer": self.tokenizer,
                 "skip_steps": [list(w) for w in skip_windows]}
        self._writer = records.RecordWriter(
            folder / records.data_file(self.topo.dp_rank),
            records.Header(**{**header.__dict__, "schema": records.DATA.id, "extra": extra}))

    @property
    def rows_written(self) -> int:
        return self._writer.rows if self._writer is not None else 0

    def record(self, rec: StepRecord, doc_loss: dict | None = None) -> None:
        """This DP rank's rows of the step ``rec`` records; ``doc_loss`` (DocLossTracker.decode)
        adds the step's per-document summary: ``{"n", "n_valid", "median", "top", "bottom"}``
        with entries ``[row, segment, loss_sum, tokens]`` indexing ``rows``."""
        if self._writer is None:
            return
        with record_function("titan_ledger.data_write"):
            derived = None if rec.inject else self._derivable(rec.tags)
            self._writer.write(data_row(rec, derived, doc_loss))

    def _derivable(self, tags: list[RowTag]):
        """``([first, end), token hash)`` when ``tags`` are exactly the layout's sample ids
        of one step of a deterministic source (``loader.derive_rows``) and carry token
        hashes; else None (the rows are written out)."""
        loader = self.loader
        if not getattr(loader, "derive_rows", False) or not tags:
            return None
        mbs, dp, r = loader.mbs, self.topo.dp_size, self.topo.dp_rank
        if len(tags) * dp != self.global_batch or len(tags) % mbs:
            return None
        start = round_start(tags[0].sample_id, r, mbs)
        R = round_size(mbs, dp)
        if any(t.digest is None or t.sample_id != sample_id(start + (k // mbs) * R, r, mbs, k % mbs)
               for k, t in enumerate(tags)):
            return None
        return [start, start + self.global_batch], step_digest(t.digest for t in tags)

    def record_skip(self, *, first: int, last: int, info, why: str | None = None,
                    masked: dict | None = None) -> None:
        """A skipped window: ``info`` is the loader's SkipInfo (positions, tags); ``why``
        and ``masked``: a step consumed untrained because its masks left no token
        (``"no_tokens"``, and the masks as a trained step's row lists them)."""
        if self._writer is None:
            return
        row = {"step": first, "last_step": last, "skipped": True,
               "samples": [info.position_before, info.position_after],
               "layout": {"mbs": self.loader.mbs, "dp_size": self.topo.dp_size,
                          "global_batch": self.global_batch}}
        if info.tags is not None:
            row["rows"] = [t.to_json() for t in info.tags]
        if why is not None:
            row["why"] = why
        if masked:
            row["masked"] = masked
        self._writer.write(row)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def data_row(rec: StepRecord, derived: tuple[list[int], str] | None, doc_loss: dict | None) -> dict:
    """A trained step's ``data_dp<r>.jsonl`` row. Pure. ``derived``: ``([first, end), digest)``
    when the rows follow from the corpus (:meth:`DataLedgerWriter._derivable`)."""
    row = {"step": rec.step, "skipped": False}
    if derived is not None:
        row["samples"], row["digest"] = derived  # the rows follow from the corpus
    else:
        row["rows"] = [t.to_json() for t in rec.tags]
    if rec.inject:
        row["injected"] = rec.inject  # the rows' tokens were replaced (rehearsal)
    if doc_loss is not None:
        row["doc_loss"] = doc_loss
    masked = rec.masked_or_none()
    if masked:
        row["masked"] = masked  # {"quarantine" | "repetition": [[row, segment], ...]}
    return row
