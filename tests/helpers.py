"""Shared helpers for the multi-process and end-to-end tests: real torchrun, real files."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "train_configs"


def child_env(warm: bool = True, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TITAN_LEDGER_DEVICE="cpu",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WANDB_MODE="offline",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
    )
    # the venv's torchrun/python first, as for a user who activated it
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra)
    if warm and _warm_socket():  # the tools' own launches (drill, rerun) go warm too
        env[TORCHRUN_ENV] = shlex.join(_warm_client())
    elif not warm:  # cold even inside a slow test (conftest's _tools_launch_warm sets it in os.environ;
        env.pop(TORCHRUN_ENV, None)  # into os.environ: mock.patch.dict(..., clear=True), else the key stays)
    return env


# ---- the warm launcher (tests/warm_launch.py): one server per test session
_WARM: dict = {}


def _warm_socket() -> str | None:
    """The warm launcher's socket, its server started on first use (TITAN_LEDGER_TESTS_COLD=1:
    none, every launch cold)."""
    if os.environ.get("TITAN_LEDGER_TESTS_COLD") == "1":
        return None
    if "path" not in _WARM:
        import atexit
        import tempfile
        import time

        folder = tempfile.mkdtemp(prefix="titan_ledger_warm_")
        path = os.path.join(folder, "sock")
        log = open(os.path.join(folder, "server.log"), "wb")
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "warm_launch.py"), "serve", path], cwd=ROOT,
                                env=child_env(warm=False), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(proc.kill)
        t0 = time.monotonic()
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() - t0 > 120:
                raise RuntimeError(f"the warm launcher did not start: {folder}/server.log")
            time.sleep(0.05)
        _WARM.update(path=path, proc=proc)
    return _WARM["path"]


def _warm_client() -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "warm_launch.py"), "client", _WARM["path"]]


from titan_ledger.tools.runs import TORCHRUN_ENV, kill9_tree  # noqa: E402,F401  (kill9_tree: re-exported for the tests)
from titan_ledger.tools.runs import _free_port as free_port  # noqa: E402


def _torchrun_cmd(args: list[str], nproc: int, warm: bool = False) -> list[str]:
    return [
        *(_warm_client() if warm and _warm_socket() else [sys.executable, "-m", "torch.distributed.run"]),
        "--nproc_per_node", str(nproc),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
        "-m", "titan_ledger.train", *args,
    ]


def torchrun(args: list[str], nproc: int = 2, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N -m titan_ledger.train ARGS`` on localhost."""
    return subprocess.run(_torchrun_cmd(args, nproc, warm=True), cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def torchrun_popen(args: list[str], nproc: int = 2, **env) -> subprocess.Popen:
    """Start torchrun in its own process group (so a test can SIGKILL every rank)."""
    return subprocess.Popen(_torchrun_cmd(args, nproc), cwd=ROOT, env=child_env(**env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def train_argv(warm: bool = True) -> list[str]:
    """``python -m titan_ledger.train`` (one process, no torchrun): forked from the warm
    launcher when it runs (``warm_launch.py train``), else a fresh interpreter."""
    if warm and _warm_socket():
        return [sys.executable, str(ROOT / "tests" / "warm_launch.py"), "train", _WARM["path"]]
    return [sys.executable, "-m", "titan_ledger.train"]


def train_cli(args: list[str], timeout: int = 300, warm: bool = False, **env) -> subprocess.CompletedProcess:
    """``python -m titan_ledger.train ARGS`` without torchrun (config errors, dry runs;
    ``warm``: see ``train_argv``)."""
    return subprocess.run([*train_argv(warm), *map(str, args)], cwd=ROOT,
                          env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def cli(main, argv: list[str]) -> tuple[int, str, str]:
    """Run a CLI's ``main(argv) -> int`` in this process: (exit code, stdout, stderr).

    An argparse error or ``sys.exit`` counts as its exit code. The subprocess form of
    each CLI is smoke-tested once (``python -m titan_ledger.X``); everything else
    calls ``main`` here, without a new interpreter.
    """
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return int(rc or 0), out.getvalue(), err.getvalue()


def launch_here(*train_args, nproc: int = 2, opts=()) -> subprocess.CompletedProcess:
    """``python -m titan_ledger.launch [opts] --nproc N -- TRAIN_ARGS`` through its ``main`` in
    this process, as a CompletedProcess (a refusal or ``--print`` never reaches torchrun).
    The process forms are smoke-tested in tests/e2e/test_launch_e2e.py (``--help``) and
    tests/e2e/test_preflight_e2e.py (a refusal)."""
    from titan_ledger.tools import launch

    argv = [*map(str, opts), "--nproc", str(nproc), "--", *map(str, train_args)]
    rc, out, err = cli(launch.main, argv)
    return subprocess.CompletedProcess(["titan_ledger.launch", *argv], rc, out, err)


def train_refused_here(*train_args, **env: str) -> subprocess.CompletedProcess:
    """``python -m titan_ledger.train TRAIN_ARGS`` through its ``main`` in this process, for
    input it must refuse while parsing (``load_config``, before any process group); ``env``
    for the call (e.g. ``WORLD_SIZE="1"``). An accepted config fails the test instead of
    training in the test process."""
    from unittest import mock

    from titan_ledger import train

    def load_then_stop(*a, **k):
        real_load(*a, **k)
        raise AssertionError(f"titan_ledger.train accepted {train_args}: it would train in the test process")

    real_load = train.load_config
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True), \
            mock.patch.object(train, "load_config", load_then_stop):
        rc, out, err = cli(lambda argv: train.main(argv) or 0, list(train_args))
    return subprocess.CompletedProcess(["titan_ledger.train", *map(str, train_args)], rc, out, err)


def py(*args, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository (the subprocess smoke tests of the CLIs)."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=timeout)


# --------------------------------------------------------------------------- reading ledgers
# Every test reads ledger files through these few functions, so the reader can be
# swapped in one place.


def signals_ledger(dump: Path):
    """The signals ledger of a dump folder: ``.history`` (current rows, step order),
    ``.superseded``, ``.segments`` (each with ``.header``), ``.torn_lines``, ``.by_step()``."""
    from titan_ledger.format.records import read_ledger

    return read_ledger(Path(dump) / "ledger" / "signals.jsonl")


def signals_rows(dump: Path) -> dict[int, dict]:
    """{step: signals row} of the current run history."""
    return signals_ledger(dump).by_step()


def rank_losses(dump: Path, step: int) -> list[float]:
    """Each DP rank's local loss at ``step`` (the ``rank{r}.jsonl`` files)."""
    from titan_ledger.format.records import read_ledger

    out = []
    for path in sorted((Path(dump) / "ledger").glob("rank*.jsonl")):
        out += [r["loss"] for r in read_ledger(path).history if r["step"] == step]
    return out


def data_rows(dump: Path, dp_rank: int) -> dict[int, dict]:
    """{step: row} of DP rank ``dp_rank``'s provenance file ``data_dp{r}.jsonl``."""
    from titan_ledger.format.records import read_ledger

    return read_ledger(Path(dump) / "ledger" / f"data_dp{dp_rank}.jsonl").by_step()


def data_ids(dump: Path) -> dict[int, dict[int, tuple]]:
    """{step: {dp_rank: sample ids}} (a skipped step: ``("skipped", *ids)``)."""
    from titan_ledger.format.data_reader import DataLedger, step_ids

    return step_ids(DataLedger(Path(dump) / "ledger"))


def data_spans(dump: Path, steps) -> list[tuple]:
    """Every (step, dp_rank, (source, doc, start, end)) document span trained at ``steps``."""
    from titan_ledger.format.data_reader import DataLedger

    led = DataLedger(Path(dump) / "ledger")
    out = []
    for step in steps:
        for r in led.ranks_at(step):
            for tag in led.at(step, r).tags:
                out += [(step, r, (tag.source, seg.doc, seg.start, seg.end)) for seg in tag.segments]
    return out


def spike_events(dump: Path) -> list[dict]:
    """``spikes.jsonl``: one event per flagged step (``step``, ``rules``, ...)."""
    from titan_ledger.format.records import read_ledger

    # flagged steps only: rewinds and recovery-ladder decisions are events of their own
    return [e for e in read_ledger(Path(dump) / "ledger" / "spikes.jsonl").history if "rules" in e]


def rejected_steps(dump: Path) -> list[int]:
    """Steps listed in ``rejected_steps.jsonl`` (what ``--ledger.skip.auto`` reads)."""
    from titan_ledger.format.records import read_ledger

    return [r["step"] for r in read_ledger(Path(dump) / "ledger" / "rejected_steps.jsonl").history]


def spawn_gloo(worker, world: int = 2, timeout: int = 120):
    """Run ``worker(rank, world, port, queue)`` in ``world`` spawned processes (they
    init gloo themselves); return what rank 0 puts on the queue."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout tail\n{proc.stdout[-3000:]}\n--- stderr tail\n{proc.stderr[-6000:]}"


TB_LOSS, TB_GRAD_NORM = "ledger/loss", "ledger/grad_norm"  # torchtitan's own series are dropped with the ledger on


def read_tb(folder: Path, tag: str = TB_LOSS) -> dict[int, float]:
    """All values of one TensorBoard scalar under ``folder`` (float32, as logged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for events in sorted(Path(folder).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def logged_losses(text: str) -> dict[int, float]:
    """Console ``step: N loss: X`` lines (any rank printing a real loss)."""
    out = {}
    for m in re.finditer(r"step:\s*(\d+)\s+loss:\s*(-?[0-9.]+)", _ANSI.sub("", text)):
        step, loss = int(m.group(1)), float(m.group(2))
        if loss != -1.0:  # PP stages without the loss print -1
            out[step] = loss
    return out


def wandb_files(folder: Path) -> list[Path]:
    """The ``.wandb`` transaction logs of the W&B offline run(s) under ``folder``, in name order."""
    return sorted(Path(folder).rglob("*.wandb"))


_NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def wandb_records(path: Path) -> list[dict]:
    """Every record of one W&B run, decoded by wandb's own reader: ``wandb leet inspect
    --json PATH`` (PATH: a ``.wandb`` file or its run folder), one JSON object per record,
    ``{"num": N, "type": T, T: payload}`` (a history payload: ``{"item": {key: value},
    "step": {"num": N}}``, nested keys joined with ``.``; a summary: ``{"update": {...}}``)."""
    import json as _json

    wandb = Path(sys.executable).parent / "wandb"
    p = subprocess.run([str(wandb), "leet", "inspect", "--json", str(path)], capture_output=True, text=True,
                       timeout=120, env=child_env())
    assert p.returncode == 0, f"wandb leet inspect --json {path}: rc={p.returncode}\n{p.stderr[-3000:]}"
    recs = [_json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert recs and recs[0]["type"] == "header", (path, p.stdout[:500])
    return recs


def read_wandb_history(folder: Path) -> list[dict]:
    """History rows of the W&B offline run(s) under ``folder``, read with wandb's own reader
    (:func:`wandb_records`). ``leet`` writes a non-finite number as the string ``"NaN"`` /
    ``"Infinity"`` / ``"-Infinity"``: those come back as floats."""
    files = wandb_files(folder)
    assert files, f"no .wandb file under {folder}"
    return [{k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in r["history"]["item"].items()}
            for f in files for r in wandb_records(f) if r["type"] == "history"]


def signal_keys() -> tuple[str, ...]:
    """The keys of a signals row (``grad_norm_per_layer`` only with ``per_layer``)."""
    from titan_ledger.format.records import SIGNAL_KEYS

    return tuple(SIGNAL_KEYS)


_ERROR_LINE = re.compile(r"titan_ledger(\.\w+)?: error: ")


def error_lines(text: str) -> list[str]:
    """The one-line errors (``titan_ledger: error: ...``, or ``titan_ledger.X: error: ...``)
    in a CLI's output, with the prefix removed."""
    return [_ERROR_LINE.split(ln, 1)[-1] for ln in _ANSI.sub("", text).splitlines() if _ERROR_LINE.search(ln)]


def load_bench(name: str):
    """Import ``bench/<name>.py`` (not a package) as module ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def unsharded_model(args: list[str]):
    """``(config, model)``: the training config of ``args`` and its model built in this
    process, unsharded, on the CPU attention (with ``[model] qk_norm`` when set), with
    the model's own initial weights (the exactness reference and the QK-norm seed)."""
    import torch

    from titan_ledger.components.prevention.qk_norm import apply_qk_norm
    from titan_ledger.components.signals import attention
    from titan_ledger.config.toml_frontend import parse, read_job

    config = parse(read_job([str(a) for a in args]))
    attention.adapt_config(config)
    if config.model.qk_norm:
        apply_qk_norm(config.model_spec.model)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return config, model


def first_batches(config, dp: int) -> list[tuple]:
    """Each DP rank's step-1 rows ``(input, labels, positions)``, rebuilt with the run's
    own dataloader config (the unsharded references' input)."""
    import torch

    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    pp = config.parallelism.pipeline_parallel_degree > 1
    batch = config.parallelism.pipeline_parallel_microbatch_size if pp else config.training.local_batch_size
    n_batches = config.training.local_batch_size // batch
    rows = []
    for r in range(dp):
        loader = config.dataloader.build(dp_world_size=dp, dp_rank=r, tokenizer=tokenizer,
                                         seq_len=config.training.seq_len, local_batch_size=batch)
        it = iter(loader)
        got = [next(it) for _ in range(n_batches)]
        rows.append((torch.cat([g[0]["input"] for g in got]), torch.cat([g[1] for g in got]),
                     torch.cat([g[0]["positions"] for g in got])))
    return rows


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def headless_chromium(profile: Path, why_skipped: str = "", size: str = "1200,4000") -> list[str]:
    """The headless chromium command line (its profile in ``profile``). Skips without
    chromium (``why_skipped`` added to the reason); fails in CI, where .ci/run installs it."""
    import pytest

    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run installs it (apt-get install chromium)")
        pytest.skip(f"chromium is not installed (apt-get install chromium){why_skipped}")
    return [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--window-size={size}",
            f"--user-data-dir={profile}"]


def chromium_dom(page: Path, profile: Path, size: str = "1200,4000") -> str:
    """The DOM headless chromium builds from ``page`` (``--dump-dom``) in a window of
    ``size``: what a browser shows, tables and all."""
    flags = headless_chromium(profile, size=size)
    p = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def run_facts(obj, **given):
    """The response's ``RunFacts`` as a unit double's config namespace states them (what it
    does not state: ``RunFacts``' defaults; ``given`` replaces any), read once, as the
    trainer reads them when it builds the response."""
    import torch

    from titan_ledger.components.response.host import Parts, RunFacts
    from titan_ledger.data.layout import parse_skip_steps
    from titan_ledger.rehearsal.faults import parse_response_faults

    c = getattr(obj, "config", None)

    def at(path: str):
        o = c
        for k in path.split("."):
            o = getattr(o, k, None)
        return o

    found = {"dump_folder": at("dump_folder"), "checkpoint_folder": at("checkpoint.folder"),
             "steps": at("training.steps"), "seq_len": at("training.seq_len"),
             "local_batch_size": at("training.local_batch_size"), "max_norm": at("training.max_norm"),
             "skip_lr": at("ledger.skip.lr"), "stall": at("ledger.stall"), "spike": at("ledger.spike")}
    ledger = getattr(obj, "ledger", None)  # what the trainer reads of its ledger once set up
    found.update({k: getattr(ledger, k, None) for k in ("topo", "folder", "global_batch", "clips_qk")})
    kw = {k: v for k, v in found.items() if v is not None}
    if at("checkpoint.exclude_from_loading") is not None:
        kw["exclude_from_loading"] = tuple(at("checkpoint.exclude_from_loading"))
    if at("training.disable_cuda_graphs") is not None:
        kw["grads_freed"] = bool(at("training.disable_cuda_graphs"))
    if at("ledger.rehearsal") is not None:
        kw["prove_at"] = parse_skip_steps(at("ledger.rehearsal.prove_at"), "--ledger.rehearsal.prove_at")
        kw["faults"] = parse_response_faults(at("ledger.rehearsal.response_fault"))
    kw["parts"] = Parts(**{f: getattr(obj, f, None) for f in Parts.__dataclass_fields__})  # (the double's fakes)
    kw["loader"], kw["owned_params"] = getattr(ledger, "loader", None), getattr(ledger, "owned_params", None)
    return RunFacts(**{"device": getattr(obj, "device", None) or torch.device("cpu"), **kw, **given})


def proof_record(verdict: str, applied: str = "original", acting: bool = True, **fields):
    """A proof as the response writes it (``format.proofs.ProofRecord``), for a unit test's
    planned verdict."""
    from titan_ledger.format.proofs import Applied, Finding, ProofRecord

    return ProofRecord(verdict=Finding(verdict), applied=Applied(applied), why=fields.pop("why", ""), acting=acting,
                       executions=fields.pop("executions", []), **fields)
