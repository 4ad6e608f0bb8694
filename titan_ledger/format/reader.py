"""``RunLedger``: everything a run wrote, read one way, for every tool.

Design decision: lookup, replay, rollback, diagnose, plot (and the trainer, for
checkpoint lists and ``auto_skip``) read a dump folder only through this module.
It owns the *views* (signals history, per-DP-rank data, spike events, checkpoints,
the history as a superseded step saw it); the on-disk format and the
supersession rule belong to :mod:`titan_ledger.format.records`, the sample-id math to
:mod:`titan_ledger.data.layout`. Files are parsed lazily and once.

Example::

    led = RunLedger("outputs/debug_cpu")
    led.signal_rows()            # current history of signals.jsonl
    led.data.at(5, dp_rank=1)    # what DP rank 1 trained on at step 5
    led.spike_events()           # flagged steps (acting rules), never superseded
    led.note_events()            # note-only steps (recorded, not acted on)
    led.checkpoints()            # steps of complete DCP checkpoints
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any

from titan_ledger.errors import LedgerCorrupt, LedgerError
from titan_ledger.format import records
from titan_ledger.format.data_reader import DataLedger
from titan_ledger.format.run_identity import launch_ids, same_run

RANK_FILE_RE = re.compile(r"rank(\d+)\.jsonl$")
SIGNAL_ROW_KEYS = ("loss", "grad_norm", "lr", "skipped")  # what every reader of a signals row uses

def checkpoints(dump_folder: str | Path, folder: str = "checkpoint") -> list[int]:
    """Steps of complete DCP checkpoints under ``<dump_folder>/<folder>``.

    Complete means ``step-N/.metadata`` exists: DCP writes it last, after every
    rank's shard files, so a checkpoint killed mid-write has none and is never
    listed (and torchtitan's own ``load`` looks for the same file).
    """
    root = Path(dump_folder) / folder
    out = []
    for p in root.glob("step-*"):
        try:
            n = int(p.name.split("-", 1)[1])
        except ValueError:
            continue
        if (p / ".metadata").exists():
            out.append(n)
    return sorted(out)


def latest_data_header(ledger_folder: str | Path) -> records.Header | None:
    """The newest data-ledger segment header, read in O(1) of the ledger's length: the last
    segment of ``data_dp0.jsonl`` (every launch with tagging writes DP rank 0's file, and
    a launch's segments carry the largest seq so far), through its offset index. None
    when the folder has no readable data ledger. What a launch checks (the run folder's
    layout) reads this, never the history."""
    from titan_ledger.format import index

    files = records.data_files(ledger_folder)
    if not files:
        return None
    f = index.IndexedFile(files[min(files)], records.DATA, max(launch_ids(ledger_folder), default=None))
    try:
        segs = f.segments
    except LedgerError:
        return None
    return segs[-1].header if segs else None


class RunLedger:
    """The ledgers of one dump folder (``<dump_folder>/<ledger_folder>``)."""

    def __init__(self, dump_folder: str | Path, ledger_folder: str = "ledger",
                 checkpoint_folder: str = "checkpoint"):
        self.dump_folder = Path(dump_folder)
        self.folder = self.dump_folder / ledger_folder
        self.checkpoint_folder = checkpoint_folder
        if not self.dump_folder.is_dir():
            raise LedgerError(f"{self.dump_folder}: no such dump folder (pass the run's "
                              f"--dump_folder / --dump-folder)")

    @classmethod
    def at(cls, folder: str | Path) -> RunLedger:
        """From the ledger folder itself (``<dump>/ledger``) or the dump folder."""
        folder = Path(folder)
        if (folder / records.SIGNALS_FILE).exists() or any(folder.glob("data_dp*.jsonl")):
            return cls(folder.parent, folder.name)
        return cls(folder)

    # ------------------------------------------------------------------ signals
    @cached_property
    def signals(self) -> records.LedgerFile:
        path = self.folder / records.SIGNALS_FILE
        if not path.exists():
            raise LedgerError(f"{path}: no signals ledger; was the run trained with "
                              f"titan_ledger (and --ledger.signals on)?")
        led = records.read_ledger(path, records.SIGNALS)
        if not led.segments:
            raise LedgerError(f"{path}: empty (no header): the run died before its first step")
        same_run(path, led.segments, self.launch_ids)
        for seg in led.segments:  # every row, each named by its line
            for row, n in zip(seg.rows, seg.lines):
                if not all(k in row for k in SIGNAL_ROW_KEYS):
                    lacking = [k for k in SIGNAL_ROW_KEYS if k not in row]
                    raise LedgerCorrupt(f"{path}:{n}: step {row['step']} has no {', '.join(lacking)}: "
                                        f"not a signals row of this titan_ledger (was the file edited "
                                        f"or written by another tool?)")
        return led

    @cached_property
    def launch_ids(self) -> dict[int, str]:
        """``seq -> run id`` of every segment in the run's launch log (:func:`launch_ids`)."""
        return launch_ids(self.folder)

    def signal_rows(self) -> list[dict[str, Any]]:
        """Current history of ``signals.jsonl`` (superseded rows left out)."""
        return self.signals.history

    def param_dtype(self, step: int | None = None) -> str | None:
        """The compute dtype the last launch recorded (``float32``, ``bfloat16``) --
        with ``step``, the one of the launch that trained it -- or None for ledgers
        written before it was recorded."""
        hdr = self._launch_header(step)
        return hdr.get("param_dtype") if hdr else None

    def precision(self, step: int | None = None) -> list[dict[str, Any]] | None:
        """The precision audit's rows (``components.precision``) of the launch that
        trained ``step`` (default: the last launch); None before it was recorded."""
        hdr = self._launch_header(step)
        return hdr.get("precision") if hdr else None

    def _launch_header(self, step: int | None) -> records.Header | None:
        seg = self.segment_of(step) if step is not None else None
        if seg is not None:
            return seg.header
        segs = self.signals_index.segments
        return segs[-1].header if segs else None

    def segment_of(self, step: int) -> records.FileSegment | None:
        """The signals segment that last trained ``step`` (None: no segment did); its
        rows are that step's only (read through the offset index)."""

        f = self.signals_index
        for seg in sorted(f.segments, key=lambda s: (s.header.seq, s.file_pos), reverse=True):
            rows = [r for r in f.rows_at(seg, step) if r["step"] == step and not r.get("skipped")]
            if rows:
                return seg.as_file_segment(rows)
        return None

    # ------------------------------------------------------------------ signals, by window
    @cached_property
    def signals_index(self):
        """``signals.jsonl`` read by offsets (:class:`index.IndexedFile`), checked like
        :attr:`signals` on its headers: a point or window query reads O(log n) lines."""
        from titan_ledger.format import index

        path = self.folder / records.SIGNALS_FILE
        if not path.exists():
            raise LedgerError(f"{path}: no signals ledger; was the run trained with "
                              f"titan_ledger (and --ledger.signals on)?")
        f = index.IndexedFile(path, records.SIGNALS, max(self.launch_ids, default=None))
        if not f.segments:
            raise LedgerError(f"{path}: empty (no header): the run died before its first step")
        same_run(path, [s.as_file_segment() for s in f.segments], self.launch_ids)
        f.warn_torn()
        return f

    def signals_between(self, first: int, last: int, upto_segment: int | None = None) -> list[dict[str, Any]]:
        """The rows of the current signals history that cover a step in ``first``..``last``
        (``upto_segment``: the history as it stood after that segment, by file position),
        each checked like :attr:`signals` checks every row."""
        return self.signals_window(first, last, upto_segment)[0]

    def signals_window(self, first: int, last: int, upto_segment: int | None = None
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """:meth:`signals_between` and, beside it, the rows in that window a later resume or
        rollback superseded (each with ``superseded_by``), by :func:`records.resolve`."""

        f = self.signals_index
        segs = f.segments if upto_segment is None else f.segments[:upto_segment + 1]
        found = {0: [seg.as_file_segment(list(f.rows_between(seg, first, last)))
                     for seg in segs]}
        current, superseded = records.resolve(found)
        for row in [*current[0], *superseded]:
            if not all(k in row for k in SIGNAL_ROW_KEYS):
                self.signals  # noqa: B018 (the error path: the strict reading names FILE:LINE)
        return current[0], superseded

    def history_at(self, step: int, before: int, after: int) -> tuple[list[dict[str, Any]], bool] | None:
        """:meth:`rows_as_of` within ``step - before`` .. ``step + after``: the signals
        history as it stood when ``step`` ran, and whether that is the current history
        (False: a later rollback or resume superseded the step). None when no segment
        holds the step. Reads O(segments x log n) lines plus the window."""

        f = self.signals_index
        lo, hi = step - before, step + after
        cur = self.signals_between(step, step)
        if any(r["step"] == step and not r.get("skipped") for r in cur):
            return self.signals_between(lo, hi), True
        order = sorted(f.segments, key=lambda s: (s.header.seq, s.file_pos))
        at = [(seg, f.rows_at(seg, step)) for seg in order]
        trained = [seg for seg, rows in at if any(r["step"] == step and not r.get("skipped") for r in rows)]
        if not trained:
            if any(r["step"] == step for r in cur):  # never trained: its skipped row (as rows_as_of)
                return self.signals_between(lo, hi), True
            held = [seg for seg, rows in at if any(r["step"] == step for r in rows)]
            if not held:
                return None
            trained = held
        last = max(s.file_pos for s in trained)
        return self.signals_between(lo, hi, upto_segment=last), False

    def trained_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.signals.history if not r.get("skipped") and r.get("loss") is not None]

    def rows_as_of(self, step: int) -> list[dict[str, Any]] | None:
        """The signals history as it stood when ``step`` ran (see
        :meth:`records.LedgerFile.history_as_of`)."""
        return self.signals.history_as_of(step)

    def signal_columns(self, keys: tuple[str, ...]):
        """Numpy columns of the trained rows of the current history, and the skipped
        windows, for long ledgers (plot). Fast path with pyarrow; the same
        supersession rule."""
        from titan_ledger.format.columns import read_columns

        path = self.folder / records.SIGNALS_FILE
        headers: list[records.Header] = []
        out = read_columns(path, keys, headers)
        same_run(path, [records.FileSegment(h) for h in headers], self.launch_ids)
        return out

    # ------------------------------------------------------------------ events
    def _events(self, name: str, schema: records.Schema) -> list[dict[str, Any]]:
        path = self.folder / name
        if not path.exists():
            return []
        led = records.read_ledger(path, schema)
        if schema is not records.SEGMENTS:
            same_run(path, led.segments, self.launch_ids)
        return led.history

    def events(self) -> list[dict[str, Any]]:
        """Every event of ``spikes.jsonl`` of every launch (an event log is never superseded),
        in order: flags, notes, forced proofs, the response's own events."""
        return self._events(records.SPIKES_FILE, records.SPIKES)

    def event_log(self) -> records.LedgerFile | None:
        """``spikes.jsonl`` read whole and checked, with its segments (each launch's or rewind's
        header: where it resumed, the rules it ran); None when the run wrote none."""
        path = self.folder / records.SPIKES_FILE
        if not path.exists():
            return None
        led = records.read_ledger(path, records.SPIKES)
        same_run(path, led.segments, self.launch_ids)
        return led

    def spike_events(self) -> list[dict[str, Any]]:
        """Every flagged step of every launch (rows with ``rules``), in order."""
        return [e for e in self._events(records.SPIKES_FILE, records.SPIKES) if "rules" in e]

    def note_events(self) -> list[dict[str, Any]]:
        """Steps where only note-tier rules fired (``notes``, no ``rules``): recorded,
        never acted on. A spike's own notes ride in its event."""
        return [e for e in self._events(records.SPIKES_FILE, records.SPIKES) if "notes" in e and "rules" not in e]

    def proofs(self) -> list[tuple[int, dict[str, Any]]]:
        """Every proof at the alarm recorded, ``(step, proof)`` in order: spikes', notes' and
        forced ones' (a stall's proof is a forced one: ``proof["stall"]`` names its flag)."""
        return [(int(e["step"]), e["proof"]) for e in self._events(records.SPIKES_FILE, records.SPIKES)
                if e.get("proof") is not None and "step" in e]

    def spike_rules(self) -> dict[str, Any] | None:
        """The spike rules' settings the run recorded (``[ledger.spike]``, the newest
        spikes.jsonl header's ``rules``); None when it ran no rules. Offline tools read the
        run's own thresholds here instead of importing the rules (torch)."""
        path = self.folder / records.SPIKES_FILE
        if not path.exists():
            return None
        segs = records.read_ledger(path, records.SPIKES).segments
        rules = segs[-1].header.extra.get("rules") if segs else None
        return dict(rules) if isinstance(rules, dict) else None

    def proof_at(self, step: int) -> dict[str, Any] | None:
        """The proof at the alarm of ``step`` (the last one recorded: a rewound launch may
        prove it again), from its spike or note event or a forced proof's own event."""
        found = [e["proof"] for e in self._events(records.SPIKES_FILE, records.SPIKES)
                 if e.get("proof") is not None and int(e["step"]) == step]
        return found[-1] if found else None

    def response_events(self) -> list[dict[str, Any]]:
        """What the response recorded of itself in ``spikes.jsonl``: the circuit breaker's
        pauses and resumptions (``breaker``), steps consumed whole because every label
        was masked (``no_tokens``), failures inside the response outside a proof
        (``response_failure``; a failed proof is its step event's ``proof_failed``), and
        the stall rule's flags (``stall``: a run that stops learning or slowly diverges)."""
        keys = ("breaker", "no_tokens", "response_failure", "stall")
        return [e for e in self._events(records.SPIKES_FILE, records.SPIKES) if any(k in e for k in keys)]

    def rewinds(self) -> list[dict[str, Any]]:
        """In-process rollbacks (``rewind_to``) recorded in ``spikes.jsonl``."""
        return [e for e in self._events(records.SPIKES_FILE, records.SPIKES) if "rewind_to" in e]

    def ladder_actions(self) -> list[dict[str, Any]]:
        """The recovery ladder's decisions (``ladder``: the rung and action a flagged
        step got), recorded in ``spikes.jsonl``."""
        return [e for e in self._events(records.SPIKES_FILE, records.SPIKES) if e.get("ladder")]

    def spike_steps(self) -> list[int]:
        return sorted({int(e["step"]) for e in self.spike_events()})

    def rejected_steps(self) -> list[int]:
        """Steps flagged by any launch (``rejected_steps.jsonl``; the auto-skip list)."""
        return sorted({int(r["step"]) for r in self._events(records.REJECTED_FILE, records.REJECTED)
                       if "rules" in r})

    def launches(self) -> list[dict[str, Any]]:
        """The run's launch log: one row per segment (launch or rewind)."""
        return self._events(records.SEGMENTS_FILE, records.SEGMENTS)

    # ------------------------------------------------------------------ ranks, checkpoints
    def rank_rows(self) -> dict[int, list[dict[str, Any]]]:
        """Per global rank: its own loss and tokens per step (``rank<r>.jsonl``)."""
        files = {int(RANK_FILE_RE.search(p.name).group(1)): p
                 for p in self.folder.glob("rank*.jsonl") if RANK_FILE_RE.search(p.name)}
        segs, _ = records.read_many(files, records.RANK)
        for r, ss in segs.items():
            same_run(files[r], ss, self.launch_ids)
        current, _ = records.resolve(segs)
        return current

    def rank_rows_at(self, step: int) -> dict[int, dict[str, Any]]:
        """Per global rank: its own row of ``step`` as that step trained (the current
        history's, else -- a step a rollback or resume superseded -- the row of the
        last segment that trained it); ranks without one are left out. Reads the
        step's lines of each file through its offset index (O(log n) a file)."""
        from titan_ledger.format import index

        files = self._rank_index()
        current, every = index.point(files, step)
        out = {}
        for r in files:
            row = current.get(r)
            if row is None or row["step"] != step or row.get("skipped"):
                row = None
                for x in every.get(r, []):
                    if x["step"] == step and not x.get("skipped"):
                        row = x
            if row is not None:
                out[r] = row
        return out

    def _rank_index(self) -> dict:
        from titan_ledger.format import index

        if not hasattr(self, "_rank_files"):
            top = max(self.launch_ids, default=None)
            files = {r: index.IndexedFile(p, records.RANK, top) for r, p in records.rank_files(self.folder).items()}
            for f in files.values():
                same_run(f.path, [s.as_file_segment() for s in f.segments], self.launch_ids)
                f.warn_torn()
            self._rank_files = files
        return self._rank_files

    def rank_rows_between(self, first: int, last: int) -> dict[int, list[dict[str, Any]]]:
        """Per global rank, the current rows of steps ``first``..``last`` (``rank<r>.jsonl``),
        through the offset index: O(log n) a file plus the window."""
        from titan_ledger.format import index

        return index.between(self._rank_index(), first, last)

    def last_signal_step(self, windows: bool = False) -> int | None:
        """The last step of the current signals history (each segment's last current line,
        through the offset index): where a run stopped, without reading its history;
        ``windows``: a skipped window counts to its last step."""
        from titan_ledger.format import index

        path = self.folder / records.SIGNALS_FILE
        if not path.exists():
            return None
        f = index.IndexedFile(path, records.SIGNALS, max(self.launch_ids, default=None))
        lims = index.limits({0: f})
        last = [f.last_row(seg, lims[(0, seg.file_pos)]) for seg in f.segments]
        key = (lambda r: int(r.get("last_step", r["step"]))) if windows else (lambda r: int(r["step"]))
        return max((key(r) for r in last if r is not None), default=None)

    def checkpoints(self) -> list[int]:
        return checkpoints(self.dump_folder, self.checkpoint_folder)

    # ------------------------------------------------------------------ data
    @cached_property
    def data(self) -> DataLedger:
        return DataLedger(self.folder, self.launch_ids)
