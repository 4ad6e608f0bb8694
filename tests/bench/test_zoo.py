"""bench/zoo.py: one scenario of the spike zoo end to end (the zoo itself is a bench).

``hardware_smoke`` is the hardware scenario made cheap (it is in no measured set): a
16-step run at a quarter of the rows with one flipped gradient bit at step 12 and
``diagnose`` (heuristic; ``--no-rerun``: the ``same`` rerun that proves hardware is
``tests/e2e/test_rerun_e2e.py``'s, on the same kind of fault). It must name hardware at
the flagged step 12, with no other flag in the run; the pure table code is checked on the
result it produced.
"""

import json
import subprocess
import sys

import pytest
from helpers import ROOT, child_env, load_bench

pytestmark = pytest.mark.slow


def test_hardware_scenario_is_flagged_and_named(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "zoo.py"), "--only", "hardware_smoke", "--no-rerun", "--json",
                           "--folder", str(tmp_path)], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    res, summary = lines[0], lines[-1]["summary"]
    assert res["scenario"] == "hardware_smoke" and res["train_rc"] == 0 and res["error"] is None, res
    assert res["true_step"] == 12 and res["flagged_step"] == 12 and res["other_flags"] == [], res
    assert res["named_cause"] == "hardware" and res["named_cause_rerun"] is None, res
    assert res["rerun_proven"] is None and res["rerun_variants"] is None, res
    assert any(line.startswith("smoke: 1/1") and "heuristics 1/1 (hardware)" in line for line in summary), summary
    zoo = load_bench("zoo")
    table = zoo.confusion([zoo.Result(**res)], "named_cause")
    assert table[1].split() == ["hardware", "1"]
