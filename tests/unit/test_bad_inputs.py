"""Issue 18: every bad input is ONE clear stderr line and the documented exit code.

One table of what careless users do to every tool (lookup, diagnose, plot, rollback,
replay, prepare, the trainer's config parsing and ``titan_ledger.launch``): missing,
empty, torn, garbage, foreign and newer-schema ledgers, lost DP ranks, out-of-range
steps, ranks and samples, bad flags and TOML, bad corpora and prepare inputs. Each
case runs the tool's ``main(argv)`` in-process on a small dump folder written through
``records.RecordWriter`` (no training) and asserts:

* the exit code from the one table (README "Exit codes"; ``titan_ledger.errors``):
  0 ok, 1 a negative answer, 2 bad input;
* for 2: exactly ONE stderr line, ``titan_ledger.<tool>: error: ...``, naming the
  file, flag or key (the case's substrings), no traceback, nothing on stdout, and
  nothing written: no file under the case's folder is created or changed (an output,
  a corpus epoch cache);
* for 0/1: the answer on stdout, at most one ``warning`` line on stderr -- and exactly
  that line, ``titan_ledger.<tool>: warning: ...``, for a substring ``warning:X``.

The trainer's cases parse the config exactly as ``titan_ledger.train.main`` does
(``load_config`` under WORLD_SIZE=2) with training replaced by a failure, so a
config that would train fails the test instead of training.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_ledger.errors import ConfigError, TitanLedgerError, fail_line
from titan_ledger.format import records

from .bad_input_ledgers import (
    bump_schema,
    cut_after,
    data_header,
    data_rows,
    header_only,
    make_indexed_run,
    make_run,
    other_run,
    replace_line,
    resume_after_tear,
    signal_row,
    tear,
    write_lines,
)

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "train_configs" / "debug_cpu.toml")
D, S = records.DATA.id, records.SIGNALS.id


# --------------------------------------------------------------------------- setups
def run(t):
    return make_run(t / "run")


def led(t):
    return t / "run" / "ledger"


def with_run(fn=None, **kw):
    """Setup: a complete run at t/run (``make_run(**kw)``), then ``fn(ledger_folder, t)``."""
    def setup(t):
        make_run(t / "run", **kw)
        if fn is not None:
            fn(led(t), t)
    return setup


def debug_fingerprint() -> str:
    """The data fingerprint debug_cpu.toml's run has (the bundled corpus and tokenizer, seq 256)."""
    from titan_ledger.data.inputs import data_fingerprint
    from titan_ledger.data.loader import LedgerDataLoader
    from titan_ledger.data.prepare import default_tokenizer_dir, load_tokenizer

    corpus = ROOT / "titan_ledger" / "assets" / "corpus"
    return data_fingerprint(LedgerDataLoader.Config(dataset="stdlib_docs", dataset_path=str(corpus)),
                            load_tokenizer(default_tokenizer_dir()), 256, 2)


def with_debug_run(**kw):
    """``with_run`` whose ledger holds debug_cpu's own data fingerprint (computed at setup)."""
    def setup(t):
        make_run(t / "run", fingerprint=debug_fingerprint(), **kw)
    return setup


def two_runs(fn=None, **kw_b):
    """Setup for ``replay check``: t/a complete, t/b complete (``make_run(**kw_b)``) then ``fn``."""
    def setup(t):
        make_run(t / "a")
        make_run(t / "b", **kw_b)
        if fn is not None:
            fn(t / "b" / "ledger", t)
    return setup


def rm(name):
    return lambda L, t: (L / name).unlink()


def empty(name):
    return lambda L, t: (L / name).write_bytes(b"")


def garbage(name):
    return lambda L, t: (L / name).write_bytes(bytes(range(256)) * 4)


def torn_header(name):
    return lambda L, t: cut_after(L / name, 15)


def newer(name, schema):
    kind, v = schema.rsplit("/", 1)
    return lambda L, t: bump_schema(L / name, f"{kind}/{int(v) + 1}")


def foreign(name, schema):
    return lambda L, t: bump_schema(L / name, schema)


def hdr_only_data(r):
    return lambda L, t: write_lines(L / records.data_file(r), data_header(r))


def hdr_only_signals(L, t):
    header_only(L / records.SIGNALS_FILE, S)


def cut_rank1_at_10(L, t):
    write_lines(L / "data_dp1.jsonl", data_header(1), *[data_rows(s, 1) for s in range(1, 11)])


def row_without_rows(L, t):
    write_lines(L / "data_dp0.jsonl", data_header(0), {"step": 1, "skipped": False})


def torn_last_line(L, t):
    with open(L / "data_dp0.jsonl", "ab") as f:
        f.write(b'{"step": 31, "skipped": fa')


def signals_without_keys(L, t):
    write_lines(L / records.SIGNALS_FILE, {"schema": S, "run_id": "run-a", "seq": 1, "resumed_from": 0},
                *[{"step": s, "loss": 3.0} for s in range(1, 20)])


def all_skipped(L, t):
    write_lines(L / records.SIGNALS_FILE, {"schema": S, "run_id": "run-a", "seq": 1, "resumed_from": 0},
                {**{k: None for k in records.SIGNAL_KEYS}, "step": 1, "last_step": 30, "skipped": True,
                 "lr": 1e-3, "skip_lr": "freeze"})


def nan_loss(L, t):
    rows = [signal_row(s) for s in range(1, 31)]
    rows[24] = signal_row(25, loss=float("nan"), grad_norm=float("inf"), spike=True)
    w = records.RecordWriter(L / records.SIGNALS_FILE, {"schema": S, "run_id": "x", "seq": 1,
                                                        "resumed_from": 0})
    for r in rows:
        w.write(r)
    w.close()


def indexed_header(L, t):
    for r in (0, 1):
        write_lines(L / records.data_file(r),
                    data_header(r, source_kind="indexed",
                                spec={"paths": [str(t / "gone" / "corpus")], "weights": [1.0],
                                      "seed": 1, "shuffle": True}),
                    data_rows(1, r))


def incomplete_checkpoints(L, t):
    for c in (10, 20):
        (t / "run" / "checkpoint" / f"step-{c}" / ".metadata").unlink()


def changed_id(L, t):
    rows = [data_rows(s, 1) for s in range(1, 31)]
    rows[6]["rows"][0][0] = 99999
    write_lines(L / "data_dp1.jsonl", data_header(1), *rows)


def dump_is_a_file(t):
    (t / "run").write_text("x")


def mkdir_run(t):
    (t / "run").mkdir()


# issue 26: a corrupt row is an error naming FILE:LINE (line 1 is the header, step s is
# line s + 1), a torn last line a warning, a file of another run is named
GARBAGE = b'{"step": 11, "loss": 2.97\x00\x13 not json'


def garbage_row(name, line=12, raw=GARBAGE):
    return lambda L, t: replace_line(L / name, line, raw)


def torn(name):
    return lambda L, t: tear(L / name)


def torn_last_step(name):
    """kill -9 mid-write of a step's own row: the file's last line (step 30) cut short."""
    return lambda L, t: cut_after(L / name, (L / name).stat().st_size - 9)


def from_other_run(name):
    return lambda L, t: other_run(L / name)


def torn_then_resumed_data(L, t):
    """DP rank 0 torn by kill -9 at step 31; the next launch resumed from step 20 on both ranks."""
    resume_after_tear(t / "run", "data_dp0.jsonl", data_header(0), [data_rows(s, 0) for s in range(21, 31)])
    w = records.RecordWriter(L / "data_dp1.jsonl", {**data_header(1), "run_id": "run-a2", "seq": 2,
                                                    "resumed_from": 20, "time": 2.0})
    for s in range(21, 31):
        w.write(data_rows(s, 1))
    w.close()


def torn_then_resumed_signals(L, t):
    hdr = {"schema": S, "run_id": "run-a", "seq": 1, "resumed_from": 0}
    resume_after_tear(t / "run", records.SIGNALS_FILE, hdr,
                      [signal_row(s, loss=3.6, grad_norm=10.0, spike=True) if s == 25 else signal_row(s)
                       for s in range(21, 31)])


def indexed_run(t):
    make_indexed_run(t / "run", t / "corpus")


# --------------------------------------------------------------------------- the table
# (id, tool, setup, argv with {t} = the case's tmp folder, exit code, substrings of the
#  error line -- or, for exit 0/1, of stdout)
L_ = ["--dump-folder", "{t}/run"]
CASES = [
    # ---------------------------------------------------------------- lookup
    ("lookup-missing-dump", "lookup", None, ["--dump-folder", "{t}/nope", "--step", "1"], 2, ["nope", "no such dump folder"]),
    ("lookup-dump-is-a-file", "lookup", dump_is_a_file, L_ + ["--step", "1"], 2, ["no such dump folder"]),
    ("lookup-no-ledger-folder", "lookup", mkdir_run, L_ + ["--step", "1"], 2, ["no data ledger", "tagging"]),
    ("lookup-signals-only", "lookup", with_run(data=False), L_ + ["--step", "1"], 2, ["no data ledger"]),
    ("lookup-dp0-empty", "lookup", with_run(empty("data_dp0.jsonl")), L_ + ["--step", "5"], 2, ["data_dp0.jsonl", "lost"]),
    ("lookup-dp0-torn-header", "lookup", with_run(torn_header("data_dp0.jsonl")), L_ + ["--step", "5"], 2, ["data_dp0.jsonl"]),
    ("lookup-dp0-garbage", "lookup", with_run(garbage("data_dp0.jsonl")), L_ + ["--step", "5"], 2, ["data_dp0.jsonl"]),
    ("lookup-dp0-header-only", "lookup", with_run(hdr_only_data(0)), L_ + ["--step", "5"], 2, ["data_dp0.jsonl", "--rank 1"]),
    ("lookup-dp0-deleted", "lookup", with_run(rm("data_dp0.jsonl")), L_ + ["--step", "5"], 2, ["data_dp0.jsonl", "restore"]),
    ("lookup-dp1-cut-midway", "lookup", with_run(cut_rank1_at_10), L_ + ["--step", "20"], 2, ["data_dp1.jsonl", "step 20"]),
    ("lookup-dp1-cut-midway-rank0-ok", "lookup", with_run(cut_rank1_at_10), L_ + ["--step", "20", "--rank", "0"], 0, ["DP rank 0"]),
    ("lookup-newer-schema", "lookup", with_run(newer("data_dp0.jsonl", D)), L_ + ["--step", "1"], 2, ["data_dp0.jsonl", "newer", "upgrade"]),
    ("lookup-foreign-kind", "lookup", with_run(foreign("data_dp0.jsonl", S)), L_ + ["--step", "1"], 2, ["data_dp0.jsonl", "not a data ledger"]),
    ("lookup-bad-schema-id", "lookup", with_run(foreign("data_dp0.jsonl", "titan_ledger.data/x")), L_ + ["--step", "1"], 2, ["data_dp0.jsonl", "schema"]),
    ("lookup-row-without-rows", "lookup", with_run(row_without_rows), L_ + ["--step", "1"], 2, ["data_dp0.jsonl", "'rows'"]),
    ("lookup-step-0", "lookup", run, L_ + ["--step", "0"], 2, ["--step 0", "1-30"]),
    ("lookup-step-negative", "lookup", run, L_ + ["--step", "-3"], 2, ["--step -3"]),
    ("lookup-step-past-end", "lookup", run, L_ + ["--step", "999"], 2, ["step 999", "1-30"]),
    ("lookup-step-not-int", "lookup", run, L_ + ["--step", "abc"], 2, ["--step", "invalid int"]),
    ("lookup-rank-out-of-range", "lookup", run, L_ + ["--step", "5", "--rank", "5"], 2, ["DP rank 5", "[0, 1]"]),
    ("lookup-rank-negative", "lookup", run, L_ + ["--step", "5", "--rank", "-1"], 2, ["DP rank -1"]),
    ("lookup-no-step-no-sample", "lookup", run, L_, 2, ["--step", "--sample"]),
    ("lookup-step-and-sample", "lookup", run, L_ + ["--step", "1", "--sample", "3"], 2, ["exactly one"]),
    ("lookup-sample-on-text-run", "lookup", run, L_ + ["--sample", "3"], 2, ["text stream"]),
    ("lookup-sample-negative", "lookup", run, L_ + ["--sample", "-1"], 2, ["--sample -1"]),
    ("lookup-sample-corpus-gone", "lookup", with_run(indexed_header), L_ + ["--sample", "3"], 2, ["gone/corpus"]),
    ("lookup-no-dump-folder", "lookup", None, ["--step", "1"], 2, ["dump folder"]),
    ("lookup-unknown-flag", "lookup", run, L_ + ["--step", "1", "--stepz", "2"], 2, ["--stepz"]),
    ("lookup-ledger-folder-wrong", "lookup", run, L_ + ["--step", "1", "--ledger-folder", "ledgr"], 2, ["ledgr", "no data ledger"]),
    ("lookup-ok", "lookup", run, L_ + ["--step", "5"], 0, ["DP rank 0", "DP rank 1"]),
    ("lookup-torn-last-line-warns", "lookup", with_run(torn_last_line), L_ + ["--step", "5"], 0, ["DP rank 1", "warning:data_dp0.jsonl:32: torn last line skipped"]),
    ("lookup-json-past-end", "lookup", run, L_ + ["--step", "31", "--json"], 2, ["step 31"]),
    # issue 26: corrupt rows name FILE:LINE, a torn last line warns, another run's file is named,
    # (issue 49: a point query reads only its step's lines, so a corrupt row is met at its step)
    # samples/steps/ranks outside the run are refused before any answer or corpus cache file
    ("lookup-dp1-garbage-mid-file", "lookup", with_run(garbage_row("data_dp1.jsonl")), L_ + ["--step", "11"], 2, ["data_dp1.jsonl:12", "not a ledger row", "not JSON"]),
    ("lookup-dp0-row-not-an-object", "lookup", with_run(garbage_row("data_dp0.jsonl", 3, b"[1, 2, 3]")), L_ + ["--step", "5"], 2, ["data_dp0.jsonl:3", "not an object"]),
    ("lookup-dp0-row-step-not-int", "lookup", with_run(garbage_row("data_dp0.jsonl", 4, b'{"step": "3", "skipped": false, "rows": []}')), L_ + ["--step", "5"], 2, ["data_dp0.jsonl:4", "'step' is '3'"]),
    ("lookup-dp0-row-without-rows-mid-file", "lookup", with_run(garbage_row("data_dp0.jsonl", 8, b'{"step": 7, "skipped": false}')), L_ + ["--step", "7"], 2, ["data_dp0.jsonl:8", "'rows'"]),
    ("lookup-dp0-torn-last-line", "lookup", with_run(torn("data_dp0.jsonl")), L_ + ["--step", "30"], 0, ["DP rank 0", "DP rank 1", "warning:data_dp0.jsonl:32: torn last line skipped (a kill -9 mid-write)"]),
    ("lookup-dp0-torn-then-resumed", "lookup", with_run(torn_then_resumed_data), L_ + ["--step", "25"], 0, ["DP rank 0", "DP rank 1", "warning:data_dp0.jsonl: torn line 32 skipped"]),
    ("lookup-dp1-other-run", "lookup", with_run(from_other_run("data_dp1.jsonl")), L_ + ["--step", "5"], 2, ["data_dp1.jsonl", "holds run 'run-b'", "segments.jsonl", "another run"]),
    ("lookup-dp1-other-run-rank0", "lookup", with_run(from_other_run("data_dp1.jsonl")), L_ + ["--step", "5", "--rank", "0"], 2, ["data_dp1.jsonl", "holds run 'run-b'"]),
    ("lookup-sample-far-past-run", "lookup", indexed_run, L_ + ["--sample", "1000000000000"], 2, ["sample 1000000000000", "samples 0-119"]),
    ("lookup-sample-just-past-run", "lookup", indexed_run, L_ + ["--sample", "120", "--text"], 2, ["sample 120", "samples 0-119"]),
    ("lookup-sample-in-run", "lookup", indexed_run, L_ + ["--sample", "119"], 0, ['"sample_id": 119']),
    ("lookup-indexed-rank-past-dp-size", "lookup", indexed_run, L_ + ["--step", "5", "--rank", "2", "--text"], 2, ["DP rank 2", "[0, 1]"]),
    ("lookup-indexed-step-past-end", "lookup", indexed_run, L_ + ["--step", "31", "--text"], 2, ["step 31", "1-30"]),
    # ---------------------------------------------------------------- diagnose
    ("diagnose-missing-dump", "diagnose", None, ["{t}/nope"], 2, ["nope", "no such dump folder"]),
    ("diagnose-no-signals", "diagnose", with_run(signals=False), ["{t}/run"], 2, ["signals.jsonl", "no signals ledger"]),
    ("diagnose-empty-signals", "diagnose", with_run(empty("signals.jsonl")), ["{t}/run"], 2, ["signals.jsonl", "empty"]),
    ("diagnose-header-only", "diagnose", with_run(hdr_only_signals), ["{t}/run"], 2, ["signals.jsonl", "no trained step"]),
    ("diagnose-garbage", "diagnose", with_run(garbage("signals.jsonl")), ["{t}/run"], 2, ["signals.jsonl:1", "not a ledger row"]),
    ("diagnose-torn-header", "diagnose", with_run(torn_header("signals.jsonl")), ["{t}/run"], 2, ["signals.jsonl"]),
    ("diagnose-newer-schema", "diagnose", with_run(newer("signals.jsonl", S)), ["{t}/run"], 2, ["signals.jsonl", "newer"]),
    ("diagnose-foreign-kind", "diagnose", with_run(foreign("signals.jsonl", D)), ["{t}/run"], 2, ["signals.jsonl", "not a signals ledger"]),
    ("diagnose-rows-lack-keys", "diagnose", with_run(signals_without_keys), ["{t}/run"], 2, ["signals.jsonl", "grad_norm"]),
    ("diagnose-all-skipped", "diagnose", with_run(all_skipped), ["{t}/run"], 2, ["no trained step"]),
    ("diagnose-step-0", "diagnose", run, ["{t}/run", "--step", "0"], 2, ["--step 0", "1-30"]),
    ("diagnose-step-past-end", "diagnose", run, ["{t}/run", "--step", "999"], 2, ["--step 999", "1-30"]),
    ("diagnose-step-skipped", "diagnose", with_run(skip=(12, 14)), ["{t}/run", "--step", "13"], 2, ["--step 13", "not a trained step"]),
    ("diagnose-step-not-int", "diagnose", run, ["{t}/run", "--step", "x"], 2, ["--step", "invalid int"]),
    ("diagnose-two-folders", "diagnose", run, ["{t}/run", "--dump-folder", "{t}/other"], 2, ["two dump folders"]),
    ("diagnose-no-folder", "diagnose", None, [], 2, ["dump folder"]),
    ("diagnose-unknown-flag", "diagnose", run, ["{t}/run", "--spike", "3"], 2, ["--spike"]),
    ("diagnose-ledger-folder-wrong", "diagnose", run, ["{t}/run", "--ledger-folder", "x"], 2, ["x/signals.jsonl"]),
    ("diagnose-ordinary-step-2", "diagnose", run, ["{t}/run", "--step", "2"], 0, ["step 2: NOT A SPIKE", "needs > 3.0x"]),
    ("diagnose-ordinary-step-15", "diagnose", run, ["{t}/run", "--step", "15"], 0, ["step 15: NOT A SPIKE", "grad norm"]),
    ("diagnose-ordinary-step-json", "diagnose", run, ["{t}/run", "--step", "15", "--json"], 0, ['"is_spike": false']),
    ("diagnose-spike-step", "diagnose", run, ["{t}/run", "--step", "25"], 0, ["step 25: "]),
    ("diagnose-all-spikes", "diagnose", run, ["{t}/run"], 0, ["step 25: "]),
    ("diagnose-no-spikes", "diagnose", with_run(spike_at=None), ["{t}/run"], 0, ["no spikes detected in 30 trained steps (1-30)", "need 8 steps: judged steps 9-30", "needs 64 (window 128 / 2): judged none of the 30"]),
    ("diagnose-no-spikes-short-run", "diagnose", with_run(spike_at=None, steps=6), ["{t}/run"], 0, ["no spikes detected in 6 trained steps (1-6)", "need 8 steps: judged none of the 6"]),
    ("diagnose-nan-loss", "diagnose", with_run(nan_loss), ["{t}/run", "--step", "25"], 0, ["divergence"]),
    ("diagnose-garbage-mid-file", "diagnose", with_run(garbage_row("signals.jsonl")), ["{t}/run"], 2, ["signals.jsonl:12", "not a ledger row", "not JSON"]),
    ("diagnose-step-on-corrupt-row", "diagnose", with_run(garbage_row("signals.jsonl", 5)), ["{t}/run", "--step", "4"], 2, ["signals.jsonl:5", "not a ledger row"]),
    ("diagnose-row-without-step", "diagnose", with_run(garbage_row("signals.jsonl", 9, b'{"loss": 2.9, "grad_norm": 1.0}')), ["{t}/run"], 2, ["signals.jsonl:9", "no integer 'step'"]),
    ("diagnose-row-lacks-keys-mid-file", "diagnose", with_run(garbage_row("signals.jsonl", 9, b'{"step": 8, "loss": 2.9}')), ["{t}/run"], 2, ["signals.jsonl:9", "step 8 has no grad_norm"]),
    ("diagnose-spikes-garbage-last-row", "diagnose", with_run(garbage_row("spikes.jsonl", 2, b'{"step": 25, "rul')), ["{t}/run"], 2, ["spikes.jsonl:2", "not a ledger row"]),
    ("diagnose-torn-last-line", "diagnose", with_run(torn("signals.jsonl")), ["{t}/run"], 0, ["step 25: ", "warning:signals.jsonl:32: torn last line skipped"]),
    ("diagnose-torn-then-resumed", "diagnose", with_run(torn_then_resumed_signals), ["{t}/run", "--step", "25"], 0, ["step 25: ", "warning:signals.jsonl: torn line 32 skipped"]),
    ("diagnose-signals-other-run", "diagnose", with_run(from_other_run("signals.jsonl")), ["{t}/run"], 2, ["signals.jsonl", "holds run 'run-b'"]),
    ("diagnose-spikes-other-run", "diagnose", with_run(from_other_run("spikes.jsonl")), ["{t}/run"], 2, ["spikes.jsonl", "holds run 'run-b'"]),
    # ---------------------------------------------------------------- plot
    ("plot-missing-dump", "plot", None, ["{t}/nope", "-o", "{t}/p.png"], 2, ["nope", "no such dump folder"]),
    ("plot-no-signals", "plot", with_run(signals=False), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl"]),
    ("plot-empty-signals", "plot", with_run(empty("signals.jsonl")), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl", "empty"]),
    ("plot-header-only", "plot", with_run(hdr_only_signals), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl", "no trained step"]),
    ("plot-garbage", "plot", with_run(garbage("signals.jsonl")), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl"]),
    ("plot-newer-schema", "plot", with_run(newer("signals.jsonl", S)), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl", "newer"]),
    ("plot-foreign-kind", "plot", with_run(foreign("signals.jsonl", D)), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl", "not a signals ledger"]),
    ("plot-rows-lack-keys", "plot", with_run(signals_without_keys), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl", "grad_norm"]),
    ("plot-all-skipped", "plot", with_run(all_skipped), ["{t}/run", "-o", "{t}/p.png"], 2, ["no trained step"]),
    ("plot-from-after-to", "plot", run, ["{t}/run", "-o", "{t}/p.png", "--from-step", "20", "--to-step", "10"], 2, ["--from-step 20", "--to-step 10"]),
    ("plot-range-outside-run", "plot", run, ["{t}/run", "-o", "{t}/p.png", "--from-step", "500"], 2, ["no trained step", "--from-step 500"]),
    ("plot-out-folder-missing", "plot", run, ["{t}/run", "-o", "{t}/no/dir/p.png"], 2, ["-o", "no/dir", "does not exist"]),
    ("plot-out-bad-type", "plot", run, ["{t}/run", "-o", "{t}/p.xyz"], 2, ["-o", "'.xyz'", ".png"]),
    ("plot-from-not-int", "plot", run, ["{t}/run", "--from-step", "x"], 2, ["--from-step"]),
    ("plot-ok", "plot", run, ["{t}/run", "-o", "{t}/p.png"], 0, ["wrote", "30 steps", "1 spikes"]),
    ("plot-garbage-mid-file", "plot", with_run(garbage_row("signals.jsonl")), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl:12", "not a ledger row"]),
    ("plot-row-without-step", "plot", with_run(garbage_row("signals.jsonl", 9, b'{"loss": 2.9}')), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl:9", "no integer 'step'"]),
    ("plot-row-before-header", "plot", with_run(lambda L, t: replace_line(L / "signals.jsonl", 1, b'{"step": 0, "loss": 1.0}')), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl:1", "before the file's first header"]),
    ("plot-torn-last-line", "plot", with_run(torn("signals.jsonl")), ["{t}/run", "-o", "{t}/p.png"], 0, ["wrote", "30 steps", "warning:signals.jsonl:32: torn last line skipped"]),
    ("plot-signals-other-run", "plot", with_run(from_other_run("signals.jsonl")), ["{t}/run", "-o", "{t}/p.png"], 2, ["signals.jsonl", "holds run 'run-b'"]),
    # ---------------------------------------------------------------- report
    ("report-ok", "report", run, ["{t}/run", "--step", "25", "-o", "{t}/r.html"], 0, ["wrote", "step 25"]),
    ("report-step-past-end", "report", run, ["{t}/run", "--step", "999", "-o", "{t}/r.html"], 2, ["step 999"]),
    ("report-garbage-mid-file", "report", with_run(garbage_row("signals.jsonl")), ["{t}/run", "-o", "{t}/r.html"], 2, ["signals.jsonl:12", "not a ledger row"]),
    ("report-data-garbage-mid-file", "report", with_run(garbage_row("data_dp1.jsonl")), ["{t}/run", "--step", "25", "-o", "{t}/r.html"], 2, ["data_dp1.jsonl:12", "not a ledger row"]),
    ("report-data-other-run", "report", with_run(from_other_run("data_dp1.jsonl")), ["{t}/run", "--step", "25", "-o", "{t}/r.html"], 2, ["data_dp1.jsonl", "holds run 'run-b'"]),
    ("report-torn-last-line", "report", with_run(torn("data_dp1.jsonl")), ["{t}/run", "--step", "25", "-o", "{t}/r.html"], 0, ["wrote", "warning:data_dp1.jsonl:32: torn last line skipped"]),
    # ---------------------------------------------------------------- rollback
    ("rollback-missing-dump", "rollback", None, ["{t}/nope", "--step", "25"], 2, ["nope", "no such dump folder"]),
    ("rollback-no-checkpoints", "rollback", with_run(checkpoints=()), ["{t}/run", "--step", "25"], 2, ["checkpoint", "--checkpoint.enable"]),
    ("rollback-incomplete-checkpoints", "rollback", with_run(incomplete_checkpoints), ["{t}/run", "--step", "25"], 2, [".metadata", "no complete checkpoint"]),
    ("rollback-spike-step-0", "rollback", run, ["{t}/run", "--step", "0"], 2, ["--step"]),
    ("rollback-spike-step-negative", "rollback", run, ["{t}/run", "--step", "-5"], 2, ["--step"]),
    ("rollback-spike-step-past-end", "rollback", run, ["{t}/run", "--step", "999"], 2, ["--step 999", "last recorded step 30"]),
    ("rollback-back-negative", "rollback", run, ["{t}/run", "--step", "25", "--back", "-1"], 2, ["--back"]),
    ("rollback-skip-0", "rollback", run, ["{t}/run", "--step", "25", "--skip", "0"], 2, ["--skip"]),
    ("rollback-before-first-checkpoint", "rollback", run, ["{t}/run", "--step", "15", "--back", "10"], 2, ["earliest is step 10", "--back"]),
    ("rollback-skip-from-before-checkpoint", "rollback", run, ["{t}/run", "--step", "25", "--back", "5", "--skip-from", "5"], 2, ["--skip-from 5"]),
    ("rollback-window-misses-spike", "rollback", run, ["{t}/run", "--step", "25", "--back", "0", "--skip", "2"], 2, ["does not contain", "--skip"]),
    ("rollback-write-folder-missing", "rollback", run, ["{t}/run", "--step", "25", "--write", "{t}/no/o.toml"], 2, ["--write", "does not exist"]),
    ("rollback-no-spike-step", "rollback", run, ["{t}/run"], 2, ["--step"]),
    ("rollback-old-spike-step", "rollback", run, ["{t}/run", "--spike" + "-step", "5"], 2,
     ["--spike-step is now --step", "lookup, diagnose, report, rollback"]),
    ("rollback-spike-step-not-int", "rollback", run, ["{t}/run", "--step", "x"], 2, ["--step", "invalid int"]),
    ("rollback-checkpoint-folder-wrong", "rollback", run, ["{t}/run", "--step", "25", "--checkpoint-folder", "ckpt"], 2, ["ckpt", "no complete checkpoint"]),
    ("rollback-ok", "rollback", run, ["{t}/run", "--step", "25", "--back", "5"], 0, ["checkpoint step-20"]),
    ("rollback-signals-garbage-mid-file", "rollback", with_run(garbage_row("signals.jsonl", 26)), ["{t}/run", "--step", "25", "--back", "5"], 2, ["signals.jsonl:26", "not a ledger row"]),
    ("rollback-data-garbage-header", "rollback", with_run(garbage_row("data_dp0.jsonl", 1)), ["{t}/run", "--step", "25", "--back", "5", "--write", "{t}/o.toml"], 2, ["data_dp0.jsonl:2", "not a ledger row"]),
    ("rollback-data-other-run", "rollback", with_run(from_other_run("data_dp1.jsonl")), ["{t}/run", "--step", "25", "--back", "5"], 2, ["data_dp1.jsonl", "holds run 'run-b'"]),
    ("rollback-torn-last-line", "rollback", with_run(torn("signals.jsonl")), ["{t}/run", "--step", "25", "--back", "5"], 0, ["checkpoint step-20", "warning:signals.jsonl:32: torn last line skipped"]),
    # ---------------------------------------------------------------- replay check
    ("check-a-missing", "replay", two_runs(), ["check", "{t}/nope", "{t}/b"], 2, ["nope", "no such dump folder"]),
    ("check-b-no-data-ledger", "replay", two_runs(data=False), ["check", "{t}/a", "{t}/b"], 2, ["no data ledger"]),
    ("check-b-dp1-deleted", "replay", two_runs(rm("data_dp1.jsonl")), ["check", "{t}/a", "{t}/b"], 2, ["b/ledger/data_dp1.jsonl", "2 DP ranks"]),
    ("check-b-dp1-empty", "replay", two_runs(empty("data_dp1.jsonl")), ["check", "{t}/a", "{t}/b"], 2, ["data_dp1.jsonl"]),
    ("check-b-dp1-header-only", "replay", two_runs(hdr_only_data(1)), ["check", "{t}/a", "{t}/b"], 2, ["data_dp1.jsonl", "lost"]),
    ("check-b-dp0-garbage", "replay", two_runs(garbage("data_dp0.jsonl")), ["check", "{t}/a", "{t}/b"], 2, ["data_dp0.jsonl"]),
    ("check-b-newer-schema", "replay", two_runs(newer("data_dp0.jsonl", D)), ["check", "{t}/a", "{t}/b"], 2, ["newer"]),
    ("check-b-other-seq-len", "replay", two_runs(seq_len=512), ["check", "{t}/a", "{t}/b"], 2, ["seq_len", "512"]),
    ("check-b-other-fingerprint", "replay", two_runs(fingerprint="fp-b"), ["check", "{t}/a", "{t}/b"], 2, ["fingerprint"]),
    ("check-b-other-global-batch", "replay", two_runs(mbs=4), ["check", "{t}/a", "{t}/b"], 2, ["global_batch"]),
    ("check-no-b", "replay", two_runs(), ["check", "{t}/a"], 2, ["dump_b"]),
    ("check-unknown-flag", "replay", two_runs(), ["check", "{t}/a", "{t}/b", "--fast"], 2, ["--fast"]),
    ("replay-no-subcommand", "replay", None, [], 2, ["cmd"]),
    ("check-equal", "replay", two_runs(), ["check", "{t}/a", "{t}/b"], 0, ["EQUAL"]),
    ("check-different-sample", "replay", two_runs(changed_id), ["check", "{t}/a", "{t}/b"], 1, ["DIFFERENT", "step 7"]),
    ("check-b-killed-early", "replay", two_runs(steps=20), ["check", "{t}/a", "{t}/b"], 1, ["DIFFERENT", "step 21 is missing from B"]),
    ("check-b-garbage-mid-file", "replay", two_runs(garbage_row("data_dp1.jsonl")), ["check", "{t}/a", "{t}/b"], 2, ["b/ledger/data_dp1.jsonl:12", "not a ledger row"]),
    ("check-b-torn-last-line", "replay", two_runs(torn("data_dp0.jsonl")), ["check", "{t}/a", "{t}/b"], 0, ["EQUAL", "warning:b/ledger/data_dp0.jsonl:32: torn last line skipped"]),
    ("check-b-torn-last-step", "replay", two_runs(torn_last_step("data_dp0.jsonl")), ["check", "{t}/a", "{t}/b"], 0, ["EQUAL", "B's record ends at step 29", "steps compared    29"]),
    ("check-b-torn-then-different", "replay", two_runs(lambda L, t: (changed_id(L, t), torn_last_step("data_dp0.jsonl")(L, t))), ["check", "{t}/a", "{t}/b"], 1, ["DIFFERENT", "step 7"]),
    ("check-b-other-run", "replay", two_runs(from_other_run("data_dp1.jsonl")), ["check", "{t}/a", "{t}/b"], 2, ["b/ledger/data_dp1.jsonl", "holds run 'run-b'"]),
    # ---------------------------------------------------------------- replay resume/inject/drill: refused before training
    ("resume-no-train-flags", "replay", None, ["resume", "--kill-at", "3", "--dump-folder", "{t}/r"], 2, ["--job.config_file"]),
    ("resume-nproc-0", "replay", None, ["resume", "--nproc", "0", "--kill-at", "3", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG], 2, ["--nproc 0"]),
    ("resume-no-kill-at", "replay", None, ["resume", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG], 2, ["--kill-at"]),
    ("resume-kill-at-0", "replay", None, ["resume", "--kill-at", "0", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG], 2, ["--kill-at 0"]),
    ("resume-kill-at-past-end", "replay", None, ["resume", "--kill-at", "99", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG, "--training.steps", "20"], 2, ["--kill-at 99", "--training.steps 20"]),
    ("resume-bad-train-flag", "replay", None, ["resume", "--kill-at", "3", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG, "--training.stepz", "5"], 2, ["--training.stepz"]),
    ("resume-steps-negative", "replay", None, ["resume", "--kill-at", "3", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG, "--training.steps", "-1"], 2, ["--training.steps -1"]),
    ("inject-rank-out-of-range", "replay", None, ["inject", "--step", "5", "--rank", "5", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG], 2, ["DP rank 5", "0-1"]),
    ("inject-step-0", "replay", None, ["inject", "--step", "0", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG], 2, ["--step 0"]),
    ("inject-step-past-end", "replay", None, ["inject", "--step", "99", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG, "--training.steps", "8"], 2, ["step 99", "--training.steps 8"]),
    ("inject-bad-kind", "replay", None, ["inject", "--step", "5", "--kind", "zeros", "--dump-folder", "{t}/r", "--", "--job.config_file", DEBUG], 2, ["--kind", "zeros"]),
    ("drill-no-train-flags", "replay", None, ["drill", "--step", "5", "--dump-folder", "{t}/r"], 2, ["--job.config_file"]),
    # ---------------------------------------------------------------- prepare
    ("prepare-missing-input", "prepare", None, ["--input", "{t}/nope.jsonl", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["--input", "nope.jsonl"]),
    ("prepare-empty-jsonl", "prepare", lambda t: (t / "e.jsonl").write_text(""), ["--input", "{t}/e.jsonl", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["e.jsonl", "no documents"]),
    ("prepare-blank-lines-only", "prepare", lambda t: (t / "e.jsonl").write_text("\n\n  \n"), ["--input", "{t}/e.jsonl", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["no documents"]),
    ("prepare-not-json", "prepare", lambda t: (t / "g.jsonl").write_text('{"text": "a"}\nnot json\n'), ["--input", "{t}/g.jsonl", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["g.jsonl:2", "not JSON"]),
    ("prepare-no-text-key", "prepare", lambda t: (t / "k.jsonl").write_text('{"body": "a"}\n'), ["--input", "{t}/k.jsonl", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["k.jsonl:1", "--text-key"]),
    ("prepare-text-not-string", "prepare", lambda t: (t / "n.jsonl").write_text('{"text": 5}\n'), ["--input", "{t}/n.jsonl", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["n.jsonl:1"]),
    ("prepare-binary-input", "prepare", lambda t: (t / "b.jsonl").write_bytes(bytes(range(256))), ["--input", "{t}/b.jsonl", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["b.jsonl"]),
    ("prepare-corrupt-parquet", "prepare", lambda t: (t / "p.parquet").write_bytes(b"PAR1 not really"), ["--input", "{t}/p.parquet", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["p.parquet", "not a readable Parquet file"]),
    ("prepare-folder-prefix", "prepare", lambda t: (t / "d.jsonl").write_text('{"text": "a"}\n'), ["--input", "{t}/d.jsonl", "--output-prefix", "{t}/prep/", "--workers", "0"], 2, ["--output-prefix", "prep/corpus"]),
    ("prepare-prefix-is-a-folder", "prepare", lambda t: (t / "d.jsonl").write_text('{"text": "a"}\n'), ["--input", "{t}/d.jsonl", "--output-prefix", "{t}", "--workers", "0"], 2, ["--output-prefix"]),
    ("prepare-workers-negative", "prepare", lambda t: (t / "d.jsonl").write_text('{"text": "a"}\n'), ["--input", "{t}/d.jsonl", "--output-prefix", "{t}/c", "--workers", "-1"], 2, ["--workers -1"]),
    ("prepare-tokenizer-missing", "prepare", lambda t: (t / "d.jsonl").write_text('{"text": "a"}\n'), ["--input", "{t}/d.jsonl", "--output-prefix", "{t}/c", "--workers", "0", "--tokenizer", "{t}/tok"], 2, ["--tokenizer", "tokenizer.json"]),
    ("prepare-folder-without-jsonl", "prepare", lambda t: (t / "in").mkdir(), ["--input", "{t}/in", "--output-prefix", "{t}/c", "--workers", "0"], 2, ["--input", "no .jsonl"]),
    ("prepare-no-input", "prepare", None, ["--output-prefix", "{t}/c"], 2, ["--input"]),
    ("prepare-ok", "prepare", lambda t: (t / "d.jsonl").write_text('{"text": "hello world"}\n{"text": "again"}\n'), ["--input", "{t}/d.jsonl", "--output-prefix", "{t}/c", "--workers", "0"], 0, ["2 documents"]),
    # ---------------------------------------------------------------- the trainer's config (titan_ledger.train.main)
    ("train-config-file-missing", "train", None, ["--job.config_file", "{t}/nope.toml"], 2, ["nope.toml", "no such config file"]),
    ("train-config-file-no-value", "train", None, ["--job.config_file"], 2, ["--job.config_file needs a value"]),
    ("train-toml-malformed", "train", lambda t: (t / "x.toml").write_text("[training\nsteps = 3\n"), ["--job.config_file", "{t}/x.toml"], 2, ["x.toml", "malformed TOML"]),
    ("train-toml-unknown-key", "train", lambda t: (t / "x.toml").write_text("[training]\nstepz = 3\n"), ["--job.config_file", "{t}/x.toml"], 2, ["x.toml", "stepz", "'steps'"]),
    ("train-toml-unknown-section", "train", lambda t: (t / "x.toml").write_text("[trainingx]\nsteps = 3\n"), ["--job.config_file", "{t}/x.toml"], 2, ["x.toml", "trainingx"]),
    ("train-toml-wrong-type", "train", lambda t: (t / "x.toml").write_text("[training]\nsteps = 'ten'\n"), ["--job.config_file", "{t}/x.toml"], 2, ["x.toml", "[training] steps", "expected int"]),
    ("train-toml-table-for-value", "train", lambda t: (t / "x.toml").write_text("[training]\nsteps = {a = 1}\n"), ["--job.config_file", "{t}/x.toml"], 2, ["x.toml", "steps"]),
    ("train-toml-job-unknown-key", "train", lambda t: (t / "x.toml").write_text("[job]\nconfg = 'x'\n"), ["--job.config_file", "{t}/x.toml"], 2, ["x.toml", "confg"]),
    ("train-toml-steps-negative", "train", lambda t: (t / "x.toml").write_text("[training]\nsteps = -1\n"), ["--job.config_file", "{t}/x.toml"], 2, ["--training.steps -1"]),
    ("train-steps-negative", "train", None, ["--job.config_file", DEBUG, "--training.steps", "-1"], 2, ["--training.steps -1", ">= 1"]),
    ("train-steps-zero", "train", None, ["--job.config_file", DEBUG, "--training.steps", "0"], 2, ["--training.steps 0"]),
    ("train-on-spike-without-signals", "train", None, ["--job.config_file", DEBUG, "--ledger.response.policy", "act", "--ledger.response.action", "skip_update", "--ledger.no_signals"], 2, ["--ledger.response.action skip_update", "needs --ledger.signals"]),
    ("train-on-spike-without-rules", "train", None, ["--job.config_file", DEBUG, "--ledger.response.policy", "act", "--ledger.response.action", "skip_update", "--ledger.spike.no_enable"], 2, ["--ledger.spike.enable"]),
    ("train-old-flat-ledger-key", "train", lambda t: (t / "x.toml").write_text("[ledger]\ninject = '3:0:random'\n"), ["--job.config_file", "{t}/x.toml"], 2, ["x.toml", "unknown key 'inject'"]),
    ("train-steps-not-int", "train", None, ["--job.config_file", DEBUG, "--training.steps", "ten"], 2, ["--training.steps"]),
    ("train-local-batch-zero", "train", None, ["--job.config_file", DEBUG, "--training.local_batch_size", "0"], 2, ["--training.local_batch_size 0"]),
    ("train-seq-len-zero", "train", None, ["--job.config_file", DEBUG, "--training.seq_len", "0"], 2, ["--training.seq_len 0"]),
    ("train-unknown-flag", "train", None, ["--job.config_file", DEBUG, "--training.stepz", "3"], 2, ["--training.stepz", "--training.steps"]),
    ("train-skip-reversed", "train", None, ["--job.config_file", DEBUG, "--ledger.skip.steps", "5-3"], 2, ["5-3"]),
    ("train-skip-garbage", "train", None, ["--job.config_file", DEBUG, "--ledger.skip.steps", "abc"], 2, ["abc"]),
    ("train-skip-step-0", "train", None, ["--job.config_file", DEBUG, "--ledger.skip.steps", "0"], 2, ["--ledger.skip.steps"]),
    ("train-skip-past-end", "train", None, ["--job.config_file", DEBUG, "--training.steps", "20", "--ledger.skip.steps", "50-60"], 2, ["--ledger.skip.steps 50-60", "--training.steps 20"]),
    ("train-inject-garbage", "train", None, ["--job.config_file", DEBUG, "--ledger.rehearsal.inject", "x"], 2, ["--ledger.rehearsal.inject", "STEP:DP_RANK:KIND"]),
    ("train-inject-bad-kind", "train", None, ["--job.config_file", DEBUG, "--ledger.rehearsal.inject", "5:1:zeros"], 2, ["--ledger.rehearsal.inject", "repeat or random"]),
    ("train-inject-rank-out-of-range", "train", None, ["--job.config_file", DEBUG, "--ledger.rehearsal.inject", "5:5:repeat"], 2, ["DP rank 5", "0-1"]),
    ("train-inject-step-past-end", "train", None, ["--job.config_file", DEBUG, "--training.steps", "8", "--ledger.rehearsal.inject", "9:1:repeat"], 2, ["step 9", "--training.steps 8"]),
    ("train-on-spike-bogus", "train", None, ["--job.config_file", DEBUG, "--ledger.response.action", "panic"], 2, ["--ledger.response.action", "panic", "rollback"]),
    ("train-on-spike-rollback-no-checkpoints", "train", None, ["--job.config_file", DEBUG, "--ledger.response.policy", "act", "--ledger.response.action", "rollback"], 2, ["--ledger.response.action rollback", "--checkpoint.enable"]),
    ("train-snapshots-unread", "train", None, ["--job.config_file", DEBUG, "--ledger.snapshots.every", "4", "--ledger.proof.scope", "off"], 2, ["--ledger.snapshots.every 4", "nothing would read"]),
    ("train-snapshots-qk-clip", "train", None, ["--job.config_file", DEBUG, "--ledger.snapshots.every", "4", "--qk_clip.enable"], 2, ["--ledger.snapshots.every 4", "--qk_clip.enable"]),
    ("train-snapshots-cause-bogus", "train", None, ["--job.config_file", DEBUG, "--ledger.snapshots.every", "4", "--ledger.window.causes", "logits"], 2, ["--ledger.window.causes logits"]),
    ("train-rollback-skip-0", "train", None, ["--job.config_file", DEBUG, "--ledger.rollback.skip", "0"], 2, ["--ledger.rollback.skip"]),
    ("train-spike-window-1", "train", None, ["--job.config_file", DEBUG, "--ledger.spike.window", "1"], 2, ["--ledger.spike.window"]),
    ("train-ledger-folder-up", "train", None, ["--job.config_file", DEBUG, "--ledger.folder", "../x"], 2, ["--ledger.folder", "../x"]),
    ("train-ledger-folder-absolute", "train", None, ["--job.config_file", DEBUG, "--ledger.folder", "/tmp/x"], 2, ["--ledger.folder"]),
    ("train-device-gpu", "train", None, ["--job.config_file", DEBUG, "--ledger.device", "gpu"], 2, ["--ledger.device", "'gpu'"]),
    ("train-world-size-mismatch", "train", None, ["--job.config_file", DEBUG, "--parallelism.tensor_parallel_degree", "2"], 2, ["--parallelism", "world size is 2"]),
    ("train-degree-zero", "train", None, ["--job.config_file", DEBUG, "--parallelism.tensor_parallel_degree", "0"], 2, ["--parallelism.tensor_parallel_degree 0"]),
    ("train-overlay-missing", "train", None, ["--job.config_file", DEBUG, "--job.overlay", "{t}/o.toml"], 2, ["o.toml", "no such config file"]),
    ("train-overlay-sets-job", "train", lambda t: (t / "o.toml").write_text("[job]\nconfig = 'x'\n"), ["--job.config_file", DEBUG, "--job.overlay", "{t}/o.toml"], 2, ["o.toml", "[job]"]),
    ("train-overlay-unknown-key", "train", lambda t: (t / "o.toml").write_text("[checkpoint]\nload_stepp = 3\n"), ["--job.config_file", DEBUG, "--job.overlay", "{t}/o.toml"], 2, ["o.toml", "load_stepp"]),
    ("train-base-config-unknown", "train", None, ["--config", "no_such_config"], 2, ["no_such_config"]),
    ("train-module-unknown", "train", None, ["--module", "no_such_module", "--config", "x"], 2, ["no_such_module"]),
    ("train-dataloader-source-bogus", "train", None, ["--job.config_file", DEBUG, "--dataloader.source", "web"], 2, ["--dataloader.source"]),
    ("train-dataloader-workers-negative", "train", None, ["--job.config_file", DEBUG, "--dataloader.num_workers", "-1"], 2, ["--dataloader.num_workers -1"]),
    ("train-indexed-without-paths", "train", None, ["--job.config_file", DEBUG, "--dataloader.source", "indexed"], 2, ["--dataloader.paths"]),
    ("train-load-step-missing", "train", None, ["--job.config_file", DEBUG, "--job.dump_folder", "{t}/run", "--checkpoint.enable", "--checkpoint.load_step", "5"], 2, ["--checkpoint.load_step 5", "step-5", "does not exist"]),
    ("train-load-step-incomplete", "train", with_run(incomplete_checkpoints), ["--job.config_file", DEBUG, "--job.dump_folder", "{t}/run", "--checkpoint.enable", "--checkpoint.load_step", "10"], 2, ["--checkpoint.load_step 10", "step-10", ".metadata"]),
    # ---------------------------------------------------------------- titan_ledger.launch (one line before torchrun)
    ("launch-no-separator", "launch", None, ["--nproc", "2", "--job.config_file", DEBUG], 2, ["`--`"]),
    ("launch-nproc-0", "launch", None, ["--nproc", "0", "--", "--job.config_file", DEBUG], 2, ["--nproc 0"]),
    ("launch-nproc-not-int", "launch", None, ["--nproc", "two", "--", "--job.config_file", DEBUG], 2, ["--nproc 'two'"]),
    ("launch-no-train-flags", "launch", None, ["--nproc", "2", "--"], 2, ["--job.config_file"]),
    ("launch-steps-negative", "launch", None, ["--nproc", "2", "--", "--job.config_file", DEBUG, "--training.steps", "-1"], 2, ["--training.steps -1"]),
    ("launch-world-size", "launch", None, ["--nproc", "3", "--", "--job.config_file", DEBUG], 2, ["world size is 3"]),
    ("launch-inject-rank", "launch", None, ["--nproc", "2", "--", "--job.config_file", DEBUG, "--ledger.rehearsal.inject", "3:4:repeat"], 2, ["DP rank 4"]),
    ("launch-bad-nnodes", "launch", None, ["--nproc", "2", "--nnodes", "x", "--", "--job.config_file", DEBUG], 2, ["--nnodes"]),
    ("launch-dump-folder-other-seq-len", "launch", with_run(mbs=4, checkpoints=()), ["--nproc", "2", "--", "--job.config_file", DEBUG, "--job.dump_folder", "{t}/run", "--training.seq_len", "128"], 2, ["{t}/run", "seq_len 256", "128", "--ledger.new_run"]),
    ("launch-dump-folder-other-global-batch", "launch", with_run(mbs=4, checkpoints=()), ["--nproc", "2", "--", "--job.config_file", DEBUG, "--job.dump_folder", "{t}/run", "--training.local_batch_size", "2"], 2, ["{t}/run", "global_batch 8", "4", "--ledger.new_run"]),
    ("launch-dump-folder-same-layout", "launch", with_debug_run(mbs=4, checkpoints=()), ["--nproc", "2", "--print", "--", "--job.config_file", DEBUG, "--job.dump_folder", "{t}/run"], 0, ["titan_ledger.train"]),
    ("launch-dump-folder-other-fingerprint", "launch", with_run(mbs=4, checkpoints=()), ["--nproc", "2", "--print", "--", "--job.config_file", DEBUG, "--job.dump_folder", "{t}/run"], 2, ["{t}/run", "fingerprint 'fp-a'", "--ledger.new_run"]),
    ("launch-dump-folder-new-run", "launch", with_run(mbs=4, checkpoints=()), ["--nproc", "2", "--print", "--", "--job.config_file", DEBUG, "--job.dump_folder", "{t}/run", "--training.seq_len", "128", "--ledger.new_run"], 0, ["--ledger.new_run"]),
    ("launch-ok-print", "launch", None, ["--nproc", "2", "--print", "--", "--job.config_file", DEBUG], 0, ["torch.distributed.run", "--nproc_per_node 2", "titan_ledger.train"]),
    ("launch-two-nodes-print", "launch", None, ["--nproc", "1", "--nnodes", "2", "--rdzv_endpoint", "h:1", "--print", "--", "--job.config_file", DEBUG], 0, ["--nnodes 2", "--rdzv_endpoint h:1"]),
]


def _main(tool):
    import importlib

    return importlib.import_module(f"titan_ledger.{tool}").main


@pytest.fixture
def no_training(monkeypatch):
    """train.main parses as it would on rank 0 of 2 ranks, then fails instead of training."""
    from titan_ledger import train

    def parse_only(argv):
        train.quiet_imports()
        train.load_config(argv)
        raise AssertionError("the config was accepted: this case would have trained")

    monkeypatch.setattr(train, "run", parse_only)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")


def call(tool: str, argv: list[str]) -> int:
    try:
        code = _main(tool)(argv)
    except SystemExit as e:
        code = e.code
    return 0 if code is None else code


@pytest.mark.parametrize("cid,tool,setup,argv,code,must", CASES, ids=[c[0] for c in CASES])
def test_bad_input(cid, tool, setup, argv, code, must, tmp_path, capsys, no_training, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        setup(tmp_path)
    argv = [a.replace("{t}", str(tmp_path)) for a in argv]
    before = _files(tmp_path)
    got = call(tool, argv)
    out, err = capsys.readouterr()
    err_lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert got == code, f"exit {got}, expected {code}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    if code == 2:
        assert len(err_lines) == 1, f"expected ONE stderr line, got {len(err_lines)}:\n{err}"
        line = err_lines[0]
        assert line.startswith(f"titan_ledger.{tool}: error: "), line
        for m in must:
            assert m.replace("{t}", str(tmp_path)) in line, f"{m!r} not in: {line}"
        assert out == "", f"partial output on stdout with an error:\n{out[:2000]}"
        if tool not in ("prepare", "train", "launch"):  # their own checks below / no outputs
            after = _files(tmp_path)
            assert after == before, f"written with an error: {sorted(set(after.items()) ^ set(before.items()))}"
    else:
        assert len(err_lines) <= 1 and all("warning" in ln for ln in err_lines), err
        for m in must:
            if m.startswith("warning:"):
                assert len(err_lines) == 1 and err_lines[0].startswith(f"titan_ledger.{tool}: warning: "), err
                assert m.removeprefix("warning:") in err_lines[0], f"{m!r} not in: {err_lines[0]}"
            else:
                assert m in out, f"{m!r} not in stdout:\n{out[:3000]}"
    if tool == "prepare":  # a failed or finished prepare leaves no .tmp behind
        assert not list(tmp_path.rglob("*.tmp")), list(tmp_path.rglob("*.tmp"))


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: (size, mtime in ns). A ledger file's offset index
    (``<file>.idx``) is a cache of it, rebuilt by any reader that finds it missing or
    out of date (these cases edit the JSONL behind it): not counted."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".idx")}


def test_the_table_is_big_and_covers_every_tool():
    tools = {c[1] for c in CASES}
    assert tools == {"lookup", "diagnose", "plot", "report", "rollback", "replay", "prepare", "train", "launch"}
    assert len(CASES) >= 100
    assert len({c[0] for c in CASES}) == len(CASES)


# --------------------------------------------------------------------------- a real pipe
def test_lookup_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """``lookup ... | head -1``: the reader goes away after one line; exit 0, no BrokenPipeError."""
    make_run(tmp_path / "run", steps=2, mbs=3000, spike_at=None, checkpoints=())  # ~300 KB per step
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "titan_ledger.lookup", "--dump-folder", str(tmp_path / "run"),
                          "--step", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    first = p.stdout.readline()
    p.stdout.close()  # what head -1 does
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert first.startswith(b"step 1: trained")
    assert rc == 0 and err == "", (rc, err)


# --------------------------------------------------------------------------- issue 26 in real processes
def _lookup(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "titan_ledger.lookup", *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)


def test_a_process_warns_once_for_a_torn_last_line_and_refuses_a_corrupt_row(tmp_path):
    """``python -m titan_ledger.lookup``: a torn last line answers with ONE warning line on
    stderr; a garbage row mid-file is exit 2, ONE error line naming FILE:LINE."""
    dump = make_run(tmp_path / "run", spike_at=None, checkpoints=())
    tear(dump / "ledger" / "data_dp1.jsonl")
    p = _lookup("--dump-folder", str(dump), "--step", "7")
    assert p.returncode == 0 and p.stdout.startswith("step 7: trained"), (p.returncode, p.stderr)
    assert p.stderr.splitlines() == [f"titan_ledger.lookup: warning: {dump}/ledger/data_dp1.jsonl:32: torn "
                                     f"last line skipped (a kill -9 mid-write)"], p.stderr
    replace_line(dump / "ledger" / "data_dp0.jsonl", 9, b"\x00garbage")
    p = _lookup("--dump-folder", str(dump), "--step", "7")
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"titan_ledger.lookup: error: {dump}/ledger/data_dp0.jsonl:9: not a ledger row (not JSON)"), p.stderr


def test_a_process_refuses_a_sample_outside_the_run_and_writes_no_cache(tmp_path):
    """``lookup --sample N`` past the run's last sample: exit 2 naming the range, and no epoch
    cache for N's epoch in the corpus folder (a sample inside the run answers)."""
    dump = make_indexed_run(tmp_path / "run", tmp_path / "corpus")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "corpus").rglob("*"))
    p = _lookup("--dump-folder", str(dump), "--sample", "1000000000000")
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert p.stderr.splitlines() == [
        f"titan_ledger.lookup: error: sample 1000000000000: outside the run: it consumed samples 0-119 "
        f"(steps 1-30, {dump}/ledger); give a sample id in that range"], p.stderr
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "corpus").rglob("*")) == before
    p = _lookup("--dump-folder", str(dump), "--sample", "7", "--json")
    assert p.returncode == 0 and '"sample_id": 7' in p.stdout and p.stderr == "", p.stderr


# --------------------------------------------------------------------------- a dump folder belongs to one run
@pytest.mark.parametrize("key,kw,value", [("seq_len", {"seq_len": 512}, 512),
                                          ("global_batch", {"global_batch": 8}, 8),
                                          ("fingerprint", {"fingerprint": "fp-b"}, "fp-b")])
def test_reusing_a_dump_folder_with_another_layout_is_refused(tmp_path, key, kw, value):
    from titan_ledger.components.run.run_folder import claim_dump_folder

    make_run(tmp_path / "run", checkpoints=())  # nothing to resume: a second run would append
    layout = {"seq_len": 256, "global_batch": 4, "fingerprint": "fp-a", **kw}
    with pytest.raises(ConfigError) as e:
        claim_dump_folder(tmp_path / "run", "ledger", layout)
    line = fail_line("titan_ledger.train", e.value)
    assert "\n" not in line and e.value.exit_code == 2
    for m in (str(tmp_path / "run"), key, repr(value), "--ledger.new_run", "--dump_folder"):
        assert m in line, line
    assert (tmp_path / "run" / "ledger" / "signals.jsonl").exists()  # nothing touched


def test_the_same_layout_resumes_and_allow_data_change_is_a_resume(tmp_path):
    from titan_ledger.components.run.run_folder import claim_dump_folder

    make_run(tmp_path / "run")
    same = {"seq_len": 256, "global_batch": 4, "fingerprint": "fp-a"}
    assert claim_dump_folder(tmp_path / "run", "ledger", same) == []
    assert claim_dump_folder(tmp_path / "run", "ledger", same, new_run=True) == []  # a relaunch
    assert claim_dump_folder(tmp_path / "run", "ledger", {**same, "fingerprint": "fp-b"},
                             allow_data_change=True) == []
    assert claim_dump_folder(tmp_path / "fresh", "ledger", same) == []
    assert (tmp_path / "run" / "ledger" / "data_dp0.jsonl").exists()


def test_a_resume_leaves_data_changes_to_the_checkpoint_load_but_not_the_global_batch(tmp_path):
    """With a complete checkpoint the launch resumes: a changed seq_len/fingerprint is refused
    by the checkpoint load (DataStateError naming --ledger.allow_data_change), the batch here."""
    from titan_ledger.components.run.run_folder import claim_dump_folder

    make_run(tmp_path / "run")  # checkpoints step-10, step-20
    assert claim_dump_folder(tmp_path / "run", "ledger", {"seq_len": 512, "fingerprint": "fp-b"}) == []
    with pytest.raises(ConfigError, match="global_batch 4, this run has 8"):
        claim_dump_folder(tmp_path / "run", "ledger", {"seq_len": 512, "global_batch": 8})
    with pytest.raises(ConfigError, match="seq_len 256"):  # checkpointing off: no resume
        claim_dump_folder(tmp_path / "run", "ledger", {"seq_len": 512}, checkpoint_enabled=False)


def test_new_run_moves_the_old_run_aside_never_mixes(tmp_path):
    from titan_ledger.components.run.run_folder import claim_dump_folder
    from titan_ledger.format.reader import RunLedger

    dump = make_run(tmp_path / "run")
    moved = claim_dump_folder(dump, "ledger", {"seq_len": 512}, new_run=True)
    assert moved == [str(dump / "ledger.old-1"), str(dump / "checkpoint.old-1")]
    assert not (dump / "ledger").exists() and not (dump / "checkpoint").exists()
    assert RunLedger(dump, "ledger.old-1").data.header()["seq_len"] == 256  # kept whole
    make_run(dump, seq_len=512)
    assert claim_dump_folder(dump, "ledger", {"seq_len": 1024}, new_run=True)[0].endswith("ledger.old-2")


def test_an_unreadable_old_ledger_does_not_block_a_resume(tmp_path):
    from titan_ledger.components.run.run_folder import claim_dump_folder

    make_run(tmp_path / "run")
    (tmp_path / "run" / "ledger" / "data_dp0.jsonl").write_bytes(b"")
    assert claim_dump_folder(tmp_path / "run", "ledger", {"seq_len": 512}) == []


def test_every_error_class_has_the_bad_input_exit_code():
    from titan_ledger import errors

    for cls in (errors.ConfigError, errors.CorpusError, errors.LedgerError, errors.DataStateError,
                errors.SkipError, errors.PlanError):
        assert issubclass(cls, TitanLedgerError) and cls("x").exit_code == errors.EXIT_BAD_INPUT
