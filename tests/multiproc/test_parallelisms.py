"""The CPU rehearsal trains every parallelism from TOML over real gloo processes.

Reads the session's straight run of each parallelism (``runs.straight``, conftest.py),
which ``test_signals_exact.py`` and the resume tests read too.
"""

import math

import pytest
from conftest import PARALLELISMS, STEPS
from helpers import TB_GRAD_NORM, read_tb, signals_rows

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", list(PARALLELISMS))
def test_trains_from_toml(runs, case):
    dump = runs.straight(case)
    losses = read_tb(dump)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    # A fresh model over a 2048-token vocabulary starts near ln(2048) = 7.62 (the
    # cross-entropy: the z-loss the TP and PP runs add is w * z_loss of the ledger row)
    assert all(math.isfinite(v) for v in losses.values())
    ce = losses[1] - PARALLELISMS[case].z_loss * signals_rows(dump)[1]["z_loss"]
    assert abs(ce - math.log(2048)) < 1.0, (ce, losses)
    grad_norms = read_tb(dump, TB_GRAD_NORM)
    assert all(0 < g < 100 for g in grad_norms.values()), grad_norms
    if case == "FSDP2":
        val = read_tb(dump, "validation_metrics/loss")
        assert 2 in val and all(abs(v - math.log(2048)) < 1.0 for v in val.values()), val
