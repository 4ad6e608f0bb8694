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
