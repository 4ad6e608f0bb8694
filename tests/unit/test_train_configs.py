"""Every TOML in train_configs/ parses through torchtitan's ConfigManager/tyro."""

import subprocess
import sys

import pytest
from helpers import CONFIGS, ROOT

from titan_ledger.config.toml_frontend import check_world_size, parse, read_job
from titan_ledger.trainer import LedgerTrainer

# world size each config is written for
WORLD = {
    "debug_cpu.toml": 2,
    "debug_cpu_tp.toml": 2,
    "debug_cpu_pp.toml": 2,
    "debug_cpu_fsdp_tp.toml": 4,
    "debug_cpu_indexed.toml": 2,
    "llama3_8b.toml": 8,
    "llama3_70b.toml": 64,
    "llama3_405b.toml": 512,
}


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.toml")) == sorted(WORLD)


@pytest.mark.parametrize("name", sorted(WORLD))
def test_config_parses_and_fits_its_world(name):
    job = read_job(["--job.config_file", str(CONFIGS / name)])
    config = parse(job)
    assert isinstance(config, LedgerTrainer.Config)
    assert job.description, f"{name}: give it a [job] description"
    check_world_size(config, WORLD[name])
    assert config.dump_folder.startswith("./outputs/")
    if name.startswith("llama3_"):  # the GPU recipes: titan_ledger's loader, indexed corpus
        from titan_ledger.data.loader import LedgerDataLoader

        assert isinstance(config.dataloader, LedgerDataLoader.Config)
        assert config.dataloader.source == "indexed" and config.dataloader.paths


def test_help_lists_ledger_section_with_docstrings():
    proc = subprocess.run(
        [sys.executable, "-m", "titan_ledger.train", "--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                                                                     "TITAN_LEDGER_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--ledger.device" in proc.stdout
    assert "CPU rehearsal backend" in proc.stdout  # the field's docstring
    assert "(default: 20)" in proc.stdout  # TOML values show as the defaults (training.steps)
