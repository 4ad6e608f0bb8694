"""End-to-end runs of the real CLI: bad input, dry runs, resume, two nodes."""

import os
import subprocess
import time

import pytest

from helpers import (
    CONFIGS,
    ROOT,
    child_env,
    explain,
    free_port,
    kill9_tree,
    read_tb,
    torchrun,
    torchrun_popen,
    train_cli,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- bad input

BAD = {
    "missing.toml": (None, r"missing.toml: no such config file"),
    "malformed.toml": ("[training]\nsteps = 1\nseq_len = \n", r"malformed.toml: malformed TOML: .*line 3"),
    "section.toml": ("[trainin]\nsteps = 1\n", r"\[trainin\] steps: unknown section 'trainin'.*'training'"),
    "key.toml": ("[training]\nstepz = 1\n", r"\[training\] stepz: unknown key 'stepz'.*'steps'"),
    "type.toml": ('[training]\nsteps = "ten"\n', r"\[training\] steps = 'ten': expected int, got str"),
    "base.toml": ('[job]\nconfig = "llama3_9b"\n', r"\[job\] config: cannot load base config titan_ledger.llama3_9b"),
    "degrees.toml": ("[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 2\n",
                     r"--parallelism.\*: .* multiply to 4, but the world size is 2"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_one_line_error(tmp_path, name):
    import re

    text, pattern = BAD[name]
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    proc = train_cli(["--job.config_file", str(path)], WORLD_SIZE="2")
    assert proc.returncode == 2, explain(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("titan_ledger: error:")]
    assert len(errors) == 1, explain(proc)
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in proc.stderr


def test_bad_input_under_torchrun_prints_once(tmp_path):
    proc = torchrun(["--job.config_file", str(CONFIGS / "debug_cpu.toml"),
                     "--parallelism.tensor_parallel_degree", "4"], nproc=2)
    assert proc.returncode != 0
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "titan_ledger: error:" in ln]
    assert len(errors) == 1, explain(proc)
    assert "tensor_parallel=4" in errors[0] and "the world size is 2" in errors[0]


# --------------------------------------------------------------------------- GPU configs, dry run

GPU_CONFIGS = {"llama3_8b.toml": 8, "llama3_70b.toml": 64, "llama3_405b.toml": 512}


@pytest.mark.parametrize("toml,world", list(GPU_CONFIGS.items()))
def test_gpu_config_dry_run(tmp_path, toml, world):
    """Build each GPU config at its world size on torchtitan's fake backend (rank 0)."""
    proc = train_cli(
        ["--job.config_file", str(CONFIGS / toml), "--comm.mode", "fake_backend",
         "--dump_folder", str(tmp_path),
         # the recipes' HF tokenizer / C4 need a download; the build does not care
         "--hf_assets_path", str(ROOT / "titan_ledger/assets/tokenizer"),
         "--dataloader.dataset", "c4_test",
         "--dataloader.dataset_path", str(ROOT / "titan_ledger/assets/corpus")],
        NGPU=str(world), RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), timeout=600,
    )
    assert proc.returncode == 0, explain(proc)
    assert f"dry run: built LedgerTrainer for world size {world}" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- checkpoint + resume


def test_checkpoint_resume_matches_uninterrupted_run(tmp_path):
    """6 steps straight vs (6-step run killed -9 after its step-3 checkpoint) + resume."""
    common = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--metrics.enable_tensorboard",
              "--checkpoint.enable", "--checkpoint.interval", "3", "--training.steps", "6"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    a = torchrun(common + ["--dump_folder", str(straight)])
    assert a.returncode == 0, explain(a)

    # Same config (so the same LR schedule): SIGKILL every process as soon as the
    # step-3 checkpoint is complete (DCP writes .metadata last).
    killed = torchrun_popen(common + ["--dump_folder", str(resumed)])
    marker = resumed / "checkpoint" / "step-3" / ".metadata"
    deadline = time.monotonic() + 300
    while not marker.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kill9_tree(killed.pid)) >= 3  # torchrun + 2 ranks
    killed.wait()
    assert marker.exists(), "the first run never wrote its step-3 checkpoint"
    assert not (resumed / "checkpoint" / "step-6").exists()

    c = torchrun(common + ["--dump_folder", str(resumed)])
    assert c.returncode == 0, explain(c)
    assert "Training starts at step 4" in c.stdout + c.stderr, explain(c)

    full, res = read_tb(straight), read_tb(resumed)
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert {4, 5, 6} <= set(res)
    # Bit-identical (as float32 TensorBoard scalars): same weights, optimizer
    # state, LR schedule and data position, same deterministic CPU kernels.
    assert [res[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)], (full, res)
    gn_full, gn_res = read_tb(straight, "grad_norm"), read_tb(resumed, "grad_norm")
    assert [gn_res[s] for s in (4, 5, 6)] == [gn_full[s] for s in (4, 5, 6)]


# --------------------------------------------------------------------------- two nodes


def test_two_nodes_c10d_rendezvous_on_localhost(tmp_path):
    env = child_env(NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), JOB_ID="two-nodes-test")
    args = [str(ROOT / "launch" / "multinode.sh"), "--job.config_file", str(CONFIGS / "debug_cpu.toml"),
            "--training.steps", "2", "--dump_folder", str(tmp_path), "--metrics.enable_tensorboard"]
    nodes = [subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [n.communicate(timeout=600)[0] for n in nodes]
    for n, out in zip(nodes, outs):
        assert n.returncode == 0, out[-4000:]
    assert sorted(read_tb(tmp_path)) == [1, 2]


def test_slurm_script_is_valid_bash():
    for script in ("run.sh", "multinode.sh", "slurm.sbatch"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert os.access(ROOT / "launch" / script, os.X_OK)
