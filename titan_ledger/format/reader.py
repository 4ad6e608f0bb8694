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

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from titan_ledger.data.layout import RowTag, round_size, sample_id
from titan_ledger.errors import LedgerCorrupt, LedgerError
from titan_ledger.format import records

DATA_FILE_RE = re.compile(r"data_dp(\d+)\.jsonl$")
RANK_FILE_RE = re.compile(r"rank(\d+)\.jsonl$")
SIGNAL_ROW_KEYS = ("loss", "grad_norm", "lr", "skipped")  # what every reader of a signals row uses


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

    def recorded_answers(self) -> dict[int, dict[str, Any]]:
        """Every answer the trainer recorded (:mod:`titan_ledger.format.answers`), by the
        incident's step (a stall's answer rides in its forced proof's event); the last
        recorded for a step wins (a rewound launch answers it again)."""
        out: dict[int, dict[str, Any]] = {}
        for e in self._events(records.SPIKES_FILE, records.SPIKES):
            a = e.get("answer")
            if isinstance(a, dict) and "step" in a:
                out[int(a["step"])] = a
        return out

    def answer_context(self):
        """The run's context for an answer built offline (``format.answers.Context``): the
        latest launch's settings (``knobs``), flags, working directory, interpreter and world
        size, the checkpoints on disk."""
        from titan_ledger.format import answers

        rows = self.launches()
        last = next((r for r in reversed(rows) if isinstance(r.get("argv"), list)), rows[-1] if rows else {})
        knobs = next((r.get("knobs") for r in reversed(rows) if r.get("knobs")), None)
        rules = self.spike_rules() or {}
        return answers.Context(
            knobs=answers.Knobs.of(knobs), dump=str(self.dump_folder),
            argv=tuple(last["argv"]) if isinstance(last.get("argv"), list) else None, cwd=str(last.get("cwd") or ""),
            python=str(last.get("python") or "python"), world_size=int(last.get("world_size") or 1),
            checkpoints=tuple(self.checkpoints()), checkpoint_folder=self.checkpoint_folder,
            loss_jump=float(rules.get("loss_jump", 0.05)))

    def answer(self, step: int, tree: dict[str, Any] | None = None):
        """The answer to the incident at ``step`` (``format.answers.Answer``): the one the
        trainer recorded, else built now by the same function from the step's recorded event
        (a flag, or a stall no proof followed) and proof; ``tree`` (the decision tree's
        cause and certainty) adds candidates to an answer without a measured fix. None when
        nothing flagged the step."""
        from titan_ledger.format import answers

        rec = self.recorded_answers().get(int(step))
        if rec is not None:
            a = answers.Answer.of(rec)
            return answers.with_tree(a, tree, self.answer_context()) if tree and a.fix is None else a
        events = self._events(records.SPIKES_FILE, records.SPIKES)
        flag = next((e for e in reversed(events) if int(e.get("step", -1)) == step and "rules" in e), None)
        stall = next((e for e in reversed(events) if int(e.get("step", -1)) == step and e.get("stall")), None)
        if flag is None and stall is None:
            return None
        ctx = self.answer_context()
        if stall is not None and flag is None:
            proof = next((e["proof"] for e in reversed(events) if (e.get("proof") or {}).get("stall", {}).get("step")
                          == step), None)
            return answers.build(step, "stall", stall, proof, ctx, tree=tree)
        return answers.build(step, "spike", flag, flag.get("proof"), ctx, tree=tree,
                             unproven=(flag.get("proof_failed") or {}).get("error"))

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
