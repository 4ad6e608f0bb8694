"""Host snapshots and the window proof end to end (issue 51 item 4): five launches.

A real instability, no fault injected: the tiny model (FSDP2 over 2 gloo ranks) at LR
1.0 after a 20-step warm-up flags step 9 (the loss ratio); the proof at the alarm finds
the step reproducible and not the data (``not_data``). With ``--ledger.snapshots.every
4 --ledger.snapshots.keep 3`` the trainer then re-runs steps 1-9 from the host snapshot
of step 0 in process (``components.response.window_proof``) -- unchanged (the flag reproduces, bit for bit) and with every
step's LR x 0.1 (the update comes out normal) -- and records ``lr`` proven; the
rollback the run is configured for then restores the host snapshot of step 8 instead of
loading checkpoint step-8. The same command without the ring rolls back from the
checkpoint: every row of the two runs is equal, bit for bit (the window proof leaves no
trace in the run, and the host rollback restores what the checkpoint load does). A
third, whose restore from host memory fails (``--ledger.rehearsal.response_fault
restore:raise``, issue 60), loads the checkpoint instead and trains the same rows. Then
PP 2 and FSDP2 x TP 2: a forced proof's window replays a clean step bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import CONFIGS, chromium_dom, cli, explain, signals_ledger, spike_events, torchrun

from titan_ledger.format.records import read_ledger
from titan_ledger.format.signal_columns import TIMING_KEYS
from titan_ledger.tools import diagnose

pytestmark = pytest.mark.slow

FLAGS = ["--job.config_file", str(CONFIGS / "tiny_cpu.toml"), "--training.steps", "12",
         "--optimizer.lr", "1.0", "--lr_scheduler.warmup_steps", "20", "--lr_scheduler.decay_type", "cosine",
         "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0", "--debug.seed", "0",
         "--ledger.response.policy", "act", "--ledger.response.action", "rollback", "--ledger.rollback.back", "1",
         "--ledger.rollback.skip", "2"]
RING = ["--ledger.snapshots.every", "4", "--ledger.snapshots.keep", "3"]
SPIKE = 9


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, extra in (("ring", RING), ("plain", []),
                        ("restore_fails", [*RING, "--ledger.rehearsal.response_fault", "restore:raise"])):
        d = tmp_path_factory.mktemp("snapshots") / name
        p = torchrun(FLAGS + extra + ["--job.dump_folder", str(d)])
        assert p.returncode == 0, explain(p)
        out[name] = (d, p.stdout + p.stderr)
    return out


def window_at(dump, step):
    """The window proof recorded with ``step``'s proof (a flag's event, or a forced proof's)."""
    events = read_ledger(Path(dump) / "ledger" / "spikes.jsonl").history
    return next(e["proof"]["window"] for e in events if e.get("step") == step and (e.get("proof") or {}).get("window"))


def test_the_lr_is_proven_in_process_from_the_host_snapshot(runs):
    d, log = runs["ring"]
    w = window_at(d, SPIKE)
    assert w["cause"] == "lr" and w["from_step"] == 0 and w["steps"] == SPIKE
    by = {r["variant"]: r for r in w["runs"]}
    same, lr = by["same"], by["lr"]
    led = signals_ledger(d)  # the spiked step's row (superseded by the rollback)
    row = next(r for r in led.superseded + led.history if r.get("step") == SPIKE and r.get("loss") is not None)
    assert not same["normal"]
    assert (same["loss"], same["grad_norm"]) == (row["loss"], row["grad_norm"])  # the window replayed bit for bit
    assert lr["normal"] and lr["grad_norm"] < row["grad_norm"] / 5
    # every fix tried, each with its cost (the window's last steps' loss against the unchanged
    # re-run's); the LR's lowers it (the run learns better at 0.1x), the others' raise it: the
    # cheapest fix that removes the spike names the cause
    assert sorted(by) == ["control", "eps", "logit_cap", "lr", "same", "zloss"] and lr["cost"] < 0
    assert lr["effect"] == "removed" and by["control"]["effect"] != "removed"  # the one judge; the control (LR x 1.1)
    assert w["fixes"][0] == {"variant": "lr", "cause": "lr", "cost": lr["cost"]}
    assert all(f["cost"] >= lr["cost"] for f in w["fixes"])
    assert "not run: adam" in w["why"]  # torchtitan's default beta2 is 0.95 already: the variant would change nothing
    assert f"rolling back from step {SPIKE} to the host snapshot of step 8" in log
    rc, out, err = cli(diagnose.main, [str(d), "--step", str(SPIKE), "--json"])
    assert rc == 0, err
    res = json.loads(out)["spikes"][0]
    a = res["answer"]  # the one answer: the LR, proven by its fix in the window, the fix a change to this run
    assert (a["cause"], a["established"], a["fix"]["variant"]) == ("lr", "window", "lr"), a
    assert a["fix"]["flags"][0] == "--optimizer.lr" and "(now 1)" in a["fix"]["change"] and a["command"]


def test_the_in_process_lr_page_tells_one_story_in_a_browser(runs, tmp_path):
    """Issues 62 and 67: the incident page of the LR proven in process, as chromium builds it:
    the answer box first (the LR, proven by its fix in the window, the fix and its command);
    the window's re-runs are table rows (variant, the one judge's effect, loss cost); no empty header
    row; the rerun section says the step was proven in process; the rollback plan fits
    this 12-step run and its commands use the run's interpreter."""
    import re
    import sys

    from titan_ledger.errors import python_command
    from titan_ledger.tools.report import report

    d, _ = runs["ring"]
    out = tmp_path / "lr.html"
    report(d, SPIKE, out)
    dom = chromium_dom(out, tmp_path / "profile")
    box = dom.split("<div class=\"answer\">")[1].split("</div>")[0]
    proof = dom.split("<h2>Proof at the alarm</h2>")[1].split("<h2>")[0]
    assert "<p class=\"cause\">the learning rate</p>" in box and "proven by its fix in the window" in box, box
    assert "--optimizer.lr 0.1 (now 1)" in box and "<pre>" in box  # the fix, and its command
    assert "<th>cause</th>" not in proof  # the proof table keeps what it measured; the answer names the cause
    rows = re.findall(r"<tr><td>window from step 0</td><td>(\w+)</td>(?:<td>[^<]*</td>){3}<td>([^<]*)</td>"
                      r"<td>[^<]*</td><td>([^<]*)</td>", proof)
    assert [r[0] for r in rows] == ["same", "lr", "eps", "logit_cap", "zloss", "control"], rows
    fixes = [f["variant"] for f in window_at(d, SPIKE)["fixes"]]
    assert [r[0] for r in rows if r[1] == "removed"] == sorted(fixes, key=[r[0] for r in rows].index), rows
    assert rows[0][1] == "" and rows[1][1] == "removed" and rows[1][2].startswith("-"), rows
    assert "<th></th>" not in dom and "grad sq" not in dom
    assert "No rerun: the step was proven in process" in dom
    plan = dom.split("<h2>Rollback plan</h2>")[1]
    assert "Fitted to this run" in plan and "the earliest checkpoint before the spike" in plan and f"{python_command(sys.executable)} -m" in plan


def test_the_run_with_the_ring_equals_the_run_without_it_bit_for_bit(runs):
    (a, _), (b, plain_log) = runs["ring"], runs["plain"]
    assert f"rolling back from step {SPIKE} to checkpoint step-8" in plain_log
    skip = {*TIMING_KEYS, "run_id", "time", "config_digest", "argv", "superseded_by"}
    la, lb = signals_ledger(a), signals_ledger(b)
    for rows_a, rows_b in ((la.history, lb.history), (la.superseded, lb.superseded)):
        assert len(rows_a) == len(rows_b)
        for x, y in zip(rows_a, rows_b):
            assert {k: v for k, v in x.items() if k not in skip} == {k: v for k, v in y.items() if k not in skip}
    assert any(r["step"] == SPIKE and r.get("loss") is not None for r in la.superseded)  # rewound real rows
    ra, rb = ([(e["step"], e["rules"], (e.get("proof") or {}).get("verdict")) for e in spike_events(x)] for x in (a, b))
    assert ra == rb


def test_a_restore_from_host_memory_that_fails_loads_the_checkpoint_instead(runs):
    (a, log), (b, _) = runs["restore_fails"], runs["plain"]
    assert "the response's restore failed (ResponseFault: rehearsal: --ledger.rehearsal.response_fault " \
           "restore:raise); training goes on without it" in log
    assert f"rolling back from step {SPIKE} to checkpoint step-8" in log
    skip = {*TIMING_KEYS, "run_id", "time", "config_digest", "argv", "superseded_by"}
    la, lb = signals_ledger(a), signals_ledger(b)
    assert [{k: v for k, v in x.items() if k not in skip} for x in la.history] == \
        [{k: v for k, v in y.items() if k not in skip} for y in lb.history]
    from titan_ledger.format.reader import RunLedger

    assert [e["response_failure"]["where"] for e in RunLedger(a).response_events()] == ["restore"]


@pytest.mark.parametrize("config,nproc", [("debug_cpu_pp.toml", 2), ("debug_cpu_fsdp_tp.toml", 4)])
def test_the_window_replays_bit_for_bit_under_pipeline_and_tensor_parallelism(config, nproc, tmp_path):
    """``--ledger.rehearsal.prove_at 7`` proves a clean step and the window proof replays
    steps 5-7 from the host snapshot of step 4 -- each rank restoring its own shards (PP's
    stage, FSDP2 x TP's DTensor pieces) -- through the pipeline schedule: the unchanged
    replay equals the step's row bit for bit, and nothing is proven (no spike)."""
    d = tmp_path / "run"
    p = torchrun(["--job.config_file", str(CONFIGS / config), "--training.steps", "8", "--training.seq_len", "128",
                  "--debug.seed", "0", "--ledger.rehearsal.prove_at", "7", "--ledger.snapshots.every", "2",
                  "--ledger.snapshots.keep", "2",
                  "--job.dump_folder", str(d)], nproc=nproc)
    assert p.returncode == 0, explain(p)
    w = window_at(d, 7)
    row = signals_ledger(d).by_step()[7]
    same = w["runs"][0]
    assert (w["from_step"], w["steps"], w["cause"]) == (4, 3, None)
    assert same["variant"] == "same" and (same["loss"], same["grad_norm"]) == (row["loss"], row["grad_norm"])
    assert "did not reproduce the spike" in w["why"]
