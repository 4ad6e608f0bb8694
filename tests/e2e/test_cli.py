"""The training CLI: bad input, dry runs of the GPU configs, two nodes.

(kill -9 + resume through the CLI: ``test_resume.py``.)
"""

import os
import re
import subprocess

import pytest
from helpers import CONFIGS, ROOT, child_env, error_lines, explain, free_port, read_tb, torchrun, train_argv, train_cli

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


def _bad_file(tmp_path, name):
    text, pattern = BAD[name]
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    return path, pattern


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_one_line_error(tmp_path, monkeypatch, capsys, name):
    """In process: ``titan_ledger.train.main`` exits 2 with one line, before any process group."""
    from titan_ledger import train

    path, pattern = _bad_file(tmp_path, name)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        train.main(["--job.config_file", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = error_lines(err)
    assert len(errors) == 1, err
    assert re.search(pattern, errors[0]), errors[0]


@pytest.mark.slow
def test_bad_input_one_line_error_subprocess(tmp_path):
    """The same through ``python -m titan_ledger.train``: exit 2, one line, no traceback."""
    path, pattern = _bad_file(tmp_path, "key.toml")
    proc = train_cli(["--job.config_file", str(path)], WORLD_SIZE="2")
    assert proc.returncode == 2, explain(proc)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, explain(proc)
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bad_input_under_torchrun_prints_once(tmp_path):
    proc = torchrun(["--job.config_file", str(CONFIGS / "debug_cpu.toml"),
                     "--parallelism.tensor_parallel_degree", "4"], nproc=2)
    assert proc.returncode != 0
    errors = error_lines(proc.stdout + proc.stderr)
    assert len(errors) == 1, explain(proc)
    assert "tensor_parallel=4" in errors[0] and "the world size is 2" in errors[0]


# --------------------------------------------------------------------------- GPU configs, dry run

GPU_CONFIGS = {"llama3_8b.toml": 8, "llama3_70b.toml": 64, "llama3_405b.toml": 512}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """The three dry runs, started together, forked from the warm launcher (a fresh
    interpreter's import of torch and torchtitan was most of each)."""
    procs = {}
    for toml, world in GPU_CONFIGS.items():
        dump = tmp_path_factory.mktemp(toml.removesuffix(".toml"))
        argv = [*train_argv(), "--job.config_file", str(CONFIGS / toml),
                "--comm.mode", "fake_backend", "--dump_folder", str(dump),
                # the recipes' HF tokenizer / C4 need a download; the build does not care
                "--hf_assets_path", str(ROOT / "titan_ledger/assets/tokenizer"),
                "--dataloader.dataset", "stdlib_docs"]
        env = child_env(NGPU=str(world), RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world))
        procs[toml] = (argv, subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
    out = {}
    for toml, (argv, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        out[toml] = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("toml,world", list(GPU_CONFIGS.items()))
def test_gpu_config_dry_run(dry_runs, toml, world):
    """Build each GPU config at its world size on torchtitan's fake backend (rank 0)."""
    proc = dry_runs[toml]
    assert proc.returncode == 0, explain(proc)
    assert f"dry run: built LedgerTrainer for world size {world}" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- two nodes


@pytest.mark.slow
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
