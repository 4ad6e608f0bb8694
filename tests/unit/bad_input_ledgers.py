"""Small, complete dump folders written through ``records.RecordWriter`` (no training),
and the ways a careless user breaks them. Used by ``test_bad_inputs.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from titan_ledger.format import records

CORPUS = Path(__file__).resolve().parents[2] / "titan_ledger" / "assets" / "corpus"
TOKENIZER = Path(__file__).resolve().parents[2] / "titan_ledger" / "assets" / "tokenizer"


def signal_row(step: int, *, loss: float | None = None, grad_norm: float | None = None,
               spike: bool = False, **over) -> dict:
    loss = 3.0 - 0.002 * step + 0.01 * math.sin(step) if loss is None else loss
    gn = 1.0 + 0.05 * math.sin(1.7 * step) if grad_norm is None else grad_norm
    row = {"step": step, "consumed_samples": 4 * step, "consumed_tokens": 1024 * step, "loss": loss,
           "loss_max": loss + 0.02, "loss_max_rank": step % 2, "grad_norm": gn,
           "grad_norm_clipped": min(gn, 1.0), "num_zeros": 0, "param_norm": 100.0 + 0.01 * step,
           "max_logit": 10.0 + 0.01 * step, "lr": 1e-3, "skipped": False, "skipped_samples": 0,
           "spike": spike, "update_skipped": False, "step_time_s": 0.1, "data_loading_s": 0.01}
    row.update(over)
    return row


def data_header(dp_rank: int, dp: int = 2, mbs: int = 2, seq_len: int = 256, fingerprint: str = "fp-a",
                run_id: str = "run-a", seq: int = 1, resumed_from: int = 0, **over) -> dict:
    hdr = {"schema": records.DATA.id, "run_id": run_id, "seq": seq, "resumed_from": resumed_from,
           "time": 1.0, "config_digest": "d1", "world_size": dp, "dp_size": dp, "dp_rank": dp_rank,
           "source_kind": "text", "source": f"text:stdlib_docs@{CORPUS}", "fingerprint": fingerprint,
           "mbs": mbs, "seq_len": seq_len,
           "spec": {"dataset": "stdlib_docs", "dataset_path": str(CORPUS), "seed": 1234},
           "global_batch": mbs * dp, "skip_lr": "freeze", "tokenizer": str(TOKENIZER), "skip_steps": []}
    hdr.update(over)
    return hdr


def data_rows(step: int, dp_rank: int, dp: int = 2, mbs: int = 2) -> dict:
    gb = mbs * dp
    ids = [(step - 1) * gb + dp_rank * mbs + j for j in range(mbs)]
    return {"step": step, "skipped": False, "rows": [[i, "stdlib_docs", [[i % 400, 0, 256]]] for i in ids]}


def make_run(dump: Path, *, steps: int = 30, dp: int = 2, mbs: int = 2, spike_at: int | None = 25,
             checkpoints: tuple[int, ...] = (10, 20), signals: bool = True, data: bool = True,
             seq_len: int = 256, fingerprint: str = "fp-a", skip: tuple[int, int] | None = None) -> Path:
    """A finished run: signals, spikes, data ledgers, launch log, complete checkpoints."""
    led = dump / "ledger"
    led.mkdir(parents=True, exist_ok=True)
    hdr = records.Header(schema="", run_id="run-a", seq=1, resumed_from=0, time=1.0,
                         extra={"config_digest": "d1", "world_size": dp, "dp_size": dp})
    records.append_segment(led, hdr)
    if signals:
        w = records.RecordWriter(led / records.SIGNALS_FILE,
                                 {**hdr.to_json(), "schema": records.SIGNALS.id})
        s = 1
        while s <= steps:
            if skip and s == skip[0]:
                w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": s, "last_step": skip[1],
                         "skip_lr": "freeze", "skipped": True, "lr": 1e-3, "consumed_samples": 4 * s,
                         "consumed_tokens": 0, "skipped_samples": 4, "update_skipped": False,
                         "step_time_s": 0.0, "data_loading_s": 0.0})
                s = skip[1] + 1
                continue
            if s == spike_at:
                w.write(signal_row(s, loss=3.6, grad_norm=10.0, spike=True, loss_max=3.7))
            else:
                w.write(signal_row(s))
            s += 1
        w.close()
        if spike_at:
            e = records.RecordWriter(led / records.SPIKES_FILE,
                                     {**hdr.to_json(), "schema": records.SPIKES.id})
            e.write({"step": spike_at, "rules": ["ratio"], "loss_max_rank": 1, "action": "none"})
            e.close()
    if data:
        for r in range(dp):
            w = records.RecordWriter(led / records.data_file(r),
                                     data_header(r, dp, mbs, seq_len=seq_len, fingerprint=fingerprint))
            for s in range(1, steps + 1):
                w.write(data_rows(s, r, dp, mbs))
            w.close()
    for c in checkpoints:
        d = dump / "checkpoint" / f"step-{c}"
        d.mkdir(parents=True, exist_ok=True)
        (d / ".metadata").write_bytes(b"dcp")
        (d / "__0_0.distcp").write_bytes(b"x")
    return dump


def write_lines(path: Path, *objs_or_raw) -> None:
    with open(path, "wb") as f:
        for o in objs_or_raw:
            f.write(o if isinstance(o, bytes) else (json.dumps(o) + "\n").encode())


def header_only(path: Path, schema: str, **extra) -> None:
    write_lines(path, {"schema": schema, "run_id": "run-a", "seq": 1, "resumed_from": 0, **extra})


def rewrite_headers(path: Path, **changes) -> None:
    """Set ``changes`` in every header line of ``path`` (rows unchanged)."""
    out = []
    for line in path.read_bytes().splitlines():
        obj = json.loads(line)
        if "schema" in obj:
            obj.update(changes)
        out.append(obj)
    write_lines(path, *out)


def bump_schema(path: Path, to: str) -> None:
    """Rewrite every header of ``path`` to schema ``to`` (a newer or foreign version)."""
    rewrite_headers(path, schema=to)


def cut_after(path: Path, n_bytes: int) -> None:
    path.write_bytes(path.read_bytes()[:n_bytes])


# --------------------------------------------------------------------------- issue 26: rows, runs, ranges
def replace_line(path: Path, lineno: int, raw: bytes) -> None:
    """Line ``lineno`` (1-based) of ``path`` becomes ``raw`` (a corrupt row mid-file)."""
    lines = path.read_bytes().splitlines(keepends=True)
    lines[lineno - 1] = raw if raw.endswith(b"\n") else raw + b"\n"
    path.write_bytes(b"".join(lines))


def tear(path: Path, partial: bytes = b'{"step": 31, "skipped": fa') -> None:
    """kill -9 mid-write: a row cut before its newline at the end of ``path``."""
    with open(path, "ab") as f:
        f.write(partial)


def resume_after_tear(dump: Path, name: str, header: dict, rows: list[dict]) -> None:
    """A torn last line, then the next launch (seq 2, resumed from step 20) appends its
    segment after it, as the trainer does (the launch log gets its row too)."""
    led = dump / "ledger"
    tear(led / name)
    hdr = {**header, "run_id": "run-a2", "seq": 2, "resumed_from": 20, "time": 2.0}
    records.append_segment(led, records.Header.from_json({**hdr, "schema": ""}))
    w = records.RecordWriter(led / name, hdr)
    for r in rows:
        w.write(r)
    w.close()


def other_run(path: Path, run_id: str = "run-b") -> None:
    """``path`` as written by another run: every header names ``run_id``."""
    rewrite_headers(path, run_id=run_id)


def make_indexed_run(dump: Path, corpus: Path, *, steps: int = 30, dp: int = 2, mbs: int = 2) -> Path:
    """A finished run (``make_run``) whose data ledger records an indexed corpus: a small
    corpus prepared into ``corpus/c`` (rows written out), samples 0..steps*dp*mbs-1."""
    from titan_ledger.data.prepare import load_tokenizer, prepare

    corpus.mkdir(parents=True, exist_ok=True)
    docs = corpus / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: " + "the quick brown fox jumps. " * 12})
                            + "\n" for i in range(60)))
    prepare([str(docs)], str(corpus / "c"), tokenizer=load_tokenizer(TOKENIZER), progress=False)
    make_run(dump, steps=steps, dp=dp, mbs=mbs, data=False)
    spec = {"paths": [str(corpus / "c")], "weights": [1.0], "seed": 1, "shuffle": True}
    for r in range(dp):
        rows = []
        for s in range(1, steps + 1):
            row = data_rows(s, r, dp, mbs)
            row["rows"] = [[i, "c", [[i % 60, 0, 64]]] for i, _, _ in row["rows"]]
            rows.append(row)
        write_lines(dump / "ledger" / records.data_file(r),
                    data_header(r, dp, mbs, seq_len=64, source_kind="indexed", source="indexed:c",
                                spec=spec), *rows)
    return dump
