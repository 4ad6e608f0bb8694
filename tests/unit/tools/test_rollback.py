"""rollback: the plan, the overlay, and the CLI's errors."""

from __future__ import annotations

import pytest
import tomli

from titan_ledger.errors import PlanError
from titan_ledger.tools.rollback import main, overlay_toml, plan


def test_rollback_plan_and_overlay():
    p = plan([100, 200, 300, 400], spike_step=390, back=100, skip=200, existing=["50-60"])
    assert p["load_step"] == 200 and p["skip_window"] == [201, 400]
    assert p["skip_steps"] == ["50-60", "201-400"]
    assert p["overrides"] == ["--checkpoint.load_step", "200", "--ledger.skip.steps", "50-60,201-400"]
    assert tomli.loads(overlay_toml(p)) == {"checkpoint": {"load_step": 200},
                                            "ledger": {"skip": {"steps": ["50-60", "201-400"]}}}
    with pytest.raises(PlanError, match="smaller --back"):
        plan([100], spike_step=150, back=100)
    with pytest.raises(PlanError, match="does not contain the spike"):
        plan([100], spike_step=400, back=100, skip=50)
    with pytest.raises(PlanError, match="--back must be"):
        plan([100], spike_step=400, back=-1)


def test_cli_names_the_folder_and_the_fix(tmp_path, capsys):
    assert main(["--dump-folder", str(tmp_path / "nope"), "--step", "5", "--back", "0"]) == 2
    assert "no such dump folder" in capsys.readouterr().err
    assert main([str(tmp_path), "--step", "5", "--back", "0"]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and "--checkpoint.enable" in err and "smaller --back" not in err
    (tmp_path / "checkpoint" / "step-3").mkdir(parents=True)
    (tmp_path / "checkpoint" / "step-3" / ".metadata").write_bytes(b"x")
    assert main([str(tmp_path), "--step", "5", "--back", "1", "--skip", "4", "--json"]) == 0
    assert '"load_step": 3' in capsys.readouterr().out


def test_the_pages_plan_fits_the_checkpoints_and_the_runs_length():
    """The incident page's plan on a short run: --back 100 from step 22 reaches no
    checkpoint, so the earliest before the spike (step 1) is used; --skip 200 on a 60-step
    run stops at its last step; both said. A run without a checkpoint before the spike has
    no plan, with the fix named."""
    from titan_ledger.errors import PlanError
    from titan_ledger.tools.rollback import fitted_plan

    p, said = fitted_plan([1, 20, 40], 22, 100, 200, last_step=60)
    assert p["load_step"] == 1 and p["skip_window"] == [2, 60] and p["steps_lost"] == 21
    assert "earliest checkpoint before the spike is step 1" in said[0] and "--skip 59" in said[1]
    p, said = fitted_plan([1, 20, 40], 22, 20, 200, last_step=60)  # --back 20 reaches step 1 (no 2-201)
    assert p["load_step"] == 1 and p["skip_window"] == [2, 60] and len(said) == 1
    p, said = fitted_plan([100, 200], 300, 100, 150, last_step=1000)  # nothing to fit
    assert p["load_step"] == 200 and p["skip_window"] == [201, 350] and not said
    with pytest.raises(PlanError, match="checkpoint.enable"):
        fitted_plan([], 22, 100, 200, last_step=60)
    with pytest.raises(PlanError, match="earliest is step 30"):
        fitted_plan([30], 22, 100, 200, last_step=60)
