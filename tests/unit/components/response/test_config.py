"""The response's own configuration (issue 69): eight ``[ledger.*]`` sections of at most 15
fields with no prefix doing a section's job, old spellings refused with one line naming the
new one, and a launch recorded under them read in today's (``format.spellings``)."""

from __future__ import annotations

import dataclasses

import pytest

from titan_ledger.components.ledger.ledger import Ledger
from titan_ledger.components.response import config as response_config
from titan_ledger.components.response.config import ResponseConfig
from titan_ledger.errors import ConfigError
from titan_ledger.format.spellings import (
    RENAMED,
    refuse_renamed,
    renamed_argv,
    renamed_table,
    renamed_text,
)

SECTIONS = ("response", "proof", "adam_check", "conviction", "rollback", "breaker", "snapshots", "window")


def test_each_section_is_short_and_no_field_repeats_its_sections_job():
    cfg = Ledger.Config()
    for name in SECTIONS:
        section = getattr(cfg, name)
        names = [f.name for f in dataclasses.fields(section)]
        assert len(names) <= 15, (name, len(names))
        assert not any(n.startswith(("prove_", "rollback_", "breaker_", "adam_", "quarantine_")) for n in names), names
        assert type(section).__module__ == response_config.__name__  # the response owns it
    # no near-homonyms: the policy and the action are two words, not act/action
    assert {f.name for f in dataclasses.fields(ResponseConfig)} >= {"policy", "action"}
    assert "on_spike" not in {f.name for f in dataclasses.fields(Ledger.Config)}
    from titan_ledger.components.response.recovery import Recovery

    assert [f.name for f in dataclasses.fields(Recovery.Config)] == list(SECTIONS)
    # declared once (ResponseSections): the ledger's table extends them, Recovery.Config is them
    from titan_ledger.components.response.config import ResponseSections

    assert issubclass(Ledger.Config, ResponseSections) and issubclass(Recovery.Config, ResponseSections)
    for cls in (Ledger.Config, Recovery.Config):
        assert not set(cls.__dict__.get("__annotations__", {})) & set(SECTIONS), cls


def test_every_renamed_field_exists_under_its_new_name():
    cfg = Ledger.Config()
    for old, new in RENAMED.items():
        section, _, field_ = new.partition(".")
        assert hasattr(getattr(cfg, section), field_), (old, new)
    assert len(RENAMED) == 22 + 11  # every field of the old [ledger.on_spike], the window's of [ledger.snapshots]


@pytest.mark.parametrize("arg, new", [
    ("--ledger.on_spike.prove", "--ledger.proof.scope"),
    ("--ledger.on_spike.act=act", "--ledger.response.policy"),
    ("--ledger.on_spike.no_prove_bisect", "--ledger.proof.no_bisect"),
    ("--ledger.on_spike.no-defer", "--ledger.response.no_defer"),
    ("--ledger.snapshots.max_proofs", "--ledger.window.max_proofs"),
])
def test_an_old_spelling_is_refused_with_one_line_naming_the_new_one(arg, new):
    with pytest.raises(ConfigError) as e:
        refuse_renamed(["--training.steps", "4", arg, "x"])
    assert str(e.value).splitlines() == [f"{arg.partition('=')[0]} was renamed: use {new} (the response's "
                                         f"sections, docs/toml.md)"]
    refuse_renamed(["--ledger.snapshots.every", "20", "--ledger.proof.scope", "all"])  # today's: no error


def test_a_recorded_launch_reads_in_todays_spelling():
    old = ["--job.config_file", "a.toml", "--ledger.on_spike.prove", "all", "--ledger.on_spike.act=act",
           "--ledger.on_spike.no_prove_bisect", "--ledger.snapshots.every", "20", "--ledger.snapshots.eps_fix",
           "1e-5"]
    assert renamed_argv(old) == ["--job.config_file", "a.toml", "--ledger.proof.scope", "all",
                                 "--ledger.response.policy=act", "--ledger.proof.no_bisect",
                                 "--ledger.snapshots.every", "20", "--ledger.window.eps_fix", "1e-5"]
    assert renamed_table("on_spike", "quarantine_max") == "[ledger.conviction] max_share"
    assert renamed_table("snapshots", "every") is None
    # a ledger line recording the launch (bench/ledger_equal.py --spellings compares dumps so)
    line = '{"argv": ["--ledger.on_spike.prove", "all", "--ledger.snapshots.every", "20", "--ledger.on_spike.no-defer"]}'
    assert renamed_text(line) == ('{"argv": ["--ledger.proof.scope", "all", "--ledger.snapshots.every", "20", '
                                  '"--ledger.response.no_defer"]}')


def test_the_response_config_gathers_its_sections_from_the_ledger_table_and_builds_with_its_ports():
    from titan_ledger.components.response.recovery import Recovery

    table = Ledger.Config()
    table.response = ResponseConfig(policy="act", action="rollback")  # (a section a user set)
    cfg = Recovery.Config.of(table)
    # the sections a user set under [ledger.*] are the ones the response is built from
    assert cfg.response is table.response and cfg.window is table.window and cfg.proof is table.proof
    assert Recovery.Config._owner is Recovery
    # defaults with some replaced (what a unit double builds)
    assert Recovery.Config(response=ResponseConfig(policy="act", action="rollback")).proof.scope == "all"
    with pytest.raises(TypeError, match="on_spike"):
        Recovery.Config(on_spike=object())
    with pytest.raises(TypeError, match="host"):  # its ports and the run's facts are passed in, not read later
        cfg.build()


def test_an_old_toml_table_is_refused_naming_the_file_the_key_and_the_new_spelling(tmp_path):
    from titan_ledger.config.toml_frontend import read_job, translate

    f = tmp_path / "old.toml"
    f.write_text("[ledger.on_spike]\nprove = \"all\"\n")
    job = read_job(["--job.config_file", str(f)])
    with pytest.raises(ConfigError) as e:
        translate(job, Ledger.Config())
    assert str(e.value) == f"{f}: [ledger.on_spike] prove was renamed: write [ledger.proof] scope (docs/toml.md)"
