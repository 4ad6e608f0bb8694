"""Spike response end to end: injection, detection, update guard, auto-skip (and the
``skip_lr = advance`` policy), in-process rollback (== a relaunch), diagnosis, the
drill, plot and rollback CLIs."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import (
    CONFIGS,
    cli,
    data_ids,
    data_rows,
    error_lines,
    explain,
    py,
    read_tb,
    rejected_steps,
    signals_ledger,
    signals_rows,
    spike_events,
    torchrun,
)

from titan_ledger.tools import diagnose, lookup, replay, rollback

pytestmark = pytest.mark.slow

# A short run whose injected step is flagged: debug model, 2 ranks FSDP, window 8, rows
# of 2 x 128 tokens per rank (SMALL: a quarter of the TOML's 4 x 256, whose steps are
# most of a warm launch's time; the injected batch is as visible)
# (no proof at the alarm: these rehearse what a flag does without one -- the guard, the
# rollback, the post-hoc tools; a proof is test_proof_e2e.py's)
SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "128", "--ledger.proof.scope", "off"]
SHORT = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "12",
         "--ledger.spike.window", "8", *SMALL]
# Long enough that the model has learned something (the diagnosis needs it): 26 steps of
# 4 x 128 tokens (at 2 x 128 the repeated batch no longer has the highest loss).
LONG = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "26",
        "--ledger.spike.window", "16", "--training.seq_len", "128", "--ledger.proof.scope", "off"]


def test_update_guard_keeps_adam_exact_and_auto_skip_reuses_the_flags(tmp_path):
    guard = tmp_path / "guard"
    p = torchrun(SHORT + ["--job.dump_folder", str(guard), "--ledger.rehearsal.inject", "10:1:repeat",
                          "--ledger.response.policy", "act", "--ledger.response.action", "skip_update", "--metrics.enable_tensorboard"])
    assert p.returncode == 0, explain(p)
    assert "at step 10: " in p.stdout + p.stderr and "done: the configured action (skip_update)" in p.stdout + p.stderr
    assert read_tb(guard, "spike/flag") == {10: 1.0}
    assert read_tb(guard, "spike/zscore_grad_norm") == {10: 1.0}
    g = signals_rows(guard)
    assert g[10]["spike"] and g[10]["update_skipped"]
    assert not any(g[s]["spike"] or g[s]["update_skipped"] for s in g if s != 10)
    ev = spike_events(guard)
    assert [e["step"] for e in ev] == [10] and "zscore_grad_norm" in ev[0]["rules"]
    assert rejected_steps(guard) == [10]
    # auto_skip: a new launch in the same folder (no checkpoints: it starts over) skips
    # the step listed in rejected_steps.jsonl, here with the LR schedule advancing.
    p = torchrun(SHORT + ["--job.dump_folder", str(guard), "--ledger.skip.auto", "--ledger.skip.lr", "advance"])
    assert p.returncode == 0, explain(p)
    a = signals_rows(guard)
    assert a[10]["skipped"] and a[10]["last_step"] == 10 and a[10]["skip_lr"] == "advance"
    # Not applying step 10's update == skipping step 10 with the LR schedule advancing:
    # params, Adam moments AND Adam's step count (bias correction) must all agree, so
    # the following steps are bit-identical (OLMo-core PR 309/317 would break this).
    assert [(g[k]["loss"], g[k]["grad_norm"]) for k in (11, 12)] == \
        [(a[k]["loss"], a[k]["grad_norm"]) for k in (11, 12)]
    # skip_lr = advance: step 11 runs the schedule's 11th step (freeze would run its 10th)
    assert a[11]["lr"] == g[11]["lr"] and g[10]["lr"] != g[11]["lr"]
    assert all(a[k]["lr"] == g[k]["lr"] for k in range(1, 10))


def test_inject_is_seen_and_diagnosed_as_bad_data_of_that_rank(tmp_path):
    d = tmp_path / "inj"
    # in process (replay's subprocess smoke tests: test_data_cli.py's check, test_rerun_e2e.py's rerun)
    rc, out, err = cli(replay.main, ["inject", "--step", "24", "--rank", "1", "--kind", "repeat",
                                     "--dump-folder", d, "--json", "--", *LONG])
    assert rc == 0, out + err[-3000:]
    out = json.loads(out)
    assert out["shown"] and out["loss_max_rank"] == 1 and out["grad_norm_ratio"] > 3
    # diagnose: its subprocess smoke test
    diag = py("-m", "titan_ledger.diagnose", d, "--json")
    assert diag.returncode == 0, diag.stderr
    spikes = json.loads(diag.stdout)["spikes"]
    assert [(x["step"], x["cause"], x["rank"]) for x in spikes] == [(24, "bad_data", 1)]
    # ... saying the batch was injected: the data ledger's documents of that rank never
    # trained (the batch was replaced), so none is named and no quarantine is proposed
    assert spikes[0]["injected"] == {"1": "repeat"} and spikes[0]["documents"] == [], spikes[0]
    assert "quarantine_command" not in spikes[0]
    assert "batch replaced by an injection (--ledger.rehearsal.inject)" in spikes[0]["documents_note"]
    assert spikes[0]["certainty"] in ("evidence", "guess") and spikes[0]["certainty_rule"]
    q = tmp_path / "q.jsonl"
    rc, out, err = cli(diagnose.main, [str(d), "--step", "24", "--write-quarantine", str(q)])
    assert rc == 2 and "no bad_data verdict named a document" in err and not q.exists()
    # lookup --top: the step's most extreme documents across ranks, against the median
    rc, out, err = cli(lookup.main, ["--dump-folder", str(d), "--step", "24", "--top", "2", "--json"])
    top = json.loads(out)
    assert rc == 0 and top["median_segment_loss"] > 0 and len(top["highest"]) == 2 and len(top["lowest"]) == 2
    # the data ledger marks the rows of that step as replaced
    data = data_rows(d, 1)
    assert data[24]["injected"] == "repeat" and "injected" not in data[23]
    # the plot marks it (its subprocess smoke test)
    png = tmp_path / "s.png"
    p = py("-m", "titan_ledger.plot", d, "-o", png)
    assert p.returncode == 0 and "1 spikes" in p.stdout and png.stat().st_size > 10_000
    # rollback planner: checkpoint-free run -> a clear error naming the flag
    rc, out, err = cli(rollback.main, ["--dump-folder", d, "--step", "24"])
    assert rc == 2 and len(error_lines(err)) == 1 and "checkpoint" in err, out + err


def test_in_process_rollback_equals_a_relaunch_with_the_planned_overrides(tmp_path):
    flags = SHORT + ["--ledger.rehearsal.inject", "10:1:repeat", "--checkpoint.enable", "--checkpoint.interval", "4",
                     "--ledger.response.policy", "act", "--ledger.response.action", "rollback", "--ledger.rollback.back", "1",
                     "--ledger.rollback.skip", "2"]
    live = tmp_path / "live"
    p = torchrun(flags + ["--job.dump_folder", str(live)])
    assert p.returncode == 0, explain(p)
    assert "rolling back from step 10 to checkpoint step-8; skipping steps 9-10" in p.stdout + p.stderr
    led = signals_ledger(live)
    assert [r["step"] for r in led.superseded] == [9, 10]
    cur = led.by_step()
    assert cur[9]["skipped"] and cur[9]["last_step"] == 10 and 11 in cur
    # the planner proposes the same fix, as flags and as an overlay (its subprocess smoke test)
    overlay = tmp_path / "rollback.toml"
    r = py("-m", "titan_ledger.rollback", "--dump-folder", live, "--step", "10",
           "--back", "1", "--skip", "2", "--write", overlay, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads(r.stdout)
    assert plan["load_step"] == 8 and plan["skip_window"] == [9, 10]
    # relaunch from that checkpoint in another folder with the overlay
    again = tmp_path / "again" / "checkpoint"
    again.mkdir(parents=True)
    shutil.copytree(live / "checkpoint" / "step-8", again / "step-8")
    p = torchrun(flags + ["--job.dump_folder", str(again.parent), "--job.overlay", str(overlay)])
    assert p.returncode == 0, explain(p)
    rel = signals_rows(again.parent)
    for k in (11, 12):
        assert (cur[k]["loss"], cur[k]["grad_norm"], cur[k]["lr"]) == \
            (rel[k]["loss"], rel[k]["grad_norm"], rel[k]["lr"]), k
    # the data ledgers agree too (same samples consumed and skipped from step 9 on;
    # the relaunch's folder holds no rows before its checkpoint)
    a, b = data_ids(live), data_ids(again.parent)
    assert sorted(b) == list(range(9, 13))
    assert {k: a[k] for k in b} == b
    assert b[9][0][0] == "skipped" and b[11][0][0] != "skipped"


def test_drill(tmp_path):
    rc, out, err = cli(replay.main, ["drill", "--step", "10", "--rank", "1", "--dump-folder", tmp_path,
                                     "--json", "--", *SHORT, "--checkpoint.interval", "4"])
    assert rc == 0, out + err[-3000:]
    out = json.loads(out)
    assert out["passed"] and out["located"]["step"] == 10
    assert out["rollback"] == {"load_step": 8, "skip_window": [9, 11]}
    assert out["spikes_after_rollback"] == [] and out["steps_compared"] == 12
