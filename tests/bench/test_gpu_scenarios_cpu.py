"""The GPU scenario set's CPU mode (bench/device/scenarios.py --cpu), so the set cannot rot
before a GPU is lent: its four runs train through the real CLI, its JSON reads their
ledgers, and the pure judgement (``shows``) gets numbers. Nothing is expected to show at
this length; the bf16 run's precision audit must fail where the fp32 run's passes."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_the_scenario_set_runs_its_pairs_on_the_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench/device/scenarios.py"), "--cpu", "--steps", "12",
                           "--workdir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out == json.loads((tmp_path / "scenarios.json").read_text())
    runs = out["runs"]
    assert out["mode"] == "cpu" and out["not_run"] == [] and sorted(runs) == \
        ["bf16", "fp32", "output_logits", "output_logits_zloss"]
    for name, r in runs.items():
        assert r["rc"] == 0 and r["steps"] == 12 and r["loss_last100"] > 0, (name, r)
        assert r["logz_first_tenth"] is not None and r["logz_last_tenth"] is not None, (name, r)
    assert runs["bf16"]["audit_failed"] and not runs["fp32"]["audit_failed"]  # pure bf16: master weights, moments
    assert set(out["shows"]) == {"output_logits", "bf16"}
    assert isinstance(out["shows"]["output_logits"]["shown"], bool) and out["shows"]["output_logits"]["drift"] > 0
