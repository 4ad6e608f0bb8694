"""A run's ledgers as pyarrow tables: the way into pandas, polars and DuckDB.

Design decision: no second reader. :func:`signals_table` is the fast column read of
:mod:`titan_ledger.format.columns` (pyarrow's JSON reader, the one supersession rule of
:func:`records.supersession_masks`, the exact strict reader when pyarrow will not do),
checked the way :class:`~titan_ledger.format.reader.RunLedger` checks the file (its
run is the launch log's, its rows are signals rows); row for row and value for value
it is ``RunLedger.signal_rows()``, every column typed as :class:`records.SignalRow`
declares it. :func:`data_table` flattens what ``RunLedger.data.at(step, r)`` answers for
each DP rank, through ``DataLedger``'s public methods only. pyarrow comes with
``datasets`` (a dependency already); pandas, polars and DuckDB read the tables without
copying (``table.to_pandas()``, ``pl.from_arrow(table)``, DuckDB's replacement scans),
and ``python -m titan_ledger.export`` writes them as Parquet, CSV or Arrow files.

Example::

    from titan_ledger.format.arrow import data_table, signals_table

    df = signals_table("outputs/debug_cpu").to_pandas()   # one row per step or skipped window
    rows = data_table("outputs/debug_cpu", 8)            # step 8: one row per (DP rank, row, segment)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from titan_ledger.errors import LedgerCorrupt, LedgerError
from titan_ledger.format import columns, records
from titan_ledger.format.proofs import Proof
from titan_ledger.format.reader import SIGNAL_ROW_KEYS, RunLedger
from titan_ledger.format.run_identity import same_run

if TYPE_CHECKING:
    import pyarrow as pa

#: the columns of :func:`data_table`, and their kinds
DATA_COLUMNS = {"step": "int", "dp_rank": "int", "row": "int", "segment": "int", "sample_id": "int",
                "source": "str", "doc": "int", "start": "int", "end": "int", "skipped": "bool"}


def ledger_of(ledger: RunLedger | str | os.PathLike) -> RunLedger:
    """A :class:`RunLedger` as given, or of a dump folder or its ledger folder."""
    return ledger if isinstance(ledger, RunLedger) else RunLedger.at(ledger)


def signals_table(ledger: RunLedger | str | os.PathLike, keys: tuple[str, ...] | list[str] | None = None
                  ) -> pa.Table:
    """The current history of ``signals.jsonl`` (superseded rows left out; a skipped
    window is one row, ``step`` its first step, with ``last_step``) as a table of ``step``
    and ``keys`` (default: every column, :data:`columns.TABLE_KEYS`): ints int64, floats
    float64 (non-finite values as floats), bools, strings; null where a row has none.

    ``ledger``: a :class:`RunLedger`, a dump folder or a ledger folder."""
    led = ledger_of(ledger)
    path = led.folder / records.SIGNALS_FILE
    if not path.exists():
        raise LedgerError(f"{path}: no signals ledger; was the run trained with titan_ledger (and "
                          f"--ledger.signals on)?")
    headers: list[records.Header] = []
    table = columns.read_table(path, keys, headers)
    same_run(path, [records.FileSegment(h) for h in headers], led.launch_ids)
    first = next(records.rows_after(path, 0), None)
    lacking = [k for k in SIGNAL_ROW_KEYS if first is not None and k not in first]
    if lacking:  # the columns would be all null: an empty table that looks like a run
        raise LedgerCorrupt(f"{path}: step {first['step']} has no {', '.join(lacking)}: not a signals row "
                            f"of this titan_ledger (was the file edited or written by another tool?)")
    return table


def signal_columns(ledger: RunLedger | str | os.PathLike, keys: tuple[str, ...]
                   ) -> tuple[dict[str, np.ndarray], list[tuple[int, int]]]:
    """:func:`signals_table` as numpy columns of the trained rows (``step`` int64, each
    of ``keys`` float64, NaN for null) and the skipped windows ``(first, last)``: what
    plot draws (:func:`columns.trained_columns`)."""
    return columns.trained_columns(signals_table(ledger, (*keys, "skipped", "last_step")), keys)


def data_table(ledger: RunLedger | str | os.PathLike, step: int) -> pa.Table:
    """What each DP rank trained on (or consumed, in a skipped window) at ``step``: one
    row per (DP rank, row of its batch, segment of that row), with ``step``, ``dp_rank``,
    ``row``, ``segment``, ``sample_id``, ``source``, ``doc``, ``start``, ``end`` (token
    offsets into the document) and ``skipped``. LedgerError when no DP rank has the step,
    or when a DP rank of the run has no row for it (never a partial step as the whole)."""
    import pyarrow as pa

    led = ledger_of(ledger)
    data = led.data
    ranks = data.ranks_at(step)
    if not ranks:
        raise LedgerError(f"{led.folder}: no DP rank has a data-ledger row for step {step}")
    lost = data.missing_ranks(step)
    if lost:
        names = ", ".join(str(led.folder / records.data_file(r)) for r in lost)
        raise LedgerError(f"{names}: no row for step {step}, but the run had {len(lost) + len(ranks)} DP "
                          f"ranks (the file is missing, empty or cut); restore it")
    out: dict[str, list] = {k: [] for k in DATA_COLUMNS}
    for r in ranks:
        got = data.at(step, r)
        for i, tag in enumerate(got.tags):
            for j, seg in enumerate(tag.segments):
                for k, v in zip(DATA_COLUMNS, (step, r, i, j, tag.sample_id, tag.source, seg.doc, seg.start,
                                               seg.end, got.skipped)):
                    out[k].append(v)
    typed = {"int": pa.int64(), "str": pa.string(), "bool": pa.bool_()}
    return pa.table({k: pa.array(v, type=typed[DATA_COLUMNS[k]]) for k, v in out.items()})


# --------------------------------------------------------------------------- events, ranks, documents
#: the columns of :func:`spikes_table`: one row per spikes.jsonl event, its proof flattened
SPIKE_COLUMNS = {
    "step": "int", "kind": "str", "rules": "list", "notes": "list", "action": "str", "loss": "float",
    "grad_norm": "float", "suspect_dp_rank": "int", "loss_max_rank": "int",
    "proof_verdict": "str", "proof_applied": "str", "proof_would_apply": "str", "proof_held_back": "str",
    "proof_policy": "str", "proof_executions": "int", "proof_seconds": "float", "proof_documents": "list",
    "proof_adam_amplification": "float", "proof_window_from": "int", "proof_failed": "str",
    # the incident's answer (format.answers: the one record every view renders; render.columns)
    "answer_step": "int", "answer_title": "str", "answer_cause": "str", "answer_driver": "str",
    "answer_cause_text": "str", "answer_established": "str", "answer_separates": "bool", "answer_fix": "str",
    "answer_fix_effect": "str", "answer_fix_flags": "list", "answer_candidates": "list", "answer_command": "str",
    "answer_start": "str", "answer_not_proven": "str", "answer_did": "str", "answer_acting": "str", "ladder_action": "str", "rewind_to": "int", "breaker": "str", "stall_kind": "str",
    "response_failure": "str",
}


_NO_PROOF = {k: None for k in SPIKE_COLUMNS if k.startswith("proof_") and k != "proof_failed"}
_NO_ANSWER = {k: None for k in SPIKE_COLUMNS if k.startswith("answer_")}


def event_kind(e: dict) -> str:
    """What a spikes.jsonl event is (pure): ``spike``, ``note``, ``forced_proof``,
    ``ladder``, ``rewind``, ``breaker``, ``no_tokens``, ``stall``, ``response_failure``."""
    if "rules" in e:
        return "spike"
    if "notes" in e:
        return "note"
    for key, kind in (("ladder", "ladder"), ("rewind_to", "rewind"), ("breaker", "breaker"),
                      ("no_tokens", "no_tokens"), ("stall", "stall"), ("response_failure", "response_failure"),
                      ("forced", "forced_proof")):
        if e.get(key) is not None:
            return kind
    return "other"


def event_row(e: dict) -> dict:
    """One event as a :data:`SPIKE_COLUMNS` row (pure): the proof flattened into
    ``proof_*`` columns (the verdict, what was applied and what would have been, the
    executions, the documents as ``source:doc``, Adam's amplification, the window
    proof's snapshot step) and the incident's answer into ``answer_*`` columns (an
    acting flag's, a promoted note's; a stall's rides in its forced proof's event, with
    ``answer_step`` the stall's step)."""
    from titan_ledger.format.answers import Answer, render

    p = e.get("proof")
    a = Answer.of(e["answer"]) if isinstance(e.get("answer"), dict) else None
    return {
        "step": int(e["step"]), "kind": event_kind(e), "rules": list(e.get("rules") or []),
        "notes": list(e.get("notes") or []), "action": e.get("action") if not e.get("ladder") else None,
        "loss": e.get("loss"), "grad_norm": e.get("grad_norm"), "suspect_dp_rank": e.get("suspect_dp_rank"),
        "loss_max_rank": e.get("loss_max_rank"), **(Proof.of(p).columns() if p else _NO_PROOF),
        "proof_failed": (e.get("proof_failed") or {}).get("error"),
        "ladder_action": e.get("action") if e.get("ladder") else None, "rewind_to": e.get("rewind_to"),
        "breaker": e.get("breaker"), "stall_kind": (e.get("stall") or {}).get("kind"),
        "response_failure": (e.get("response_failure") or {}).get("error"),
        **({"answer_step": a.step, **render.columns(a)} if a is not None else _NO_ANSWER),
    }


def _typed(rows: dict[str, list], kinds: dict[str, str]) -> pa.Table:
    import pyarrow as pa

    def num(v, kind):
        if v is None or isinstance(v, bool):
            return v
        if kind == "int":
            return int(v) if isinstance(v, (int, float)) and v == v and abs(v) != float("inf") else None
        return float(v) if isinstance(v, (int, float)) else None  # (a non-finite value: a float)

    types = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_(),
             "list": pa.list_(pa.string())}
    cols = {}
    for k, kind in kinds.items():
        vals = rows[k] if kind in ("str", "bool", "list") else [num(v, kind) for v in rows[k]]
        cols[k] = pa.array(vals, type=types[kind])
    return pa.table(cols)


def spikes_table(ledger: RunLedger | str | os.PathLike) -> pa.Table:
    """Every event of ``spikes.jsonl`` (every launch's: an event log is never
    superseded), one row each, :data:`SPIKE_COLUMNS`: "which documents were quarantined,
    and when", "every step by verdict" are one query (docs/tools.md)."""
    led = ledger_of(ledger)
    path = led.folder / records.SPIKES_FILE
    events = records.read_ledger(path, records.SPIKES).history if path.exists() else []
    out: dict[str, list] = {k: [] for k in SPIKE_COLUMNS}
    for e in events:
        if "step" not in e:
            continue
        for k, v in event_row(e).items():
            out[k].append(v)
    return _typed(out, SPIKE_COLUMNS)


#: the columns of :func:`ranks_tables` and :func:`documents_tables`
RANK_COLUMNS = {"step": "int", "rank": "int", "loss": "float", "tokens": "int"}
DOC_COLUMNS = {"step": "int", "dp_rank": "int", "side": "str", "row": "int", "segment": "int", "source": "str",
               "doc": "int", "loss": "float", "tokens": "int"}


def ranks_tables(ledger: RunLedger | str | os.PathLike, first: int, last: int, chunk: int = 1000):
    """Each global rank's own loss and tokens (``rank<r>.jsonl``) over steps
    ``first``..``last``, as tables of at most ``chunk`` steps (through the offset index:
    memory bounded by a chunk, whatever the run's length or DP size)."""
    led = ledger_of(ledger)
    for a in range(first, last + 1, chunk):
        b = min(last, a + chunk - 1)
        out: dict[str, list] = {k: [] for k in RANK_COLUMNS}
        rows = led.rank_rows_between(a, b)
        for step in range(a, b + 1):
            for r in sorted(rows):
                for row in rows[r]:
                    if row["step"] == step:
                        for k, v in zip(RANK_COLUMNS, (step, r, row.get("loss"), row.get("tokens"))):
                            out[k].append(v)
        yield _typed(out, RANK_COLUMNS)


def documents_tables(ledger: RunLedger | str | os.PathLike, first: int, last: int, chunk: int = 100):
    """The per-document losses the data ledger recorded (each DP rank's highest and
    lowest segments a step, ``doc_loss``: ``side`` top or bottom) over ``first``..``last``,
    with each segment's document, in tables of at most ``chunk`` steps."""
    led = ledger_of(ledger)
    data = led.data
    for a in range(first, last + 1, chunk):
        out: dict[str, list] = {k: [] for k in DOC_COLUMNS}
        for step in range(a, min(last, a + chunk - 1) + 1):
            for r in data.ranks_at(step):
                raw = data.row(r, step) or {}
                dl = raw.get("doc_loss")
                if not dl or raw.get("skipped"):
                    continue
                tags = data.at(step, r).tags
                for side in ("top", "bottom"):
                    for row, seg, s, t in dl.get(side, []):
                        if row >= len(tags) or seg >= len(tags[row].segments):
                            continue
                        doc = tags[row].segments[seg].doc
                        for k, v in zip(DOC_COLUMNS, (step, r, side, row, seg, tags[row].source, doc,
                                                      s / t if t else None, t)):
                            out[k].append(v)
        yield _typed(out, DOC_COLUMNS)


def data_tables(ledger: RunLedger | str | os.PathLike, first: int, last: int):
    """:func:`data_table` for each step ``first``..``last`` the run has a row for (a
    table a step: memory bounded by one step)."""
    led = ledger_of(ledger)
    for step in range(first, last + 1):
        if led.data.ranks_at(step):
            yield data_table(led, step)


def episodes_table(ledger: RunLedger | str | os.PathLike) -> pa.Table:
    """The run's episodes, one row each, ``render.EPISODE_COLUMNS`` (the same words every view
    shows): "which episode, which cause, which command" is one query."""
    from titan_ledger.format.answers import render
    from titan_ledger.format.answers.of_run import RunAnswers

    kinds = render.EPISODE_COLUMNS
    rows: dict[str, list] = {k: [] for k in kinds}
    for ep in RunAnswers(ledger_of(ledger)).episodes():
        for k, v in render.episode_columns(ep).items():
            rows[k].append([str(x) for x in v] if kinds[k] == "list" and v is not None else v)
    return _typed(rows, kinds)

