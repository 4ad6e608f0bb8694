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
"""

from __future__ import annotations

import os
import sys

from titan_ledger import backend
from titan_ledger.toml_frontend import (
    ConfigError,
    check_world_size,
    fail,
    parse,
    read_job,
    world_size_from_env,
)


def load_config(argv: list[str]):
    """Command line (+ TOML) -> validated LedgerTrainer config. Raises ConfigError."""
    job = read_job(argv)
    backend.install(job.device)
    config = parse(job)
    check_world_size(config, world_size_from_env(config))
    if config.comm.mode == "fake_backend" and backend.installed() == "cpu":
        # A dry run must not touch a GPU; it only builds.
        config.training.disable_cuda_graphs = True
    return config, job


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, job = load_config(argv)
    except ConfigError as e:
        fail(str(e))

    import torch
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger, logger

    from titan_ledger.data.indexed import CorpusError
    from titan_ledger.data.layout import SkipError
    from titan_ledger.dataloader import DataStateError
    from titan_ledger.trainer import LedgerTrainer

    # ---- body of torchtitan.train.main ----
    init_logger()
    if job.description:
        logger.info(f"titan_ledger job: {job.description} ({job.config_file})")  # CHANGED from torchtitan
    logger.info(f"titan_ledger backend: {backend.installed()}")  # CHANGED from torchtitan
    sl.init_structured_logger(
        source="training",
        output_dir=config.dump_folder,
        enable=config.debug.enable_structured_logging,
    )
    if not isinstance(config, LedgerTrainer.Config):  # CHANGED from torchtitan
        logger.warning(
            f"--config {job.module}.{job.config} builds {type(config).__qualname__}, not "
            "LedgerTrainer.Config: training without the ledger"
        )
    dry_run = config.comm.mode == "fake_backend"  # CHANGED from torchtitan

    trainer = None
    try:
        if config.comm.mode == "local_tensor":
            logger.info("Local tensor mode enabled - skipping training execution")
            return
        trainer = config.build()
        if dry_run:  # CHANGED from torchtitan: build-only dry run
            logger.info(
                f"titan_ledger dry run: built {type(trainer).__name__} for world size "
                f"{world_size_from_env(config)}; not training (fake backend)"
            )
        elif config.checkpoint.create_seed_checkpoint:
            assert int(os.environ["WORLD_SIZE"]) == 1, "seed checkpoint needs a single process"
            assert config.checkpoint.enable, "seed checkpoint needs --checkpoint.enable"
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except (DataStateError, CorpusError, SkipError) as e:  # CHANGED from torchtitan: bad input
        if trainer:
            trainer.close()
        fail(str(e))
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
