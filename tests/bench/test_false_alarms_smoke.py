"""bench/false_alarms.py end to end on one short clean run (about 30 s on 2 cores).

One 20-step DP 2 run on the bundled text (2 rows x 128 tokens per rank, prepared
into a temp folder): the JSON line carries the counts, every rule, and the offline
replay of the recorded ledger agrees with the online decision step by step.
"""

import json
import subprocess
import sys

import pytest
from helpers import ROOT, child_env

pytestmark = pytest.mark.slow


def test_one_clean_run_is_counted_and_replayed_identically(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "false_alarms.py"), "--json", "--corpus", "text",
                           "--dp", "2", "--start", "cold", "--seeds", "0", "--steps", "20", "--local-batch-size", "2",
                           "--seq-len", "128", "--folder", str(tmp_path / "runs"), "--corpora-dir",
                           str(tmp_path / "corpora")], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["clean_steps"] == 20 and res["fresh_steps"] == 20
    assert res["acting_flags"] == len(res["steps"])
    assert set(res["flags_by_rule"]) >= {"zscore_loss", "ratio", "rank_separation", "doc_high", "doc_low",
                                         "grad_jump"}
    assert res["replay_identical"] is True, res["runs"][0]["replay"]
    run = res["runs"][0]
    assert run["replay"]["steps"] == 20 and run["replay"]["mismatches"] == []
    assert run["first_loss"] > run["last_loss"]  # it trained
