"""Ledger.Config: every check that needs no trainer fails when the flags are parsed."""

import pytest

from titan_ledger.components.ledger import (
    FilterConfig,
    Ledger,
    OnSpikeConfig,
    RehearsalConfig,
    SkipConfig,
    renamed_flags,
)
from titan_ledger.components.spikes import SpikeDetector
from titan_ledger.errors import ConfigError, SkipError, TitanLedgerError
from titan_ledger.rehearsal.faults import parse_inject


@pytest.mark.parametrize("kwargs, match", [
    (dict(rehearsal=lambda: RehearsalConfig(inject="8:1")), "--ledger.rehearsal.inject"),
    (dict(rehearsal=lambda: RehearsalConfig(inject="8:1:zeros")), "KIND is repeat or random"),
    (dict(rehearsal=lambda: RehearsalConfig(inject="0:1:repeat")), "STEP >= 1"),
    (dict(rehearsal=lambda: RehearsalConfig(rerun="stop=0")), "--ledger.rehearsal.rerun"),
    (dict(skip=lambda: SkipConfig(steps=["9-3"])), "--ledger.skip.steps"),
    (dict(skip=lambda: SkipConfig(steps=["a-b"])), "--ledger.skip.steps"),
    (dict(on_spike=OnSpikeConfig(action="skip_update"), signals=False), "needs --ledger.signals"),
    (dict(on_spike=OnSpikeConfig(action="rollback"), spike=SpikeDetector.Config(enable=False)),
     "--ledger.spike.enable"),
    (dict(on_spike=lambda: OnSpikeConfig(rollback_skip=0)), "--ledger.on_spike.rollback_skip"),
    (dict(on_spike=lambda: OnSpikeConfig(max_rollbacks=-1)), "--ledger.on_spike.max_rollbacks"),
    (dict(on_spike=lambda: OnSpikeConfig(action="jump")), "--ledger.on_spike.action"),
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
                  on_spike=OnSpikeConfig(action="rollback"))


def test_the_flat_flags_of_earlier_releases_still_work():
    """``--ledger.inject`` (and every other flat [ledger] name) is rewritten to its
    nested path, on the command line and as a TOML key, bool negations included."""
    import textwrap

    from titan_ledger.config.toml_frontend import alias_cli, parse, read_job

    flags = renamed_flags()
    assert flags["--ledger.inject"] == "--ledger.rehearsal.inject"
    assert flags["--ledger.no_doc_loss"] == "--ledger.doc_loss.no_enable"
    assert alias_cli(["--ledger.skip-steps", "3-4", "--ledger.on_spike=rollback"]) == \
        ["--ledger.skip.steps", "3-4", "--ledger.on_spike.action=rollback"]
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        toml = Path(d) / "old.toml"
        toml.write_text(textwrap.dedent("""
            [ledger]
            inject = "3:0:random"
            skip_steps = ["5-6"]
            doc_loss = false
            on_spike = "skip_update"
            [ledger.filter]
            repetition = true
        """))
        cfg = parse(read_job(["--job.config_file", str(toml), "--ledger.rollback_back", "7"]))
    led = cfg.ledger
    assert (led.rehearsal.inject, led.skip.steps, led.doc_loss.enable, led.on_spike.action,
            led.on_spike.rollback_back, led.filter.repetition) == ("3:0:random", ["5-6"], False,
                                                                   "skip_update", 7, True)
