"""Ledger.Config: every check that needs no trainer fails when the flags are parsed."""

import pytest

from titan_ledger.components.ledger import Ledger
from titan_ledger.components.spikes import SpikeDetector
from titan_ledger.errors import ConfigError, SkipError, TitanLedgerError
from titan_ledger.rehearsal.faults import parse_inject


@pytest.mark.parametrize("kwargs, match", [
    (dict(inject="8:1"), "--ledger.inject"),
    (dict(inject="8:1:zeros"), "KIND is repeat or random"),
    (dict(inject="0:1:repeat"), "STEP >= 1"),
    (dict(skip_steps=["9-3"]), "skip_steps"),
    (dict(skip_steps=["a-b"]), "skip_steps"),
    (dict(on_spike="skip_update", signals=False), "needs --ledger.signals"),
    (dict(on_spike="rollback", spike=SpikeDetector.Config(enable=False)), "--ledger.spike.enable"),
    (dict(rollback_skip=0), "rollback_skip"),
    (dict(max_rollbacks=-1), "max_rollbacks"),
    (dict(folder="/abs"), "--ledger.folder"),
])
def test_bad_values_fail_at_parse_time(kwargs, match):
    with pytest.raises(TitanLedgerError, match=match) as e:
        Ledger.Config(**kwargs)
    assert isinstance(e.value, (ConfigError, SkipError)) and e.value.exit_code == 2


def test_spike_rules_are_checked_too():
    with pytest.raises(ConfigError, match="--ledger.spike.window"):
        SpikeDetector.Config(window=1)
    with pytest.raises(ConfigError, match="--ledger.spike.ratio"):
        SpikeDetector.Config(ratio=-1)


def test_good_values_parse():
    assert parse_inject("8:1:repeat") == (8, 1, "repeat")
    Ledger.Config(skip_steps=["5-9", "12"], inject="3:0:random", on_spike="rollback")
