"""``torchrun -m titan_ledger.train --job.config_file X.toml [--section.key value ...]``.

Design decision: the order of work is forced by torchtitan 0.3.0. (1) Read the
command line and the TOML file without torchtitan (``toml_frontend.read_job``),
because (2) the device backend must be installed before any torchtitan module
binds ``device_type``; only then (3) parse through torchtitan's ``ConfigManager``
and (4) run the body of ``torchtitan.train.main``, copied here because it parses
``sys.argv`` itself and has no hook for another parser. Changed spots are marked
``# CHANGED from torchtitan``.

With ``--comm.mode fake_backend`` (and ``NGPU`` = the world size to simulate) the
trainer is built -- meshes, parallelisms, model init, optimizer, dataloader -- and
closed without training: torchtitan's fake process group returns no real data, so
this is a configuration dry run.

Console: which ranks log, and the known noise dropped, is ``titan_ledger.console``;
titan_ledger's own lines (job, backend, the end-of-run summary) come from global rank 0,
which writes the signals ledger. The end-of-run summary (what a run left on disk, and the
commands that look at it) is ``titan_ledger.summary``.

A relaunch into a dump folder that holds a run says what it changes, on rank 0 before
the trainer is built (:func:`say_relaunch`): the run's recorded launch (the launch log's
last row with flags) is parsed by this module's own parse path (:func:`parse_flags`) and
compared setting by setting (``config/launch_diff.py``); a rewind names the checkpoints it
will write again; a launch that resumed at its last step says it trained nothing. Files
are only read, and a comparison that fails is a warning, never a failed launch.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

from titan_ledger.components.run import disk_space
from titan_ledger.config.toml_frontend import (
    ConfigError,
    check_world_size,
    parse,
    read_job,
    world_size_from_env,
)
from titan_ledger.config.validate import dp_size_of, validate
from titan_ledger.console import configure_console, global_rank, log, metrics_rank, quiet_imports, quiet_run
from titan_ledger.errors import (
    EXIT_BAD_INPUT,
    EXIT_DISK_FULL,
    TitanLedgerError,
    fail_line,
    os_error_line,
)
from titan_ledger.rehearsal import backend
from titan_ledger.summary import run_summary

PROG = "titan_ledger.train"


def load_config(argv: list[str], *, files: bool = True):
    """Command line (+ TOML) -> validated LedgerTrainer config. Raises ConfigError.

    Every check of the launch is here, before anything is written (``run`` calls this
    first). ``files=False`` leaves out :func:`check_files` (``titan_ledger.launch`` checks
    the dump folder's lock first and then calls it)."""
    config, job = parse_flags(argv)
    check_world_size(config, world_size_from_env(config))
    validate(config, world_size_from_env(config))  # every launch check of values against each other
    check_ranks(config)
    if files:
        check_files(config, world_size_from_env(config))
    if config.comm.mode == "fake_backend" and backend.installed() == "cpu":
        # A dry run must not touch a GPU; it only builds.
        config.training.disable_cuda_graphs = True
    return config, job


def parse_flags(argv: list[str]):
    """Command line (+ TOML) -> (torchtitan's parsed config, the job), nothing checked: the
    one parse path of a launch (:func:`load_config`) and of the recorded launch a relaunch
    is compared with (:func:`relaunch_report`). Installs the device backend first."""
    job = read_job(argv)
    backend.install(job.device)
    return parse(job), job


def check_ranks(config) -> None:
    """A multi-process world needs its ranks started by torchrun (or the launcher), which
    sets RANK and LOCAL_RANK; without them torchtitan fails deep in device selection."""
    if config.comm.mode in ("fake_backend", "local_tensor"):
        return
    world = world_size_from_env(config)
    missing = [k for k in ("RANK", "LOCAL_RANK") if k not in os.environ]
    if world > 1 and missing:
        raise ConfigError(f"WORLD_SIZE={world} is set but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not: start the {world} ranks with "
                          f"python -m titan_ledger.launch --nproc {world} -- <these flags> (or torchrun)")


def check_launched(config) -> None:
    """The process was started as a rank: torchtitan reads LOCAL_RANK when it picks the
    device and fails with a bare traceback when it is unset (a plain ``python -m
    titan_ledger.train``). Checked in :func:`run` only, after the config is accepted, so
    the in-process refusals of bad input keep their own lines; ``local_tensor`` needs no rank."""
    if config.comm.mode == "local_tensor" or "LOCAL_RANK" in os.environ:
        return
    raise ConfigError("LOCAL_RANK is not set: this process was not started as a rank; run "
                      "python -m titan_ledger.launch --nproc 1 -- <these flags> (or torchrun "
                      "--nproc_per_node 1 -m titan_ledger.train <these flags>), or for a dry run "
                      "set RANK=0 LOCAL_RANK=0 WORLD_SIZE=<the world size>")


def check_files(config, world_size: int) -> None:
    """What the ranks would otherwise refuse only after torchrun started them, checked
    from files on every rank (and in ``titan_ledger.launch``) before any process group,
    read-only: the tokenizer folder, every input file of the dataloader
    (``LedgerDataLoader`` configs: ``inputs.check_inputs``), and the run already in the
    dump folder (:func:`check_dump_folder_run`)."""
    from titan_ledger.data.inputs import check_inputs
    from titan_ledger.data.loader import LedgerDataLoader

    dry = config.comm.mode == "fake_backend"
    check_tokenizer_path(config)
    if isinstance(config.dataloader, LedgerDataLoader.Config):
        check_inputs(config.dataloader, dry_run=dry)
    if not dry and config.comm.mode != "local_tensor":
        check_dump_folder_run(config, world_size)


def check_tokenizer_path(config) -> None:
    """``--hf_assets_path`` holds a tokenizer torchtitan's ``HuggingFaceTokenizer`` can load
    (it raises a FileNotFoundError naming no file, on every rank, after the process group)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    if not isinstance(getattr(config, "tokenizer", None), HuggingFaceTokenizer.Config):
        return
    p = Path(config.hf_assets_path)
    if not p.is_dir():
        raise ConfigError(f"--hf_assets_path {p}: no such folder (it holds the tokenizer: "
                          f"tokenizer.json)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "vocab.json", "vocab.txt")):
        raise ConfigError(f"--hf_assets_path {p}: no tokenizer.json (nor vocab.json / vocab.txt) "
                          f"in this folder")


def check_dump_folder_run(config, world_size: int) -> None:
    """The dump folder holds this run or none (``run_folder.claim_dump_folder``, read-only, with
    the rules of the check rank 0 repeats at setup): seq_len, global batch and the data
    fingerprint (``inputs.data_fingerprint``: source, tokenizer, seq_len, seed; computed
    only when the folder holds a data ledger to compare with). ``--ledger.new_run`` (rank 0
    moves the old run aside at setup) and ``--ledger.allow_data_change`` skip it."""
    led = getattr(config, "ledger", None)
    if led is None or led.new_run or led.allow_data_change:
        return
    from titan_ledger.components.run.run_folder import claim_dump_folder
    from titan_ledger.data.inputs import data_fingerprint
    from titan_ledger.data.loader import LedgerDataLoader

    t = config.training
    dp = dp_size_of(config, world_size)
    gb = t.global_batch_size if getattr(t, "global_batch_size", -1) > 0 else t.local_batch_size * dp
    layout = {"seq_len": t.seq_len, "global_batch": gb}
    if isinstance(config.dataloader, LedgerDataLoader.Config):
        def fingerprint():
            tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
            return data_fingerprint(config.dataloader, tokenizer, t.seq_len, dp)

        layout["fingerprint"] = fingerprint
    claim_dump_folder(config.dump_folder, led.folder, layout, read_only=True,
                      checkpoint_folder=config.checkpoint.folder,
                      checkpoint_enabled=config.checkpoint.enable)


# --------------------------------------------------------------------------- #
# A relaunch: what it changes against the run already in the dump folder.
# --------------------------------------------------------------------------- #


def relaunch_report(config) -> list[tuple[str, str]]:
    """``(level, line)`` for what this launch changes against the run in its dump folder:
    its settings against the run's recorded launch (the last launch-log row with ``argv``,
    parsed by :func:`parse_flags` as this launch was, in its own working directory, with
    this launch's dump folder), and the checkpoints of the old trajectory a rewind will
    write again. Reads files only (``config/launch_diff.py`` says what differs); raises
    what reading or parsing raises (:func:`say_relaunch` keeps that from the launch)."""
    from titan_ledger.config import launch_diff
    from titan_ledger.format import records
    from titan_ledger.format.reader import RunLedger, checkpoints

    out: list[tuple[str, str]] = []
    log_file = Path(config.dump_folder) / config.ledger.folder / records.SEGMENTS_FILE
    rows = RunLedger(config.dump_folder, config.ledger.folder).launches() if log_file.is_file() else []
    rows = [r for r in rows if isinstance(r.get("argv"), list)]  # ledgers before issue 24 record no flags
    if rows:
        row = rows[-1]
        argv = launch_diff.rooted(launch_diff.strip_recorded(row["argv"]), row.get("cwd"))
        then, _ = parse_flags([*argv, "--job.dump_folder", str(config.dump_folder)])
        out += launch_diff.relaunch_lines(launch_diff.settings(config), launch_diff.settings(then),
                                          seq=row.get("seq"), log=log_file,
                                          world_now=world_size_from_env(config), world_then=row.get("world_size"))
    ck = config.checkpoint
    if ck.enable:
        line = launch_diff.rewind_line(ck.load_step, checkpoints(config.dump_folder, ck.folder),
                                       config.training.steps, ck.interval)
        if line is not None:
            out.append(("info", line))
    return out


def say_relaunch(config) -> None:
    """Rank 0, before the trainer is built: :func:`relaunch_report`'s lines. A comparison
    that fails is a warning, never a failed launch (the launch was checked already; a
    recorded launch this checkout no longer parses is history, not an error)."""
    if config.ledger.new_run:  # the old run is moved aside at setup: this launch starts a new one
        return
    try:
        lines = relaunch_report(config)
    except (Exception, SystemExit) as e:  # (tyro exits on flags it cannot parse)
        log.warning(f"titan_ledger: relaunch: not compared with the run's recorded launch "
                    f"({type(e).__name__}: {e}); training goes on")
        return
    for level, line in lines:
        (log.warning if level == "warning" else log.info)(line)


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def main(argv: list[str] | None = None) -> None:
    """Entry point: a TitanLedgerError becomes one stderr line (rank 0) and its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    disk_space.guard_logging()
    try:
        _run_or_fail(argv)
    except Exception as e:
        full = disk_space.enospc_of(e)
        if full is None:
            raise
        # every process whose write failed says its own path: one line, no traceback
        print(fail_line(PROG, disk_space.full_disk_line(full, _DUMP_FOLDER[-1:] and _DUMP_FOLDER[-1] or None)),
              file=sys.stderr, flush=True)
        sys.exit(EXIT_DISK_FULL)


#: the dump folder of the run this process parsed (a full disk's line names it when the
#: failed write named no path)
_DUMP_FOLDER: list[str] = []


def _run_or_fail(argv: list[str]) -> None:
    try:
        run(argv)
    except TitanLedgerError as e:
        _say_once(fail_line(PROG, e))
        sys.exit(e.exit_code)
    except OSError as e:  # a dump folder, config or corpus path that cannot be used
        line = os_error_line(e)
        if line is None or e.errno == errno.ENOSPC:  # (a full disk: main's one line)
            raise
        _say_once(fail_line(PROG, line))
        sys.exit(EXIT_BAD_INPUT)


#: how long a rank other than 0 waits before it says a bad-input error itself
SAY_ONCE_WAIT_S = 10.0


def _say_once(line: str) -> None:
    """Every rank raises the same bad input; rank 0 says it. Another rank waits first:
    torchrun stops every rank when the first one exits, so a rank 1 that exited at once
    could take rank 0 down before its line was printed (seen on a loaded machine: exit 2
    and no line). Still alive after ``SAY_ONCE_WAIT_S``, the error was this rank's own
    (rank 0 went on), so it says it."""
    if global_rank() != 0:
        if os.environ.get("TORCHELASTIC_RUN_ID") is None:  # not torchrun: rank 0 says it
            return
        import time

        time.sleep(SAY_ONCE_WAIT_S)
    print(line, file=sys.stderr, flush=True)


def run(argv: list[str]) -> None:
    """Parse, build, train. Raises TitanLedgerError on bad input."""
    quiet_imports()
    config, job = load_config(argv)
    _DUMP_FOLDER.append(str(config.dump_folder))
    check_launched(config)
    from torchtitan.tools.logging import logger

    from titan_ledger.trainer import LedgerTrainer

    # ---- body of torchtitan.train.main ----
    start_logging(config, job)
    is_ledger = isinstance(config, LedgerTrainer.Config)
    if not is_ledger:  # CHANGED from torchtitan
        logger.warning(
            f"--config {job.module}.{job.config} builds {type(config).__qualname__}, not "
            "LedgerTrainer.Config: training without the ledger"
        )
    dry_run = config.comm.mode == "fake_backend"  # CHANGED from torchtitan

    trainer = None
    trained = False
    lock = None
    try:
        if not dry_run and config.comm.mode != "local_tensor" and global_rank() == 0:
            lock = lock_dump_folder(config)  # CHANGED from torchtitan: one live run per dump folder
            if is_ledger:  # CHANGED from torchtitan: a relaunch says what it changes (the run's own lock held)
                say_relaunch(config)
        if config.comm.mode == "local_tensor":
            logger.info("Local tensor mode enabled - skipping training execution")
            return
        if not dry_run:  # CHANGED from torchtitan: a stable W&B run id before wandb.init
            from titan_ledger.components.ledger import dashboards

            dashboards.prepare(config, job, is_metrics_rank=global_rank() == metrics_rank(
                config, world_size_from_env(config)))
        trainer = config.build()
        if is_ledger:  # CHANGED from torchtitan: the tools reuse the recorded launch (segment headers)
            from titan_ledger.components.run.run_folder import Launch

            trainer.ledger.launch = Launch(list(argv), os.getcwd(), sys.executable)
        trained = train_or_build(config, trainer)
    except Exception:  # CHANGED from torchtitan: TitanLedgerError goes up to main
        close_after_failure(config, trainer, lock)
        raise
    else:
        close_after_run(config, trainer, lock, barrier=trained and is_ledger)
        if trained and is_ledger and global_rank() == 0:  # CHANGED from torchtitan
            say_run_end(config, trainer)


# The steps of ``run``, in the order it takes them (each a part of torchtitan.train.main's
# body, or titan_ledger's own step between two of its parts).


def start_logging(config, job) -> None:
    """torchtitan's logger, this rank's console (:mod:`titan_ledger.console`), the job's
    first lines, torchtitan's structured logger."""
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger

    init_logger()
    configure_console(config)  # CHANGED from torchtitan: rank filter, before the first line
    quiet_run(config)  # CHANGED from torchtitan
    if job.description:
        log.info(f"titan_ledger job: {job.description} ({job.config_file})")  # CHANGED from torchtitan
    log.info(f"titan_ledger backend: {backend.installed()}")  # CHANGED from torchtitan
    sl.init_structured_logger(
        source="training",
        output_dir=config.dump_folder,
        enable=config.debug.enable_structured_logging,
    )


def lock_dump_folder(config):
    """Rank 0, before the first write: the dump folder's run lock (one live run per dump
    folder; a stale lock of a process that is gone is taken over, and said)."""
    from titan_ledger.components.run import run_lock

    lock, stale = run_lock.acquire(config.dump_folder)
    if stale is not None:
        log.warning(f"titan_ledger: took over the stale lock of {stale.describe()} in "
                    f"{config.dump_folder} (that process is gone)")
    return lock


def train_or_build(config, trainer) -> bool:
    """What the built trainer does: nothing more in a dry run (the build was the check), a
    seed checkpoint, or train. True when it trained."""
    from torchtitan.tools.logging import logger

    if config.comm.mode == "fake_backend":  # CHANGED from torchtitan: build-only dry run
        log.info(
            f"titan_ledger dry run: built {type(trainer).__name__} for world size "
            f"{world_size_from_env(config)}; not training (fake backend)"
        )
        return False
    if config.checkpoint.create_seed_checkpoint:
        assert int(os.environ["WORLD_SIZE"]) == 1, "seed checkpoint needs a single process"
        assert config.checkpoint.enable, "seed checkpoint needs --checkpoint.enable"
        trainer.checkpointer.save(curr_step=0, last_step=True)
        logger.info("Created seed checkpoint")
        return False
    trainer.train()
    return True


def close_after_failure(config, trainer, lock) -> None:
    """A run that raised: its trainer closed, its lock released (the error goes on up)."""
    from titan_ledger.components.run import run_lock

    if trainer:
        trainer.close()
    if lock is not None:
        run_lock.release(lock)
    if backend.installed() == "cpu":  # gloo has no flight recorder: nothing is ever written there
        drop_empty_traces(config)


def close_after_run(config, trainer, lock, *, barrier: bool) -> None:
    """A run that returned: its trainer closed, its lock released, the process group
    destroyed -- after a barrier when ``barrier`` (a trained ledger run: every rank's rows
    are on disk before rank 0 reads them for the summary)."""
    import torch
    from torchtitan.tools.logging import logger

    from titan_ledger.components.run import run_lock

    trainer.close()
    if lock is not None:  # every file of this run is closed
        run_lock.release(lock)
    if torch.distributed.is_initialized():
        if barrier:  # CHANGED from torchtitan: every rank's rows are on disk
            # NCCL warns about guessing the device unless it is named
            ids = [torch.cuda.current_device()] if backend.installed() == "cuda" else None
            torch.distributed.barrier(device_ids=ids)
        torch.distributed.destroy_process_group()
    logger.info("Process group destroyed")
    drop_empty_traces(config)  # CHANGED from torchtitan: every rank is past the barrier


def say_run_end(config, trainer) -> None:
    """Rank 0, after a ledger run trained: the end-of-run summary (:mod:`titan_ledger.summary`;
    one that fails is a warning, never a failed run), and a launch that had nothing left
    to train says so."""
    try:
        log.info(run_summary(config.dump_folder, config.ledger.folder,
                             checkpoint_folder=config.checkpoint.folder))
    except Exception as e:  # a summary must not fail a finished run
        log.warning(f"titan_ledger: no run summary ({type(e).__name__}: {e})")
    if not trainer.ran_a_step and trainer.step >= config.training.steps:
        from titan_ledger.config.launch_diff import nothing_left_line

        log.warning(nothing_left_line(trainer.step, config.training.steps))


def drop_empty_traces(config) -> None:
    """torchtitan's ``init_distributed`` creates ``<dump>/comm_traces`` on every rank for
    NCCL's flight recorder, which writes there only when a collective times out; a run
    that ended without one leaves an empty folder in every dump folder. Removed when empty
    (every rank tries: a node's own folder; the one that loses the race finds none)."""
    try:
        (Path(config.dump_folder) / config.comm.save_traces_folder).rmdir()
    except OSError:  # not empty (a dump to read), or already gone
        pass


def _exit_finished() -> None:
    """After a run that finished (every file closed by ``trainer.close()``, the process
    group destroyed, logging flushed here), leave without interpreter finalization:
    C++ destructors of gloo/c10d threads can abort there ("terminate called without an
    active exception", SIGABRT; seen once in ``bench/bench_detection.py`` on rank 1,
    after "Process group destroyed"), and torchrun then reports a finished run as
    failed. Only for the torchrun entry point: ``main()`` called in-process returns."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    _exit_finished()
