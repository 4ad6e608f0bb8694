"""``DataLedger``: what each DP rank trained on, read from ``data_dp<r>.jsonl``.

Design decision: the data ledger is read apart from the run's other files because its reads
are the expensive ones -- a DP-512 run has 512 files -- so it costs what the answer needs: a
step's rows by bisection through each file's offset index (:mod:`titan_ledger.format.index`),
a rank's history streamed, sample ids derived from the corpus the header records rather than
stored. :class:`~titan_ledger.format.reader.RunLedger` hands it out as ``led.data``; the
sample-id math belongs to :mod:`titan_ledger.data.layout`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from titan_ledger.data.layout import RowTag, round_size, sample_id
from titan_ledger.errors import LedgerCorrupt, LedgerError
from titan_ledger.format import records
from titan_ledger.format.run_identity import launch_ids, same_run


@dataclass
class StepData:
    step: int
    dp_rank: int
    skipped: bool
    tags: list[RowTag]
    window: tuple[int, int] | None = None


class DataLedger:
    """All ``data_dp<r>.jsonl`` of one ledger folder: what each DP rank consumed.

    Skipped windows of an indexed corpus hold only their sample range; their rows
    are derived from the corpus recorded in the header (sample id -> content is
    global). So are trained steps written as ``samples`` + ``digest``
    (``derived_tags``: the token hash is checked, a changed corpus is an error);
    rows written out (``rows``) are read as they are.

    Reads cost what the answer needs (:mod:`titan_ledger.format.index`): opening reads
    no rows; a step (:meth:`at`, :meth:`ids_at`, :meth:`trained_row`, ...) reads
    O(segments x log n) lines of each file; :meth:`iter_history` streams one rank's
    history. :attr:`history` / :attr:`superseded` (every row in memory) remain for
    small ledgers and tests.
    """

    def __init__(self, folder: str | Path, launches: dict[int, str] | None = None):
        from titan_ledger.format import index

        self.folder = Path(folder)
        files = records.data_files(self.folder)
        if not files:
            raise LedgerError(f"{self.folder}: no data ledger (data_dp<r>.jsonl); was the run "
                              f"trained with LedgerDataLoader and --dataloader.tagging?")
        self.files = dict(sorted(files.items()))
        self._launches = launch_ids(self.folder) if launches is None else launches
        top = max(self._launches, default=None)
        self._idx = {r: index.IndexedFile(p, records.DATA, top) for r, p in self.files.items()}
        self._checked: dict[int, list] | None = None
        self._row_dp: dict[int, int] = {}  # id(row) -> the DP size of the segment that wrote it
        self._row_hdr: dict[int, Any] = {}  # id(row) -> the header of the segment that wrote it
        self._steps: dict[int, tuple[dict, dict]] = {}  # step -> (current, every segment's), by rank
        self._blend = None
        self._hdr_cache: dict[tuple, tuple] = {}  # (header, a window's layout) -> the merged dict
        self.segments  # noqa: B018 (a lost or foreign file is refused on opening, as before)

    # ------------------------------------------------------------------ segments (O(1) in rows)
    @property
    def segments(self) -> dict[int, list]:
        """Every file's segments (:class:`index.Segment`: header and byte range), checked
        once: a file without a header is lost, a file of another run is named."""
        if self._checked is None:
            segs = {r: f.segments for r, f in self._idx.items()}
            for f in self._idx.values():
                f.warn_torn()  # each segment's last line: O(segments), as the strict reading warns
            empty = [str(self.files[r]) for r, s in segs.items() if not s]
            if empty:
                raise LedgerError(f"data ledger file(s) {', '.join(empty)}: empty or torn before the "
                                  f"first header; that rank's record is lost (was the folder copied "
                                  f"while a run wrote it?)")
            launches = self._launches
            for r, ss in segs.items():  # a file of another run is named, not blamed on its siblings
                same_run(self.files[r], [s.as_file_segment() for s in ss], launches)
            self._checked = segs
        return self._checked

    @cached_property
    def headers(self) -> dict[int, records.Header]:
        """Each DP rank's latest segment header."""
        return {r: ss[-1].header for r, ss in self.segments.items()}

    def bytes_read(self) -> int:
        """Bytes read from the data ledger so far (what the complexity tests count)."""
        return sum(f.bytes_read for f in self._idx.values())

    def _limits(self):
        from titan_ledger.format import index

        if not hasattr(self, "_lims"):
            self.segments  # noqa: B018 (checked first)
            self._lims = index.limits(self._idx)
        return self._lims

    # ------------------------------------------------------------------ one step
    def _at_step(self, step: int) -> tuple[dict[int, dict], dict[int, list[dict]]]:
        """Every rank's rows covering ``step``: the current one, and one per segment that
        covers it (in run order); the supersession rule is :func:`records.resolve`'s."""
        got = self._steps.get(step)
        if got is None:

            found = {}
            for r, f in self._idx.items():
                segs = []
                for seg in self.segments[r]:
                    rows = f.rows_at(seg, step)
                    dp = int(seg.header.get("dp_size") or 0)
                    for row in rows:
                        if not isinstance(row.get("rows", row.get("samples")), list):
                            self._whole  # noqa: B018 (the error path: the strict reading names FILE:LINE)
                        self._row_dp[id(row)] = dp
                        self._row_hdr[id(row)] = seg.header
                    segs.append(seg.as_file_segment(rows))
                found[r] = segs
            current, _ = records.resolve(found)
            every = {r: [x for seg in sorted(ss, key=records.order_key) for x in seg.rows]
                     for r, ss in found.items()}
            got = ({r: rows[-1] for r, rows in current.items() if rows}, every)
            if len(self._steps) > 64:
                self._steps.clear()
            self._steps[step] = got
        return got

    # ------------------------------------------------------------------ whole history
    def iter_history(self, dp_rank: int):
        """``dp_rank``'s current history, row by row (memory O(1) in the run's length)."""
        from titan_ledger.format import index

        for seg, row in index.iter_history(self._idx, dp_rank, self._limits()):
            self._row_hdr[id(row)] = seg.header
            yield row

    @cached_property
    def _whole(self):
        """Every row of every file in memory (small ledgers, tests; the streaming readers
        use :meth:`iter_history`)."""
        segs, torn = records.read_many(self.files, records.DATA)
        self.segments  # noqa: B018 (the same checks)
        for r, ss in segs.items():
            for seg in ss:
                dp = int(seg.header.get("dp_size") or 0)
                for row, n in zip(seg.rows, seg.lines):
                    if not isinstance(row.get("rows", row.get("samples")), list):
                        raise LedgerCorrupt(f"{self.files[r]}:{n}: step {row['step']} has neither "
                                            f"'rows' nor 'samples': not a data-ledger row of this "
                                            f"titan_ledger (was the file edited?)")
                    self._row_dp[id(row)] = dp
                    self._row_hdr[id(row)] = seg.header
        history, superseded = records.resolve(segs)
        return history, superseded, {r: n for r, n in torn.items() if n}

    @property
    def history(self) -> dict[int, list[dict]]:
        """Per DP rank, the current history (every row in memory)."""
        return self._whole[0]

    @property
    def superseded(self) -> list[dict]:
        return self._whole[1]

    @property
    def torn(self) -> dict[int, int]:
        """DP ranks whose file has torn lines (a kill -9 mid-write): how many (each
        segment's last line is read, not the history)."""
        return {r: len(t) for r, f in self._idx.items() if (t := f.torn())}

    def forget(self) -> None:
        """Drop what reading steps remembered (a streaming reader calls it between chunks)."""
        self._row_dp.clear()
        self._row_hdr.clear()
        self._steps.clear()

    def _ends(self):
        """Per segment of every file: its first row and its last current row (by
        bisection): what the run's extent and sample range need, O(segments x log n)."""
        if not hasattr(self, "_seg_ends"):

            lims, out = self._limits(), []
            for r, f in self._idx.items():
                for seg in self.segments[r]:
                    first = f.first_row(seg)
                    last = f.last_row(seg)
                    cur = f.last_row(seg, lims[(r, seg.file_pos)])
                    out.append((r, seg, first, last, cur))
            self._seg_ends = out
        return self._seg_ends

    def last_step_of(self, dp_rank: int) -> int:
        """The last step ``dp_rank``'s current history covers (0: none)."""
        return max((row.get("last_step", row["step"]) for r, _, _, _, row in self._ends()
                    if r == dp_rank and row), default=0)

    @property
    def last_step(self) -> int:
        """The last step the current history covers (any DP rank)."""
        return max((row.get("last_step", row["step"]) for _, _, _, _, row in self._ends() if row),
                   default=0)

    @cached_property
    def sample_range(self) -> tuple[int, int] | None:
        """``(first, last)`` sample id the data ledger records as consumed (trained or
        skipped, by any DP rank, rows of rolled-back launches included); None if none.
        Within a segment sample ids grow with the step, so its first and last rows bound it."""
        lo = hi = None
        for _, _, first, last, _ in self._ends():
            for row in (first, last):
                ids = _sample_ids(row) if row is not None else ()
                if ids:
                    lo = min(ids) if lo is None else min(lo, *ids)
                    hi = max(ids) if hi is None else max(hi, *ids)
        return None if lo is None else (lo, hi)

    def sample(self, sample_id: int) -> RowTag:
        """What global sample ``sample_id`` holds, from the corpus the run read (indexed
        corpora): the one way a sample id given by a user resolves to documents. The id
        is checked against :attr:`sample_range` first, so a sample outside the run gets
        no answer -- and no corpus epoch cache is written for it."""
        rng = self.sample_range
        if rng is None or not rng[0] <= sample_id <= rng[1]:
            held = f"samples {rng[0]}-{rng[1]}" if rng else "no sample ids"
            raise LedgerError(f"sample {sample_id}: outside the run: it consumed {held} (steps "
                              f"1-{self.last_step}, {self.folder}); give a sample id in that range")
        return self.blend().tag(sample_id)

    def header(self) -> records.Header:
        """The most recent segment header (any rank)."""
        return max(self.headers.values(), key=lambda h: (h.seq or 0, h.time))

    def ranks(self) -> list[int]:
        return sorted(self.files)

    def ranks_at(self, step: int) -> list[int]:
        return sorted(self._at_step(step)[0])

    def _has_rows(self, r: int) -> bool:
        return any(row is not None for rr, _, _, _, row in self._ends() if rr == r)

    def missing_ranks(self, step: int | None = None) -> list[int]:
        """DP ranks whose record is missing: at ``step``, the ranks of the DP size that
        ran it without a row there (a deleted, empty or cut file); without ``step``,
        the ranks of the latest DP size with no file or no row at all."""
        if step is None:
            dp = int(self.header().get("dp_size") or 0)
            return [r for r in range(dp) if r not in self.files or not self._has_rows(r)]
        current = self._at_step(step)[0]
        dp = max((self._row_dp.get(id(row), 0) for row in current.values()), default=0)
        return [r for r in range(dp) if r not in current]

    def require_complete(self) -> None:
        """LedgerError naming the files if a DP rank of the run has no record."""
        missing = self.missing_ranks()
        if missing:
            names = ", ".join(str(self.folder / records.data_file(r)) for r in missing)
            raise LedgerError(f"{names}: missing or without rows, but the run had "
                              f"{self.header().get('dp_size')} DP ranks: that rank's record is lost "
                              f"(restore the file from the run's dump folder)")

    def row(self, dp_rank: int, step: int) -> dict | None:
        """The raw current row covering ``step`` on ``dp_rank`` (a step or a window)."""
        return self._row(dp_rank, step)

    def _row(self, r: int, step: int) -> dict | None:
        return self._at_step(step)[0].get(r)

    def at(self, step: int, dp_rank: int) -> StepData | None:
        if dp_rank not in self.files:
            raise LedgerError(f"{self.folder}: no data ledger for DP rank {dp_rank} (the run has "
                              f"DP ranks {self.ranks()})")
        row = self._row(dp_rank, step)
        if row is None:
            return None
        if "last_step" not in row:
            if "rows" not in row:  # (sample range, token hash): derived from the corpus
                return StepData(step, dp_rank, bool(row.get("skipped")),
                                self.derived_tags(step, dp_rank, row))
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

    def trained_row(self, dp_rank: int, step: int) -> dict | None:
        """The raw row with which ``dp_rank`` TRAINED ``step``: the current history's,
        else -- a step a rollback or resume superseded (now skipped, or trained again
        on other data) -- the row of the last segment that trained it; None when no
        segment trained it."""
        current, every = self._at_step(step)
        row = current.get(dp_rank)
        if row is not None and not row.get("skipped") and "last_step" not in row:
            return row
        found = None
        for x in every.get(dp_rank, []):
            if x["step"] == step and not x.get("skipped") and "last_step" not in x:
                found = x
        return found

    def injected_at(self, step: int) -> dict[int, str]:
        """``{dp_rank: kind}`` of the DP ranks whose batch at ``step`` (as it trained)
        was replaced by ``--ledger.rehearsal.inject`` (repeat, random): its tags name
        the documents the loader assigned, which never trained."""
        out = {}
        for r in sorted(self.files):
            row = self.trained_row(r, step)
            if row is not None and row.get("injected"):
                out[r] = str(row["injected"])
        return out

    def doc_losses(self, step: int) -> tuple[list[dict[str, Any]], float | None]:
        """The per-document losses recorded at ``step`` on every DP rank (each rank's
        highest- and lowest-loss segments, ``--ledger.doc_loss.k`` of each), as dicts
        with the segment's provenance, and the step's median segment loss (the median
        of the DP ranks' medians). Empty when the run recorded none. A step a rollback
        superseded is read as it trained (:meth:`trained_row`)."""
        out, medians = [], []
        for r in sorted(self.files):
            row = self.trained_row(r, step)
            dl = row.get("doc_loss") if row is not None and "last_step" not in row else None
            if not dl:
                continue
            if dl.get("median") is not None:
                medians.append(dl["median"])
            tags = (self.derived_tags(step, r, row) if "rows" not in row
                    else [RowTag.from_json(t) for t in row["rows"]])
            seen = set()
            for side in ("top", "bottom"):
                for i, seg, loss_sum, tokens in dl.get(side, []):
                    if (i, seg) in seen or i >= len(tags) or seg >= len(tags[i].segments):
                        continue
                    seen.add((i, seg))
                    s = tags[i].segments[seg]
                    out.append({"dp_rank": r, "row": i, "segment": seg, "sample_id": tags[i].sample_id,
                                "source": tags[i].source, "doc": s.doc, "start": s.start, "end": s.end,
                                "loss": loss_sum / tokens if tokens else None, "loss_sum": loss_sum,
                                "tokens": tokens})
        medians.sort()
        median = None
        if medians:
            m = len(medians) // 2
            median = medians[m] if len(medians) % 2 else (medians[m - 1] + medians[m]) / 2
        return out, median

    def ids_at(self, step: int, dp_rank: int) -> tuple[int, ...]:
        """Sample ids ``dp_rank`` consumed at ``step`` (no corpus access)."""
        row = self._row(dp_rank, step)
        if row is None:
            raise LedgerError(f"{self.folder}: no data for step {step} on DP rank {dp_rank}")
        return self.ids_in(row, step, dp_rank)

    def ids_in(self, row: dict, step: int, dp_rank: int) -> tuple[int, ...]:
        """Sample ids of ``step`` in ``row`` (its step row, or the window holding it)."""
        if "last_step" not in row and "rows" not in row:  # a derived step row
            return tuple(self.step_ids(self._header_for(dp_rank, row), row["samples"][0], 0, dp_rank))
        if "last_step" not in row:
            return tuple(t[0] for t in row["rows"])
        hdr = self._header_for(dp_rank, row)
        k = step - row["step"]
        if "rows" in row:
            per_step = hdr["global_batch"] // hdr["dp_size"]
            return tuple(t[0] for t in row["rows"][k * per_step:(k + 1) * per_step])
        return tuple(self.step_ids(hdr, row["samples"][0], k, dp_rank))

    def rows_between(self, first: int, last: int) -> dict[int, list[dict]]:
        """Per DP rank, the current rows covering a step in ``first``..``last``, in order
        (the supersession rule is :func:`records.resolve`'s), through the offset index."""

        found = {}
        for r, f in self._idx.items():
            segs = []
            for seg in self.segments[r]:
                rows = list(f.rows_between(seg, first, last))
                for row in rows:
                    self._row_hdr[id(row)] = seg.header
                    self._row_dp[id(row)] = int(seg.header.get("dp_size") or 0)
                segs.append(seg.as_file_segment(rows))
            found[r] = segs
        current, _ = records.resolve(found)
        return current

    def derived_tags(self, step: int, dp_rank: int, row: dict, verify: bool = True) -> list[RowTag]:
        """The rows of a trained step stored as ``samples`` + ``digest`` (an indexed
        corpus, ``--dataloader.derive_rows``): derived from (corpus, seed, sample id)
        like a skipped window's, and -- ``verify`` -- their tokens hashed again and
        compared with the hash the run recorded, so a corpus changed since the run is
        caught (``LedgerError`` naming the step and the corpus) instead of misreported."""
        from titan_ledger.data.layout import row_digest, step_digest

        hdr = self._header_for(dp_rank, row)
        blend = self.blend(hdr)
        ids = self.step_ids(hdr, row["samples"][0], 0, dp_rank)
        if not verify or "digest" not in row:
            return [blend.tag(i) for i in ids]
        tags, digests = [], []
        for i in ids:
            inputs, labels, _, tag = blend.row(i)
            tags.append(tag)
            digests.append(row_digest(inputs, labels))
        got = step_digest(digests)
        if got != row["digest"]:
            paths = ", ".join(str(p) for p in hdr["spec"]["paths"])
            raise LedgerError(
                f"{self.files[dp_rank]}: step {step}, DP rank {dp_rank}: the corpus gives other "
                f"tokens for samples {ids[0]}..{ids[-1]} than the run trained (token hash "
                f"{row['digest']} recorded, {got} now): {paths} changed since the run (re-prepared "
                f"with another tokenizer or input?); restore the corpus the run read")
        return tags

    @staticmethod
    def step_ids(hdr, window_start: int, k: int, dp_rank: int) -> list[int]:
        """Sample ids of ``dp_rank`` at the ``k``-th step after ``window_start``: a step
        is ``global_batch / (mbs * dp)`` rounds of the layout's sample ids."""
        mbs, dp, gb = hdr["mbs"], hdr["dp_size"], hdr["global_batch"]
        base = window_start + k * gb
        rs = round_size(mbs, dp)
        first = sample_id(0, dp_rank, mbs, 0)  # the layout's offset of the rank's first row
        out = []
        for m in range(gb // rs):  # a round's rows of one rank are consecutive ids
            out.extend(range(base + m * rs + first, base + m * rs + first + mbs))
        return out

    def _header_for(self, r: int, row: dict) -> dict:
        # a window row carries the layout it was consumed with (the DP size may
        # have changed in a later segment); a derived step row has its segment's
        hdr = self._row_hdr.get(id(row), self.headers[r]) if "last_step" not in row else self.headers[r]
        key = (id(hdr), json.dumps(row["layout"], sort_keys=True) if "layout" in row else "")
        got = self._hdr_cache.get(key)
        if got is None or got[0] is not hdr:
            got = self._hdr_cache[key] = (hdr, {**hdr.as_dict(), **row.get("layout", {})})
        return got[1]

    def blend(self, hdr=None):
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
            # a ledger recorded before the Megatron-exact blend names rule 1 (or none)
            self._blend = Blend(corpora, spec["weights"], rule=spec.get("blend_rule") or 1)
        return self._blend


def _sample_ids(row: dict) -> tuple[int, ...]:
    got = row.get("samples")
    if isinstance(got, list) and len(got) == 2 and all(isinstance(i, int) for i in got):
        return (got[0], got[1] - 1)
    return tuple(t[0] for t in row.get("rows") or () if isinstance(t, list) and t and isinstance(t[0], int))


EXPAND_LIMIT = 100_000  # steps of a skipped window expanded step by step when comparing


def step_ids(ledger: DataLedger) -> dict[int, dict[int, tuple]]:
    """{step: {dp_rank: sample ids}} of a whole data ledger (what ``replay check`` and the
    rerun compare; per step, :meth:`DataLedger.ids_at`); a skipped window longer than
    ``EXPAND_LIMIT`` steps stays one ``("window", last_step, samples)`` key. Memory grows
    with the run: long ledgers are compared in chunks (:func:`step_ids_between`)."""
    return step_ids_between(ledger, 1, max(ledger.last_step, 1))


def step_ids_between(ledger: DataLedger, first: int, last: int) -> dict[int, dict[int, tuple]]:
    """:func:`step_ids` of steps ``first``..``last`` only, read through the offset index
    (O(log n) a file plus the rows of the range)."""
    return _expand(ledger, ledger.rows_between(first, last), first, last)


def stream_step_ids(ledger: DataLedger, chunk: int, stop: int | None = None):
    """:func:`step_ids` of the whole ledger, ``(first, last, ids)`` a chunk of ``chunk``
    steps at a time, every file read once, forward (:class:`index.Cursor`): memory is a
    chunk's, whatever the run's length (``replay check``)."""
    from titan_ledger.format import index

    lims = ledger._limits()
    cursors = {r: index.Cursor(f, r, lims) for r, f in ledger._idx.items()}
    stop = ledger.last_step if stop is None else stop
    for first in range(1, stop + 1, chunk):
        last = min(stop, first + chunk - 1)
        ledger.forget()
        rows = {}
        for r, c in cursors.items():
            got = c.take(last)
            for seg, row in got:
                ledger._row_hdr[id(row)] = seg.header
            rows[r] = [row for _, row in got]
        yield first, last, _expand(ledger, rows, first, last)


def _expand(ledger: DataLedger, rows_by_rank: dict[int, list[dict]], first: int, last: int
            ) -> dict[int, dict[int, tuple]]:
    out: dict[int, dict[int, tuple]] = {}
    for r, rows in rows_by_rank.items():
        for row in rows:
            step, end = row["step"], row.get("last_step", row["step"])
            if end - step + 1 > EXPAND_LIMIT:
                if first <= step <= last:
                    out.setdefault(step, {})[r] = ("window", end, tuple(row["samples"]))
                continue
            for s in range(max(step, first), min(end, last) + 1):
                ids = ledger.ids_in(row, s, r)
                # a skipped step consumed its samples but trained none: not the same history
                out.setdefault(s, {})[r] = ("skipped", *ids) if row.get("skipped") else ids
    return out
