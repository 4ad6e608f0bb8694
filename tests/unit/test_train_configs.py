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
    "tiny_cpu.toml": 1,
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


def test_the_tiny_model_is_tiny_and_fills_one_or_two_ranks():
    """tiny_cpu (issue 36): 2 layers, dim 64, 4 heads, vocab 2048 -- 368,960 parameters --
    on one process or DP 2 (``data_parallel_shard_degree = -1``)."""
    import torch

    config = parse(read_job(["--job.config_file", str(CONFIGS / "tiny_cpu.toml")]))
    for world in (1, 2):
        check_world_size(config, world)
    spec = config.model_spec.model
    assert (spec.dim, len(spec.layers), config.model_spec.flavor) == (64, 2, "tiny")
    with torch.device("meta"):
        model = spec.build()
    assert sum(p.numel() for p in model.parameters()) == 368_960
    assert (config.training.seq_len, config.training.local_batch_size) == (128, 8)
    # the embedding scenario's variant (issue 36): the same model, its embedding at std 0.02
    from titan_ledger.config_registry import tiny_cpu_small_embedding

    small = tiny_cpu_small_embedding().model_spec.model
    assert small.tok_embeddings.param_init["weight"].keywords == {"std": 0.02}
    assert spec.tok_embeddings.param_init["weight"].keywords == {"std": 1.0}  # torchtitan's llama3


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
