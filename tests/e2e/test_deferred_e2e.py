"""Deferred decisions against in-step decisions, on the ladder's actions (no proof): six
launches of the debug model, DP 2, three pairs, each run once deferring (the default) and
once with ``--ledger.response.no_defer``. The pair must write the same rows, data rows
and decisions.

``ladder`` (``[ledger.proof] scope = "off"``, ``action = "none,skip_update,rollback*3"``, checkpoints
every 4 steps, the data running out at step 16): a flipped gradient bit at step 6 gets
the ``none`` rung (its faulty update is applied, as in the step: not held, so not
recomputed without the fault), one at 10 ``skip_update`` (held, never applied), one at
13 a rollback decided at step 14 (step 14 dropped, back to step 12, step 13 skipped),
and the repeated batch at 15 a rollback decided when the data ran out at 16 (it runs, as
it would have before 16's fetch, and the data runs out again at 16).

``non_finite`` (an LR of 1e30, ``[ledger.proof] scope = "off"``, ``action = "none,skip_update"``): step
1's update makes the parameters infinite; step 2's NaN gradients get the ``none`` rung
(applied), so step 3's loss is NaN on a logging step, where torchtitan would stop the run
before step 3's deferred decision: it is made, recorded and its row written first, and the
ledger stops the run at that row, as in the step. ``non_finite_quiet``: the same, logging
every 10 steps, so step 3 is decided at step 4 and the ledger stops there, before step 4
is recorded.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import CONFIGS, explain, torchrun

from titan_ledger.format.signal_columns import TIMING_KEYS

pytestmark = pytest.mark.slow

BASE = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.local_batch_size", "2",
        "--training.seq_len", "128", "--ledger.proof.scope", "off"]
PAIRS = {
    "ladder": ["--training.steps", "18", "--ledger.spike.window", "5",
               "--ledger.response.policy", "act", "--ledger.response.action", "none,skip_update,rollback*3",
               "--ledger.rehearsal.inject", "6:0:bitflip,10:1:bitflip,13:0:bitflip,15:1:repeat",
               "--checkpoint.enable", "--checkpoint.interval", "4", "--ledger.rollback.back", "0",
               "--ledger.rollback.skip", "1", "--ledger.rehearsal.data_end", "16"],
    "non_finite": ["--training.steps", "6", "--optimizer.lr", "1e30", "--ledger.response.policy", "act", "--ledger.response.action", "none,skip_update"],
}
PAIRS["non_finite_quiet"] = [*PAIRS["non_finite"], "--metrics.log_freq", "10"]  # step 3 logs nothing
TIMING = {*TIMING_KEYS, "time", "run_id"}  # the table's wall-clock columns, a header's time and id
HEADER = {"schema", "seq", "resumed_from", "rewind_from"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deferred")

    def one(job):
        name, mode = job
        d = root / f"{name}-{mode}"
        extra = ["--ledger.response.no_defer"] if mode == "in_step" else []
        return job, d, torchrun([*BASE, *PAIRS[name], *extra, "--job.dump_folder", str(d)])

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(one, [(n, m) for n in PAIRS for m in ("deferred", "in_step")]))
    return {job: (d, p) for job, d, p in done}


def lines(path) -> list[dict]:
    """Every record of a ledger file, every segment, without what differs between two
    launches of the same run (times, ids, the command line: a header keeps where its
    segment starts)."""
    out = []
    for x in path.read_text().splitlines():
        r = json.loads(x)
        keep = HEADER if "schema" in r else r.keys() - TIMING
        out.append({k: r[k] for k in keep if k in r})
    return out


def ledger(d) -> dict[str, list[dict]]:
    """The rows: signals, per rank, per DP rank's data."""
    return {f.name: lines(f) for f in sorted((d / "ledger").glob("*.jsonl"))
            if f.name == "signals.jsonl" or f.name.startswith(("rank", "data_dp"))}


def decisions(d) -> list[dict]:
    return [e for e in lines(d / "ledger" / "spikes.jsonl") if e.get("ladder") or "rewind_to" in e]


def test_ladder_actions_decided_a_step_late_train_the_rows_in_step_decisions_train(runs):
    (d, p), (ref, q) = runs["ladder", "deferred"], runs["ladder", "in_step"]
    assert p.returncode == 0 and q.returncode == 0, (explain(p), explain(q))
    a, b = ledger(d), ledger(ref)
    assert sorted(a) == sorted(b) and {"signals.jsonl", "data_dp0.jsonl", "data_dp1.jsonl"} <= set(a)
    for name in a:  # every segment's header and row, the rewinds' included
        assert a[name] == b[name], name
    late = decisions(d)
    assert [{k: v for k, v in e.items() if k != "decided_at"} for e in late] == decisions(ref)
    acts = [(e["step"], e["action"], e.get("decided_at")) for e in late if e.get("ladder")]
    assert acts == [(6, "none", 7), (10, "skip_update", 11), (13, "rollback*3", 14), (15, "rollback*3", 16)]
    assert [(e["step"], e["rewind_to"], e["skip_window"]) for e in late if "rewind_to" in e] == \
        [(13, 12, [13, 13]), (15, 12, [13, 15])]
    out = p.stdout + p.stderr
    assert out.count("Ran out of data") == 2  # both ranks, once: after the rollback the data ran out again
    rows = [r for r in a["signals.jsonl"] if "step" in r]
    skipped = {r["step"]: r["update_skipped"] for r in rows if not r.get("skipped")}
    assert skipped[6] is False and skipped[10] is True and skipped[13] is True and skipped[15] is True
    assert [r["step"] for r in rows if r.get("skipped")] == [13, 13]  # the two skip windows' rows


@pytest.mark.parametrize("pair", ["non_finite", "non_finite_quiet"])
def test_a_non_finite_loss_on_a_deferred_step_is_decided_and_recorded_before_the_stop(runs, pair):
    """Logging step or not, the run stops at the NaN row of step 3, as in the step: not a
    step later, with step 4 trained, recorded and put on the auto-skip list."""
    (d, p), (ref, q) = runs[pair, "deferred"], runs[pair, "in_step"]
    for proc in (p, q):
        assert proc.returncode != 0 and "loss is not finite (nan) at step 3; the row is in" in proc.stdout + proc.stderr
        assert "Loss is not finite (global_avg_loss" not in proc.stdout + proc.stderr  # the ledger stopped it, at its row
    a, b = ledger(d), ledger(ref)
    assert a["signals.jsonl"] == b["signals.jsonl"] and len([r for r in a["signals.jsonl"] if "step" in r]) == 3
    late = decisions(d)
    at = 3 if pair == "non_finite" else 4
    assert [(e["step"], e["action"], e.get("decided_at")) for e in late] == [(2, "none", 3), (3, "skip_update", at)]
    assert [{k: v for k, v in e.items() if k != "decided_at"} for e in late] == decisions(ref)
    assert [r["update_skipped"] for r in a["signals.jsonl"] if "step" in r] == [False, False, True]
