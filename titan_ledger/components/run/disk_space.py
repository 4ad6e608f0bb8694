"""What a run will write into its dump folder, against the space its filesystem has.

Design decision: a disk that fills mid-run costs the run (issue 37: a 2-process run on a
small filesystem ended in 1,272 lines of logging errors), and the numbers that say it
will happen are known before the first step: a checkpoint's size is the model's and the
optimizer's state (every parameter's bytes, plus Adam's two moments of the same size),
torchtitan keeps ``--checkpoint.keep_latest_k`` of them (and writes the next before it
purges the oldest), and what the ledger and torchtitan's own logs add per step is
measured here (below). So rank 0 estimates it once, when the first step starts, and
warns with the numbers when the free space cannot hold it (and ``titan_ledger.launch``
does the same before any rank starts, from the config: :func:`warn_before_launch`); it never refuses (a user may
free space or move checkpoints while the run trains). The arithmetic is pure
(:func:`estimate`, :func:`shortfall`); :func:`warn_at_start` is the seam.

When the disk fills anyway, one handler for the condition: :func:`guard_logging` makes
the first ``ENOSPC`` of any logging handler (torchtitan's ``structured_logs/`` writer
fills a disk first: 27 KB a step per rank) raise out of that log call, and every later
one silent -- Python's default prints a "--- Logging error ---" traceback per call, 1,272
lines in the run issue 37 measured. ``train.main`` finds the ``ENOSPC`` in whatever
reached it (:func:`enospc_of`: the exception's causes, DCP's per-rank failures) and
prints ONE line per process (:func:`full_disk_line`): the path, its filesystem, the free
space, what to do; exit 3 (``errors.EXIT_DISK_FULL``). Ledger lines are written one
``write(2)`` each, so a full disk leaves the complete lines intact, and a checkpoint cut
short has no ``.metadata``: it is never listed or loaded.

Per-step bytes besides checkpoints, measured on this repository's debug runs
(``debug_cpu``, 2 ranks, 4 x 256 tokens per rank, 8 steps: ``du -sb`` of the dump
folder's parts): the ledger wrote 31,780 bytes (about 3,000 a step for 2 DP ranks, plus
its headers), torchtitan's ``structured_logs/`` 437,784 (about 27,000 a step per rank).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

#: ledger bytes a step per DP rank (its data rows and rank rows) and for the run (signals)
LEDGER_BYTES_PER_STEP_PER_DP_RANK = 1_500
SIGNALS_BYTES_PER_STEP = 900
#: torchtitan's structured_logs/ a step per rank
STRUCTURED_LOG_BYTES_PER_STEP_PER_RANK = 27_000
#: Adam/AdamW: exp_avg and exp_avg_sq, each the size of the parameter
ADAM_STATES = 2


@dataclass
class Estimate:
    checkpoint_bytes: int  # one full checkpoint (model + optimizer)
    checkpoints: int  # held at once at the peak (kept ones, plus the one being written)
    per_step_bytes: int  # ledger + structured logs, every rank
    steps_left: int

    @property
    def total(self) -> int:
        return self.checkpoint_bytes * self.checkpoints + self.per_step_bytes * self.steps_left


def checkpoints_held(start_step: int, steps: int, interval: int, keep_latest_k: int, existing: int) -> int:
    """How many checkpoints the folder holds at the peak: the ones already there plus those
    this run writes (every ``interval`` steps and the last), at most ``keep_latest_k`` + 1
    (torchtitan writes the next before purging the oldest; 0 keeps all)."""
    # counted, not listed: a 10^9-step config must not build 10^8 step numbers (it took 18 GB)
    first = (start_step // interval + 1) * interval if interval > 0 else None
    periodic = len(range(first, steps + 1, interval)) if first is not None else 0
    last = steps > start_step and (first is None or steps < first or (steps - first) % interval != 0)
    held = existing + periodic + int(last)
    return min(held, keep_latest_k + 1) if keep_latest_k > 0 else held


def estimate(param_bytes: int, optimizer_states: int, start_step: int, steps: int, interval: int,
             keep_latest_k: int, existing: int, checkpoints_on: bool, world: int, dp: int) -> Estimate:
    """What the run will still write (pure: unit-tested)."""
    ckpt = param_bytes * (1 + optimizer_states)
    held = checkpoints_held(start_step, steps, interval, keep_latest_k, existing) if checkpoints_on else 0
    per_step = LEDGER_BYTES_PER_STEP_PER_DP_RANK * dp + SIGNALS_BYTES_PER_STEP + \
        STRUCTURED_LOG_BYTES_PER_STEP_PER_RANK * world
    return Estimate(ckpt, held, per_step, max(0, steps - start_step))


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def shortfall(est: Estimate, free: int, folder: str | Path, already: int = 0) -> str | None:
    """The warning line when ``free`` bytes cannot hold what the run will still write
    (checkpoints already in the folder, ``already`` bytes, are counted as held), else None."""
    need = est.total - already
    if need <= free:
        return None
    ckpts = f"{est.checkpoints} checkpoint(s) of {human(est.checkpoint_bytes)} held at once " \
        f"(--checkpoint.keep_latest_k, --checkpoint.interval)" if est.checkpoints else "no checkpoints"
    return (f"titan_ledger: warning: {folder} has {human(free)} free but this run will need about "
            f"{human(need)}: {ckpts} and {human(est.per_step_bytes)} a step "
            f"of ledger and logs for {est.steps_left} steps; free space, keep fewer checkpoints, or "
            f"move --job.dump_folder before the disk fills")


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def against_free_space(config, param_bytes: int, optimizer_states: int, start_step: int, world: int,
                       dp: int) -> tuple[str | None, str]:
    """(the warning line or None, the info line): what the run will still write into its
    dump folder against the free space there. The one check behind the trainer's
    (:func:`warn_at_start`) and the launcher's (:func:`warn_before_launch`)."""
    from titan_ledger.format.reader import checkpoints

    ck = config.checkpoint
    dump = Path(config.dump_folder)
    existing = checkpoints(dump, ck.folder) if ck.enable else []
    est = estimate(param_bytes, optimizer_states, start_step, config.training.steps, ck.interval,
                   ck.keep_latest_k, len(existing), ck.enable, world, dp)
    free = shutil.disk_usage(mount_of(dump)).free
    already = sum(_folder_bytes(dump / ck.folder / f"step-{s}") for s in existing)
    info = (f"titan_ledger: disk: this run will write about {human(max(0, est.total - already))} "
            f"({est.checkpoints} checkpoint(s) of {human(est.checkpoint_bytes)}, "
            f"{human(est.per_step_bytes)} a step); {dump} has {human(free)} free")
    return shortfall(est, free, dump, already), info


def warn_at_start(trainer) -> str | None:
    """Rank 0, when the first step of this process starts: estimate and warn (the line, or None)."""
    if trainer.ledger.topo.rank != 0:
        return None
    from torchtitan.tools.logging import logger

    params = [p for m in trainer.model_parts for p in m.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    optims = getattr(trainer.optimizers, "optimizers", [])
    states = ADAM_STATES if all(type(o).__name__.lower().startswith("adam") for o in optims) else 1
    line, info = against_free_space(trainer.config, param_bytes, states, trainer.step - 1,
                                    trainer.ledger.topo.world, trainer.ledger.topo.dp_size)
    logger.warning(line) if line is not None else logger.info(info)
    return line


def warn_before_launch(config, world: int) -> str | None:
    """The launcher, before any rank starts: the same estimate from the config alone (the
    model built on the meta device: its full parameter count, no memory; 0.1 s for 8B),
    resuming from the newest complete checkpoint in the dump folder. The warning line or None."""
    import copy

    import torch
    from torchtitan.config import TORCH_DTYPE_MAP

    from titan_ledger.format.reader import checkpoints

    spec = copy.deepcopy(config.model_spec.model)
    spec.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.build()
    itemsize = torch.empty((), dtype=TORCH_DTYPE_MAP[config.training.dtype]).element_size()
    param_bytes = sum(p.numel() for p in model.parameters()) * itemsize
    names = {g.optimizer_name.lower() for g in config.optimizer.param_groups}
    states = ADAM_STATES if names and all(n.startswith("adam") for n in names) else 1
    existing = checkpoints(config.dump_folder, config.checkpoint.folder) if config.checkpoint.enable else []
    par = config.parallelism
    dp = max(1, world // max(1, par.tensor_parallel_degree * par.pipeline_parallel_degree
                               * par.context_parallel_degree))
    line, _ = against_free_space(config, param_bytes, states, existing[-1] if existing else 0, world, dp)
    return line


class _LoggedDiskFull(OSError):
    """The first ENOSPC of a logging handler, raised out of the log call that met it."""


_seen_full: list[OSError] = []
_guarded: list[bool] = []  # guard_logging ran in this process


def guard_logging() -> None:
    """Every logging handler: its first ENOSPC raises (naming the handler's file), every
    later one is dropped; other emit errors keep Python's behaviour."""
    if _guarded:
        return
    original = logging.Handler.handleError

    def handle_error(self, record):
        import sys

        err = sys.exc_info()[1]
        if not (isinstance(err, OSError) and err.errno == errno.ENOSPC):
            return original(self, record)
        if _seen_full:
            return None  # said once; the rest of the run's log calls are not a flood
        path = getattr(self, "baseFilename", None) or err.filename
        full = _LoggedDiskFull(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        _seen_full.append(full)
        raise full from err

    logging.Handler.handleError = handle_error
    _guarded.append(True)


def enospc_of(exc: BaseException | None) -> OSError | None:
    """The ENOSPC behind ``exc``, through its causes and contexts and DCP's
    ``CheckpointException`` per-rank failures; None when there is none."""
    seen: set[int] = set()
    todo: list = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, tuple) and e:  # DCP's WRAPPED_EXCEPTION: (exception, traceback)
            e = e[0]
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())
        todo += [e.__cause__, e.__context__]
    return None


def mount_of(path: str | Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def full_disk_line(err: OSError, dump_folder: str | Path | None = None) -> str:
    """The one line for a full disk: the path, its filesystem, free of total, what to do."""
    path = err.filename or (f"a file in {dump_folder}" if dump_folder else None)
    where = mount_of(err.filename or dump_folder or os.getcwd())
    try:
        u = shutil.disk_usage(where)
        space = f"{human(u.free)} free of {human(u.total)}"
    except OSError:
        space = "free space unknown"
    return (f"disk full: could not write {path or 'a file'} (filesystem {where}: {space}); free space there or "
            f"move --job.dump_folder, then relaunch the same command: it resumes from the newest "
            f"complete checkpoint")
