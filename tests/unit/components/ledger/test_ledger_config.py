"""Ledger.Config: every value wrong on its own fails when the flags are parsed (values wrong
given the others are launch checks, config.validate: test_bad_inputs' train-* cases)."""

import pytest

from titan_ledger.components.detection.spikes import SpikeDetector
from titan_ledger.components.ledger.ledger import (
    FilterConfig,
    Ledger,
    RehearsalConfig,
    SkipConfig,
)
from titan_ledger.components.response.config import (
    ConvictionConfig,
    ProofConfig,
    ResponseConfig,
    RollbackConfig,
    WindowConfig,
)
from titan_ledger.errors import ConfigError, SkipError, TitanLedgerError
from titan_ledger.rehearsal.faults import parse_inject


@pytest.mark.parametrize("kwargs, match", [
    (dict(rehearsal=lambda: RehearsalConfig(inject="8:1")), "--ledger.rehearsal.inject"),
    (dict(rehearsal=lambda: RehearsalConfig(inject="8:1:zeros")), "KIND is repeat or random"),
    (dict(rehearsal=lambda: RehearsalConfig(inject="0:1:repeat")), "STEP >= 1"),
    (dict(rehearsal=lambda: RehearsalConfig(rerun="stop=0")), "--ledger.rehearsal.rerun"),
    (dict(skip=lambda: SkipConfig(steps=["9-3"])), "--ledger.skip.steps"),
    (dict(skip=lambda: SkipConfig(steps=["a-b"])), "--ledger.skip.steps"),
    (dict(rollback=lambda: RollbackConfig(skip=0)), "--ledger.rollback.skip"),
    (dict(rollback=lambda: RollbackConfig(limit=-1)), "--ledger.rollback.limit"),
    (dict(response=lambda: ResponseConfig(action="jump")), "--ledger.response.action"),
    (dict(response=lambda: ResponseConfig(action="rollback")), "--ledger.response.policy is observe"),
    (dict(conviction=lambda: ConvictionConfig(max_share=2.0)), "--ledger.conviction.max_share"),
    (dict(proof=lambda: ProofConfig(scope="sometimes")), "--ledger.proof.scope"),
    (dict(window=lambda: WindowConfig(control=0.5)), "--ledger.window.control"),
    (dict(filter=lambda: FilterConfig(repetition_min=1)), "--ledger.filter.repetition_min"),
    (dict(folder="/abs"), "--ledger.folder"),
])
def test_bad_values_fail_at_parse_time(kwargs, match):
    with pytest.raises(TitanLedgerError, match=match) as e:
        # a section's own check runs when the section is built (a lambda builds it here)
        Ledger.Config(**{k: v() if callable(v) else v for k, v in kwargs.items()})
    assert isinstance(e.value, (ConfigError, SkipError)) and e.value.exit_code == 2


def test_spike_rules_are_checked_too():
    with pytest.raises(ConfigError, match="--ledger.spike.window"):
        SpikeDetector.Config(window=1)
    with pytest.raises(ConfigError, match="--ledger.spike.ratio"):
        SpikeDetector.Config(ratio=-1)


def test_good_values_parse():
    assert parse_inject("8:1:repeat") == (8, 1, "repeat")
    Ledger.Config(skip=SkipConfig(steps=["5-9", "12"]), rehearsal=RehearsalConfig(inject="3:0:random"),
                  response=ResponseConfig(policy="act", action="rollback"))
