"""The training console: which ranks log, and the noise nobody can act on.

Design decision: torchtitan logs every line (setup, one line per step) on every rank.
torchtitan's own launcher filters ranks in torchrun (``--local-ranks-filter``, by
*local* rank, which also hides the other ranks' warnings and prints once per node).
Here the filter is by *global* rank, in the process: the rank that logs torchtitan's
metrics (``_get_metrics_rank``: global rank 0, or under pipeline parallelism the first
rank of the last stage, which holds the loss) keeps INFO; every other rank logs WARNING
and above only. ``TITAN_LEDGER_LOG_RANKS=all`` (or ``=0,3``: global ranks) overrides
that. titan_ledger's own lines (job, backend, end-of-run summary: :data:`log`) come from
global rank 0, which writes the signals ledger. Known noise (:func:`quiet_imports`,
:func:`quiet_run`) is dropped by exact message patterns, never by level; where the
console is not a terminal, torchtitan's colour codes are stripped at the handler (not
through its config flag: the config and its digest must not depend on where the output
goes).

Its own module: ``titan_ledger.train`` calls :func:`quiet_imports` before torchtitan is
imported and :func:`configure_console` and :func:`quiet_run` right after torchtitan's
``init_logger``; none of it builds or trains anything.
"""

from __future__ import annotations

import logging
import os
import re
import types
import warnings

from titan_ledger.config.toml_frontend import ConfigError, world_size_from_env
from titan_ledger.rehearsal import backend

LOG_RANKS_ENV = "TITAN_LEDGER_LOG_RANKS"

#: titan_ledger's own console lines (job, backend, dry run, run summary): rank 0. Named
#: after the entry point whose lines they are (``titan_ledger.train``).
log = logging.getLogger("titan_ledger.train")


def global_rank() -> int:
    """This process's global rank (``RANK``; 0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def console_ranks(config) -> set[int] | None:
    """Global ranks that log torchtitan's INFO lines; None means every rank.

    ``TITAN_LEDGER_LOG_RANKS``: ``all``, or comma-separated global ranks. Default:
    the rank torchtitan 0.3.0 logs metrics from (it holds the loss under PP).
    """
    if config.comm.mode in ("fake_backend", "local_tensor"):
        return None  # one process simulating one rank: it is the whole console
    spec = os.environ.get(LOG_RANKS_ENV, "").strip()
    if spec.lower() == "all":
        return None
    if spec:
        try:
            ranks = {int(x) for x in spec.split(",") if x.strip()}
        except ValueError:
            ranks = set()
        if not ranks or min(ranks) < 0:
            raise ConfigError(
                f"environment: {LOG_RANKS_ENV}={spec!r}: expected 'all' or comma-separated "
                "global ranks, e.g. 0,1"
            )
        return ranks
    return {metrics_rank(config, world_size_from_env(config))}


def metrics_rank(config, world_size: int) -> int:
    """The global rank torchtitan 0.3.0 logs metrics (and the real loss) from."""
    from torchtitan.components.metrics import _get_metrics_rank

    pp = config.parallelism.pipeline_parallel_degree
    dims = types.SimpleNamespace(pp_enabled=pp > 1, pp=pp, world_size=world_size)
    return _get_metrics_rank(parallel_dims=dims,
                             pp_schedule=config.parallelism.pipeline_parallel_schedule)


def configure_console(config, rank: int | None = None) -> set[int] | None:
    """Set this rank's log levels (call right after torchtitan's ``init_logger``)."""
    rank = global_rank() if rank is None else rank
    ranks = console_ranks(config)
    verbose = ranks is None or rank in ranks
    world = world_size_from_env(config)
    loss_rank = metrics_rank(config, world)
    # torchtitan warns under PP unless LOG_RANK (its run_train.sh's rank filter) names
    # the loss rank, and tells the user to edit run_train.sh; the filter is ours here.
    os.environ["LOG_RANK"] = ",".join(map(str, sorted(range(world) if ranks is None else ranks)))
    if ranks is not None and loss_rank not in ranks and rank == 0:
        logging.getLogger().warning(
            f"{LOG_RANKS_ENV}={os.environ.get(LOG_RANKS_ENV)} leaves out global rank {loss_rank}, "
            "the rank that logs the loss under pipeline parallelism: no step lines on the console")
    # torchtitan logs through the root logger; warnings and errors stay on every rank
    logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)
    if ranks is None:
        log.setLevel(logging.NOTSET)  # every rank: inherit the root's INFO
    else:
        log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not verbose:
        try:  # HF datasets' "Generating train split" bar: the console rank shows it
            import datasets

            datasets.disable_progress_bars()
        except ImportError:
            pass
    return ranks


def quiet_imports() -> None:
    """Before torchtitan (and torchao) are imported, on every rank."""
    # torchao registers its Enums as pytree constants at import; torch 2.14 logs a
    # deprecation note per Enum, addressed to torchao's developers, not to a user.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # torchdata's StatefulDataLoader calls torch.set_vital, deprecated in torch; a
    # note for torchdata's developers, printed by every rank.
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning)
    # On a resume, torchtitan's LR scheduler wrapper reads the scheduler's last LR the
    # way torch 2.14 warns about ("use get_last_lr()"), once per rank: a note for
    # torchtitan's developers; the LR the run uses is the recorded `lr` column.
    warnings.filterwarnings("ignore", category=UserWarning,
                            message=r"To get the last learning rate computed by the scheduler")
    # Under TP, spmd_types (torchtitan's DTensor helpers) calls the c10d collectives
    # torch 2.14 deprecated; a note for spmd_types, printed by every rank.
    warnings.filterwarnings(
        "ignore", category=FutureWarning,
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    # DTensor notes that torchtitan's own layouts (FSDP x TP strided shards, the grad
    # norm over both mesh dims) redistribute in two collectives: a performance note
    # about torchtitan's parallelization, per rank; results are checked against an
    # unsharded run by the tests.
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        lambda r: not _TWO_COLLECTIVES.search(r.getMessage()))


_TWO_COLLECTIVES = re.compile(
    r"^While redistributing from .* \d+ sequential (all_gather|all_reduce) operations will be performed")


#: (pattern, when) for torchtitan log records that are noise; ``when(config)``.
_NOISE: list[tuple[re.Pattern, object]] = [
    # Containers rarely ship lspci; torchtitan then uses torch's device name, and
    # warns separately ("Peak flops undefined") if that name is unknown.
    (re.compile(r"^Error running lspci: "), lambda c: True),
    # CPU rehearsal: there is no peak FLOPS for a CPU (torchtitan falls back to an
    # A100's); the mfu column means nothing there.
    (re.compile(r"^Peak flops undefined for: "), lambda c: backend.installed() == "cpu"),
    (re.compile(r"^Peak FLOPS used for computing MFU: "), lambda c: backend.installed() == "cpu"),
    # torchrun exports TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless set; torchtitan always
    # sets 3 (needed for flight-recorder dumps). Nothing for the user to do.
    (re.compile(r"^ENV\[TORCH_NCCL_ASYNC_ERROR_HANDLING\] = [13] will be overridden to 3 "),
     lambda c: True),
    # torchtitan's own default (initial_load_model_only=True) warns when no
    # initial_load_path is set, i.e. on every run.
    (re.compile(r"^initial_load_model_only=True has no effect without an initial_load_path"),
     lambda c: True),
    # The HF index only matters when checkpoints are saved in HF format.
    (re.compile(r"^model\.safetensors\.index\.json not found at hf_assets_path"),
     lambda c: not getattr(c.checkpoint, "last_save_in_hf", False)),
]


class _DropNoise(logging.Filter):
    def __init__(self, patterns: list[re.Pattern]):
        super().__init__("titan_ledger.noise")
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(p.search(msg) for p in self.patterns)


#: a terminal's colour codes (SGR: ``ESC [ ... m``), as torchtitan's ``Color`` writes them
_SGR = re.compile(r"\x1b\[[0-9;]*m")


class _PlainText(logging.Formatter):
    """A handler's own formatter, its output without colour codes (the record itself is
    left alone: another handler, a terminal, keeps them)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return _SGR.sub("", self.inner.format(record))


def _is_terminal(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # a closed or foreign stream: not a terminal
        return False


def quiet_run(config) -> None:
    """After ``init_logger``: drop known noise records and CPU-only warnings; no colour
    codes where the output is not a terminal."""
    patterns = [p for p, when in _NOISE if when(config)]
    noise = _DropNoise(patterns)
    for h in logging.getLogger().handlers:
        h.addFilter(noise)
        # torchtitan colours its step line and the model's size (``Color`` of
        # torchtitan.tools.utils) unless --metrics.disable_color_printing; written to a
        # file or a pipe (a log, CI, tee) the codes are noise. Stripped at the handler,
        # not by setting that flag: the config (its digest, the recorded launch) must not
        # depend on where the output goes.
        if not _is_terminal(h) and not isinstance(h.formatter, _PlainText):
            h.setFormatter(_PlainText(h.formatter))
    # torch's DCP writer warns once per rank per save into an existing step-N folder ("Detected
    # an existing checkpoint in ..., overwriting since self.overwrite=True"): a relaunch that
    # rewinds (or an in-process rollback) replaces the old trajectory's checkpoints on purpose;
    # the relaunch says which, once, on rank 0 (say_relaunch, launch_diff.rewind_line).
    warnings.filterwarnings("ignore", category=UserWarning,
                            message=r"Detected an existing checkpoint in .*, overwriting since self\.overwrite=True")
    if backend.installed() == "cpu":
        # CPU rehearsal: DTensor's offset-based RNG is CUDA-only; every rank warns at
        # model init. Known and inherent to the rehearsal (tests check the signals
        # against an unsharded run); the user cannot act on it.
        warnings.filterwarnings(
            "ignore", message=r"DTensor (random operators|manual_seed\(\)) may not have complete "
            r"support on cpu device mesh", category=UserWarning)
