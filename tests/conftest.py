"""Test-session setup: the CPU rehearsal backend, installed before torchtitan imports,
and the shared training runs of the slow set.

Every test in this suite runs on the CPU backend (also on a GPU machine), so the
numbers it checks are the ones CI sees.

The slow tests mostly read dump folders. The runs behind them are session-scoped
and launched on first use (``runs.straight("FSDP2")``, ``runs.resumed("PP")``, ...),
so one torchrun launch serves every assertion about it; see ``Runs``.
"""

import functools
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

# children (torchrun, the replay CLI's launches) inherit these
os.environ.setdefault("TITAN_LEDGER_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

from titan_ledger.rehearsal import backend

backend.install("cpu")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
from helpers import CONFIGS, child_env, cli, explain, py, signals_ledger, torchrun, unsharded_model  # noqa: E402

# --------------------------------------------------------------------------- the shared runs

STEPS = 6  # checkpoints at 3 and 6; the kill -9 runs die when step KILL_AT starts
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]
KILL_AT = 5
# validation rides along with one case: torchtitan's Validator builds its own inputs
VALIDATE = ["--validator.enable", "--validator.freq", "2", "--validator.steps", "2"]


@dataclass(frozen=True)
class Parallelism:
    toml: str
    nproc: int
    dp: int  # DP size
    source: str  # text | indexed
    workers: int  # dataloader workers
    resume: bool  # has a kill -9 + resume run
    lost_rank: bool = False  # ... in which rank 1 dies alone (SIGKILL) under the launcher, not the whole job
    qk_norm: bool = False  # [model] qk_norm (its own seed checkpoint: two more weights a layer)
    z_loss: float = 0.0  # [loss] z_loss_weight


#: the step every parallelism's straight run proves (``--ledger.rehearsal.prove_at``)
PROVEN_STEP = 2

# One straight run per parallelism; one kill -9 resume for FSDP2, TP and PP. Across
# the resumes: text and indexed, 0 and 2 workers, DP 2 and 1. FSDP2xTP runs with
# QK-norm (its norms are TP-replicated weights on head-sharded activations); TP and PP
# with the z-loss (loss-parallel and last-stage losses, chunked).
PARALLELISMS = {
    "FSDP2": Parallelism("debug_cpu.toml", 2, 2, "text", 2, True),
    "TP": Parallelism("debug_cpu_tp.toml", 2, 1, "indexed", 0, True, z_loss=0.01),
    "PP": Parallelism("debug_cpu_pp.toml", 2, 1, "text", 2, True, z_loss=0.01, lost_rank=True),
    "FSDP2xTP": Parallelism("debug_cpu_fsdp_tp.toml", 4, 2, "text", 0, False, qk_norm=True),
}


def data_args(source: str, workers: int, corpus: Path | None) -> list[str]:
    args = ["--dataloader.num_workers", str(workers)]
    if source == "indexed":
        args += ["--dataloader.source", "indexed", "--dataloader.paths", str(corpus)]
    return args


class Runs:
    """Training runs launched once per session, on first use, and cached.

    ``straight(case)``: STEPS steps from the seed checkpoint (so step 1 can be compared
    with an unsharded reference), per-layer norms, TensorBoard, checkpoints at 3 and 6;
    FSDP2 also validates. ``resumed(case)``: the same arguments through
    ``titan_ledger.replay resume``: SIGKILL of every process when step KILL_AT starts,
    relaunch from the step-3 checkpoint, finish. A failed launch is cached too, so the
    tests that need it fail at once with its log.
    """

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory = factory
        self._done: dict[str, object] = {}

    def _once(self, key: str, make):
        if key not in self._done:
            try:
                self._done[key] = make()
            except BaseException as e:
                if not isinstance(e, Exception):
                    raise
                self._done[key] = e
        got = self._done[key]
        if isinstance(got, Exception):
            raise got
        return got

    # ---- inputs
    def corpus(self) -> Path:
        """The bundled corpus as a Megatron .bin/.idx, through the ``prepare`` CLI (its smoke test)."""
        def make():
            prefix = self.factory.mktemp("corpus") / "bundled"
            p = py("-m", "titan_ledger.prepare", "--input", ROOT / "titan_ledger/assets/corpus",
                   "--output-prefix", prefix, "--workers", "2")
            assert p.returncode == 0, p.stderr[-3000:]
            assert "457 documents" in p.stdout
            return prefix
        return self._once("corpus", make)

    def seed(self, qk_norm: bool = False) -> Path:
        """A seed checkpoint (DCP, one rank) every parallelism loads, resharded. With
        ``qk_norm``: the same weights plus QK-norm's (ones, as initialized), written in
        this process from the first (a launch costs ~15 s; DCP needs no process group)."""
        if qk_norm:
            return self._once("seed-qk_norm", lambda: _with_qk_norm(self.seed(), self.factory.mktemp("seed-qk")))

        def make():
            out = self.factory.mktemp("seed")
            proc = torchrun(["--job.config_file", CONFIGS / "debug_cpu.toml",
                             "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.enable",
                             "--checkpoint.create_seed_checkpoint", "--dump_folder", out], nproc=1)
            assert proc.returncode == 0, explain(proc)
            return out / "checkpoint" / "step-0"
        return self._once("seed", make)

    # ---- per parallelism
    def args(self, case: str) -> list[str]:
        """The training arguments of ``case``'s runs (without the dump folder)."""
        p = PARALLELISMS[case]
        corpus = self.corpus() if p.source == "indexed" else None
        return [str(a) for a in [
            "--job.config_file", CONFIGS / p.toml, "--training.steps", STEPS, *CKPT,
            "--checkpoint.initial_load_path", self.seed(p.qk_norm), "--ledger.per_layer",
            "--ledger.update_norm",
            # step 2 re-executed by a proof at the alarm (a clean step: the original applied)
            "--ledger.rehearsal.prove_at", PROVEN_STEP,
            *(["--model.qk_norm"] if p.qk_norm else []),
            *(["--loss.z_loss_weight", p.z_loss] if p.z_loss else []),
            "--metrics.enable_tensorboard", *(VALIDATE if case == "FSDP2" else []),
            *data_args(p.source, p.workers, corpus)]]

    def straight(self, case: str) -> Path:
        def make():
            dump = self.factory.mktemp(f"straight-{case}")
            proc = torchrun(self.args(case) + ["--dump_folder", dump], nproc=PARALLELISMS[case].nproc)
            assert proc.returncode == 0, explain(proc)
            (dump / "train.log").write_text(proc.stdout + proc.stderr)
            return dump
        return self._once(f"straight-{case}", make)

    def in_step(self, case: str) -> Path:
        """``straight(case)`` deciding in the step (``--ledger.response.no_defer``): the
        straight run defers its step-2 proof to step 3 and executes step 3 again."""
        def make():
            dump = self.factory.mktemp(f"in-step-{case}")
            proc = torchrun(self.args(case) + ["--ledger.response.no_defer", "--dump_folder", dump],
                            nproc=PARALLELISMS[case].nproc)
            assert proc.returncode == 0, explain(proc)
            return dump
        return self._once(f"in-step-{case}", make)

    def resumed(self, case: str) -> tuple[Path, dict]:
        """(dump folder, the ``replay resume --json`` report)."""
        import json

        from titan_ledger.tools import replay

        def make():
            dump = self.factory.mktemp(f"resumed-{case}") / "run"
            if PARALLELISMS[case].lost_rank:
                return dump, self._lost_rank(case, dump)
            rc, out, err = cli(replay.main, ["resume", "--nproc", PARALLELISMS[case].nproc, "--kill-at",
                                             KILL_AT, "--dump-folder", dump, "--json", "--",
                                             *self.args(case)])
            log = dump / "replay_resume.log"
            assert rc == 0, out + err + (log.read_text()[-6000:] if log.exists() else "")
            return dump, json.loads(out)
        return self._once(f"resumed-{case}", make)

    def _lost_rank(self, case: str, dump: Path) -> dict:
        """``titan_ledger.launch`` (its ``main`` here; torchrun warm) with rank 1 killed by
        SIGKILL when step KILL_AT starts (``--ledger.rehearsal.die``), then the resume
        command the launcher printed, as printed. The report: the launcher's lines, how
        long the job outlived the death, what the dump folder held in between."""
        import time
        from unittest import mock

        from titan_ledger.format.reader import checkpoints
        from titan_ledger.tools import launch

        argv = ["--nproc", str(PARALLELISMS[case].nproc), "--", *self.args(case), "--job.dump_folder", str(dump),
                "--ledger.rehearsal.die", f"{KILL_AT}:1:SIGKILL"]
        # cold: the warm launcher's ranks are forks (torchrun's --start-method fork), whose
        # failure handling reports ONE failed rank, whichever it polls first; when rank 0
        # (its peer's socket reset) exits within torchrun's poll interval of rank 1's
        # SIGKILL, that was rank 0 (CI, 2026-12-04). A cold launch's subprocess ranks are
        # all reported, as for a user, and the launcher then names the killed one.
        # clear=True: patch.dict only adds keys, so without it the warm launcher that
        # conftest's _tools_launch_warm put in os.environ stayed (issue 60 item 7: the
        # "cold" launch still ran with --start-method fork).
        with mock.patch.dict(os.environ, child_env(warm=False), clear=True):
            assert launch.torchrun_prefix() == [sys.executable, "-m", "torch.distributed.run"], \
                launch.torchrun_prefix()
            rc, out, err = cli(launch.main, argv)
        ended = time.time()
        with mock.patch.dict(os.environ, child_env()):
            died = re.search(r"^rehearsal: rank 1 dies at step (\d+) \(SIGKILL\) at t=([\d.]+)$", err, re.M)
            assert rc == 1 and died, f"rc={rc}\n{err[-6000:]}"
            lines = [x for x in err.splitlines() if x.startswith("titan_ledger.launch: ")]
            before = checkpoints(dump)
            history = [row["step"] for row in signals_ledger(dump).history]  # what the killed run recorded
            resume = shlex.split(lines[-1].split("): ", 1)[1])
            assert resume[1:3] == ["-m", "titan_ledger.launch"], lines
            rc2, out2, err2 = cli(launch.main, resume[3:])
        assert rc2 == 0 and "Traceback" not in err2, err2[-6000:]  # (its INFO lines went to the fd 1 of this process)
        return {"killed_at_step": int(died.group(1)), "ended_s": ended - float(died.group(2)), "lines": lines,
                "last_lines": err.splitlines()[-3:], "checkpoints_before_kill": before, "resume": resume,
                "resumed_from_checkpoint": int(re.search(r"loads checkpoint step-(\d+)", lines[-1]).group(1)),
                "ledger_steps_before_resume": history, "stderr": err}

    # ---- other shared runs
    def indexed_toml(self) -> Path:
        """``debug_cpu_indexed.toml`` (FSDP2, indexed, 0 workers), STEPS steps, checkpoints
        at 3 and 6; it prepares its corpus (a fresh prefix) on first use."""
        def make():
            base = self.factory.mktemp("indexed-toml")
            proc = torchrun(self.indexed_args(base) + ["--job.dump_folder", base / "run"])
            assert proc.returncode == 0, explain(proc)
            return base / "run"
        return self._once("indexed-toml", make)

    def indexed_args(self, base: Path | None = None) -> list[str]:
        if base is None:
            base = self.indexed_toml().parent
        return [str(a) for a in ["--job.config_file", CONFIGS / "debug_cpu_indexed.toml",
                                 "--training.steps", STEPS, *CKPT,
                                 "--dataloader.paths", base / "corpora" / "bundled"]]

    def skip_freeze(self) -> Path:
        """FSDP2 text, 0 workers, like ``straight("FSDP2")`` but ``skip_steps = 3-4``
        (LR frozen over the window)."""
        def make():
            dump = self.factory.mktemp("skip-freeze")
            args = ["--job.config_file", CONFIGS / "debug_cpu.toml", "--training.steps", STEPS, *CKPT,
                    "--checkpoint.initial_load_path", self.seed(), "--ledger.skip.steps", "3-4",
                    "--job.dump_folder", dump]
            proc = torchrun([str(a) for a in args])
            assert proc.returncode == 0, explain(proc)
            return dump
        return self._once("skip-freeze", make)

    def copy_checkpoint(self, src: Path, step: int, name: str, with_ledger: bool = False) -> Path:
        """A new dump folder holding ``src``'s step-``step`` checkpoint (and its ledger)."""
        dump = self.factory.mktemp(name)
        shutil.copytree(src / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
        if with_ledger:
            shutil.copytree(src / "ledger", dump / "ledger")
        return dump


def _with_qk_norm(seed: Path, folder: Path) -> Path:
    """``seed``'s weights in the debug model with ``[model] qk_norm``, saved as a DCP
    checkpoint (the norms' weights as the model initializes them: ones)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    _, model = unsharded_model(["--job.config_file", CONFIGS / "debug_cpu.toml", "--model.qk_norm"])
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(seed), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert {k for k in sd if "q_norm" in k or "k_norm" in k}, "the model has no QK-norm weights"
    out = folder / "step-0"
    dcp.save(sd, checkpoint_id=str(out))
    return out


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory)


# --------------------------------------------------------------------------- two workers
# Under pytest-xdist (``-n 2 --dist loadscope --no-loadscope-reorder``, pyproject's
# addopts) every fixture is built once per worker, so the work units follow the
# fixtures: a module is one unit (its module-scoped runs), and every module that uses
# the session's ``runs`` joins one ``runs`` unit, on one worker. That unit goes first:
# it is the longest (about a third of the suite), and the other worker fills in around
# it. (xdist's own ``loadgroup`` renames node ids, which pytest 9 no longer allows: its
# markers are ignored, and shared runs and module fixtures were built on both workers.)
#
# Why two workers on two cores: the suite alone keeps the cores about two-thirds busy
# (in-process CLIs and unit tests use one; launches wait on rendezvous, files and
# sleeps), and a gloo rank waiting in a collective sleeps rather than spins (measured:
# 0.03 s of CPU over a 5 s wait).
_USES_RUNS = re.compile(r"def \w+\([^)]*\bruns\b", re.S)  # a test or fixture taking ``runs``


@functools.cache
def _unit(module: str) -> str:
    """The xdist work unit of a test module (a rootdir-relative path)."""
    return "runs" if _USES_RUNS.search((ROOT / module).read_text()) else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FixtureUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid.split("::")[0])

    return FixtureUnits(config, log)


def pytest_collection_modifyitems(config, items):
    """The ``runs`` modules first (order kept within each); and a check that the
    scheduler's reading of the sources (``_unit``) agrees with the fixtures."""
    shared = {it.nodeid.split("::")[0] for it in items if "runs" in getattr(it, "fixturenames", ())}
    missed = sorted(m for m in shared if _unit(m) != "runs")
    if missed:
        raise pytest.UsageError(f"tests/conftest.py: {missed} use the shared `runs` through a fixture "
                                "_USES_RUNS does not see: take `runs` as an argument in that module")
    items.sort(key=lambda it: _unit(it.nodeid.split("::")[0]) != "runs")  # stable


@pytest.fixture(autouse=True)
def _tools_launch_warm(request, monkeypatch):
    """The tools a slow test calls in this process (``replay resume``'s kill -9 runs,
    ``replay rerun``, ``diagnose --rerun``) launch through the warm launcher, as their
    subprocess forms do (``helpers.child_env``). A kill -9 still SIGKILLs every rank:
    killing the client makes the launch's fork SIGKILL its process group. The fast set
    never starts the launcher."""
    if request.node.get_closest_marker("slow") is not None:
        from helpers import TORCHRUN_ENV, _warm_client, _warm_socket

        if _warm_socket():
            monkeypatch.setenv(TORCHRUN_ENV, shlex.join(_warm_client()))
