"""Launch checks: every check of a launch's values against each other, in one function.

Design decision: a value that is wrong on its own (a negative count, a ladder that does
not parse) is refused by its section's ``__post_init__`` when the flags are parsed; a
value that is wrong *given the others* (a skip window past the last step, a rollback
without checkpoints, an injection on a DP rank the world does not have) is a launch
check and lives here, in :func:`validate`, and nowhere else. It needs the config and
the world size only -- no process group, no model, no file written -- so the launcher
(``titan_ledger.launch``, through ``train.load_config``), every rank before torchrun's
process group (``train.load_config``) and ``LedgerTrainer.__init__`` (a trainer built
in-process, as the tests do) all call it, and every caller sees the same line naming
the flag to change.

torchtitan is imported inside the functions: ``train.load_config`` installs the device
backend before anything imports torchtitan.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_ledger.errors import ConfigError


def validate(config, world: int) -> None:
    """Raise ``ConfigError`` (naming the flag and the fix) for the first launch check
    ``config`` fails on ``world`` ranks; checks reading the dump folder read only."""
    t = config.training
    if config.comm.mode != "fake_backend":
        check_dump_folder_path(config.dump_folder)
    for key in ("steps", "local_batch_size", "seq_len"):
        v = getattr(t, key, None)
        if isinstance(v, int) and v < 1:
            raise ConfigError(f"--training.{key} {v}: must be >= 1")
    if getattr(config, "ledger", None) is not None:
        _ledger(config, world)
    ck = config.checkpoint
    if ck.enable and ck.load_step not in (-1, None):
        step_dir = Path(config.dump_folder) / ck.folder / f"step-{ck.load_step}"
        if not (step_dir / ".metadata").is_file():
            state = "is incomplete (no .metadata: killed while saving)" if step_dir.is_dir() \
                else "does not exist"
            raise ConfigError(f"--checkpoint.load_step {ck.load_step}: {step_dir} {state}; pick a "
                              f"complete one (a step-N folder holding .metadata) or drop the flag")


def _ledger(config, world: int) -> None:
    from titan_ledger.components.response.ladder import parse_ladder
    from titan_ledger.data.layout import parse_skip_steps
    from titan_ledger.data.loader import LedgerDataLoader
    from titan_ledger.rehearsal.faults import parse_die, parse_injects

    led, steps = config.ledger, config.training.steps
    rungs = parse_ladder(led.response.action)
    if any(r.action != "none" for r in rungs) and not (led.signals and led.spike.enable):
        raise ConfigError(f"--ledger.response.action {led.response.action} needs --ledger.signals "
                          f"and --ledger.spike.enable")
    if any(r.rolls_back for r in rungs) and not config.checkpoint.enable:
        raise ConfigError(f"--ledger.response.action {led.response.action}: a rollback reloads checkpoints: set "
                          f"--checkpoint.enable")
    snap = led.snapshots
    if snap.every and not (led.signals and led.spike.enable and
                           (led.proof.scope != "off" or any(r.rolls_back for r in rungs))):
        raise ConfigError(f"--ledger.snapshots.every {snap.every}: nothing would read the snapshots: the window "
                          f"proof runs at a not_data proof (--ledger.proof.scope acting or all) and a rollback "
                          f"restores one (--ledger.response.action rollback), both on flags (--ledger.signals, "
                          f"--ledger.spike.enable); or set --ledger.snapshots.every 0")
    if snap.every and config.qk_clip.enable:
        raise ConfigError(f"--ledger.snapshots.every {snap.every}: QK-clip rescales weights after each update from "
                          f"the step's logits, which the window proof does not replay; drop --qk_clip.enable or "
                          f"set --ledger.snapshots.every 0")
    windows = parse_skip_steps(led.skip.steps)
    late = [w for w in windows if w[0] > steps]
    if late and not led.skip.auto:
        raise ConfigError(f"--ledger.skip.steps {late[0][0]}-{late[0][1]} starts after the last "
                          f"step (--training.steps {steps}): it would skip nothing")
    ours = isinstance(config.dataloader, LedgerDataLoader.Config)
    if windows and not ours:
        raise ConfigError("--ledger.skip.steps needs LedgerDataLoader (a titan_ledger config "
                          "function such as debug_cpu); this run's dataloader is "
                          f"{type(config.dataloader).__qualname__}")
    if (led.filter.quarantine or led.filter.repetition) and not (ours and config.dataloader.tagging):
        raise ConfigError("--ledger.filter.quarantine and --ledger.filter.repetition mask documents by the "
                          "rows' provenance: they need LedgerDataLoader with --dataloader.tagging")
    dp = dp_size_of(config, world)
    for inj in parse_injects(led.rehearsal.inject or ""):  # every spec, the faults too
        if inj[1] >= dp:
            raise ConfigError(f"--ledger.rehearsal.inject {led.rehearsal.inject}: DP rank {inj[1]} does not exist "
                              f"(this run has DP ranks 0-{dp - 1} on {world} processes)")
        if inj[0] > steps:
            raise ConfigError(f"--ledger.rehearsal.inject {led.rehearsal.inject}: step {inj[0]} is after the last "
                              f"step (--training.steps {steps})")
    die = parse_die(led.rehearsal.die)
    if die is not None and (die[1] >= world or die[0] > steps):
        raise ConfigError(f"--ledger.rehearsal.die {led.rehearsal.die}: give a rank of 0-{world - 1} and a step "
                          f"of 1-{steps} (--training.steps {steps})")
    qk = getattr(config, "qk_clip", None)
    if qk is not None and qk.enable:
        if not led.signals:
            raise ConfigError("--qk_clip.enable reads the ledger's per-head max logits: it needs "
                              "--ledger.signals (drop --ledger.no_signals)")
        if not led.max_logit:
            raise ConfigError("--qk_clip.enable reads the ledger's max attention logits: drop "
                              "--ledger.no_max_logit (or --qk_clip.enable)")


def dp_size_of(config, world_size: int) -> int:
    """The data-parallel size the parallel degrees give for ``world_size`` ranks."""
    p = config.parallelism
    shard = p.data_parallel_shard_degree
    if shard == -1:
        others = (p.data_parallel_replicate_degree * p.context_parallel_degree
                  * p.tensor_parallel_degree * p.pipeline_parallel_degree)
        shard = max(1, world_size // max(1, others))
    return p.data_parallel_replicate_degree * shard


def check_dump_folder_path(dump_folder) -> None:
    """``--dump_folder`` must be a folder this process can create and write, checked
    before anything is written there (structured logs, ledgers, checkpoints)."""
    p = Path(dump_folder)
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == p else f"has a file in its path ({probe})"
        raise ConfigError(f"--dump_folder {p}: {where}; give a folder path")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--dump_folder {p}: {probe} is not writable by this user; choose another "
                          f"--dump_folder or fix its permissions")
