"""Spike response end to end: injection, detection, update guard, auto-skip,
in-process rollback (== a relaunch), diagnosis, the drill, plot and rollback CLIs."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.e2e.test_data_cli import py
from tests.helpers import CONFIGS, explain, read_tb, torchrun
from titan_ledger import records

pytestmark = pytest.mark.slow

# A short run whose injected step is flagged: debug model, 2 ranks FSDP, window 8.
SHORT = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "12",
         "--ledger.spike.window", "8"]
# Long enough that the model has learned something (the diagnosis needs it): 26 steps.
LONG = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "26",
        "--ledger.spike.window", "16"]


def signals(dump):
    return records.read_ledger(dump / "ledger" / "signals.jsonl").by_step()


def test_update_guard_keeps_adam_exact_and_auto_skip_reuses_the_flags(tmp_path):
    guard, skip = tmp_path / "guard", tmp_path / "skip"
    p = torchrun(SHORT + ["--job.dump_folder", str(guard), "--ledger.inject", "10:1:repeat",
                          "--ledger.on_spike", "skip_update", "--metrics.enable_tensorboard"])
    assert p.returncode == 0, explain(p)
    assert "SPIKE at step 10" in p.stdout + p.stderr
    assert read_tb(guard, "spike/flag") == {10: 1.0}
    assert read_tb(guard, "spike/zscore_grad_norm") == {10: 1.0}
    g = signals(guard)
    assert g[10]["spike"] and g[10]["update_skipped"] and g[10]["loss_max_rank"] == 1
    assert not any(g[s]["spike"] or g[s]["update_skipped"] for s in g if s != 10)
    ev = records.read_ledger(guard / "ledger" / "spikes.jsonl").history
    assert [e["step"] for e in ev] == [10] and "zscore_grad_norm" in ev[0]["rules"]
    # Not applying step 10's update == skipping step 10 with the LR schedule advancing:
    # params, Adam moments AND Adam's step count (bias correction) must all agree, so
    # the following steps are bit-identical (OLMo-core PR 309/317 would break this).
    p = torchrun(SHORT + ["--job.dump_folder", str(skip), "--ledger.skip_steps", "10",
                          "--ledger.skip_lr", "advance"])
    assert p.returncode == 0, explain(p)
    s = signals(skip)
    assert [(g[k]["loss"], g[k]["grad_norm"]) for k in (11, 12)] == \
        [(s[k]["loss"], s[k]["grad_norm"]) for k in (11, 12)]
    # auto_skip: a new launch in the same folder (no checkpoints: it starts over) skips
    # the step listed in rejected_steps.jsonl
    assert [r["step"] for r in records.read_ledger(guard / "ledger" / "rejected_steps.jsonl").history] == [10]
    p = torchrun(SHORT + ["--job.dump_folder", str(guard), "--ledger.auto_skip", "--ledger.skip_lr", "advance"])
    assert p.returncode == 0, explain(p)
    a = signals(guard)
    assert a[10]["skipped"] and [(a[k]["loss"]) for k in (11, 12)] == [s[k]["loss"] for k in (11, 12)]


def test_inject_is_seen_and_diagnosed_as_bad_data_of_that_rank(tmp_path):
    d = tmp_path / "inj"
    p = py("-m", "titan_ledger.replay", "inject", "--step", "24", "--rank", "1", "--kind", "repeat",
           "--dump-folder", str(d), "--json", "--", *LONG)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["shown"] and out["loss_max_rank"] == 1 and out["grad_norm_ratio"] > 3
    diag = py("-m", "titan_ledger.diagnose", str(d), "--json")
    assert diag.returncode == 0, diag.stderr
    spikes = json.loads(diag.stdout)["spikes"]
    assert [(x["step"], x["cause"], x["rank"]) for x in spikes] == [(24, "bad_data", 1)]
    # lookup shows the rows of that step and marks them as replaced
    data = records.read_ledger(d / "ledger" / "data_dp1.jsonl").by_step()
    assert data[24]["injected"] == "repeat" and "injected" not in data[23]
    # the plot marks it
    png = tmp_path / "s.png"
    p = py("-m", "titan_ledger.plot", str(d), "-o", str(png))
    assert p.returncode == 0 and "1 spikes" in p.stdout and png.stat().st_size > 10_000
    # rollback planner: checkpoint-free run -> a clear error naming the flag
    r = py("-m", "titan_ledger.rollback", "--dump-folder", str(d), "--spike-step", "24")
    assert r.returncode == 2 and "--back" in r.stderr


def test_in_process_rollback_equals_a_relaunch_with_the_planned_overrides(tmp_path):
    flags = LONG + ["--ledger.inject", "24:1:repeat", "--checkpoint.enable", "--checkpoint.interval", "8",
                    "--ledger.on_spike", "rollback", "--ledger.rollback_back", "1", "--ledger.rollback_skip", "2"]
    live = tmp_path / "live"
    p = torchrun(flags + ["--job.dump_folder", str(live)])
    assert p.returncode == 0, explain(p)
    assert "rolling back from step 24 to checkpoint step-16; skipping steps 17-24" in p.stdout + p.stderr
    led = records.read_ledger(live / "ledger" / "signals.jsonl")
    assert [r["step"] for r in led.superseded] == list(range(17, 25))
    cur = led.by_step()
    assert cur[17]["skipped"] and cur[17]["last_step"] == 24 and 25 in cur
    # the planner proposes the same fix, as flags and as an overlay
    overlay = tmp_path / "rollback.toml"
    r = py("-m", "titan_ledger.rollback", "--dump-folder", str(live), "--spike-step", "24",
           "--back", "1", "--skip", "8", "--write", str(overlay), "--json")
    plan = json.loads(r.stdout)
    assert plan["load_step"] == 16 and plan["skip_window"] == [17, 24]
    # relaunch from that checkpoint in another folder with the overlay
    again = tmp_path / "again" / "checkpoint"
    again.mkdir(parents=True)
    shutil.copytree(live / "checkpoint" / "step-16", again / "step-16")
    p = torchrun(flags + ["--job.dump_folder", str(again.parent), "--job.overlay", str(overlay)])
    assert p.returncode == 0, explain(p)
    rel = signals(again.parent)
    for k in (25, 26):
        assert (cur[k]["loss"], cur[k]["grad_norm"], cur[k]["lr"]) == \
            (rel[k]["loss"], rel[k]["grad_norm"], rel[k]["lr"]), k
    # the data ledgers agree too (same samples consumed and skipped from step 17 on;
    # the relaunch's folder holds no rows before its checkpoint)
    from titan_ledger.data.provenance import DataLedger
    from titan_ledger.replay import step_ids

    a, b = step_ids(DataLedger(live / "ledger")), step_ids(DataLedger(again.parent / "ledger"))
    assert sorted(b) == list(range(17, 27))
    assert {k: a[k] for k in b} == b
    assert b[20][0][0] == "skipped" and b[25][0][0] != "skipped"


def test_drill(tmp_path):
    p = py("-m", "titan_ledger.replay", "drill", "--step", "10", "--rank", "1", "--dump-folder",
           str(tmp_path), "--json", "--", *SHORT, "--checkpoint.interval", "4")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["passed"] and out["located"]["step"] == 10
    assert out["rollback"] == {"load_step": 8, "skip_window": [9, 11]}
    assert out["spikes_after_rollback"] == [] and out["steps_compared"] == 12
