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

Console: torchtitan logs every line (setup, one line per step) on every rank.
torchtitan's own launcher filters ranks in torchrun (``--local-ranks-filter``,
by *local* rank, which also hides the other ranks' warnings and prints once per
node). Here the filter is by *global* rank, in the process: the rank that logs
torchtitan's metrics (``_get_metrics_rank``: global rank 0, or under pipeline
parallelism the first rank of the last stage, which holds the loss) keeps INFO;
every other rank logs WARNING and above only. ``TITAN_LEDGER_LOG_RANKS=all`` (or
``=0,3``: global ranks) overrides that. titan_ledger's own lines (job, backend,
end-of-run summary) come from global rank 0, which writes the signals ledger.
Known noise (see :func:`quiet_imports`, :func:`quiet_run`) is dropped by exact
message patterns, never by level; where the console is not a terminal, torchtitan's
colour codes are stripped at the handler (not through its config flag: the config and
its digest must not depend on where the output goes).

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
import re
import sys
import types
import warnings
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
from titan_ledger.errors import (
    EXIT_BAD_INPUT,
    EXIT_DISK_FULL,
    TitanLedgerError,
    fail_line,
    os_error_line,
    python_command,
)
from titan_ledger.rehearsal import backend

PROG = "titan_ledger.train"
LOG_RANKS_ENV = "TITAN_LEDGER_LOG_RANKS"

#: titan_ledger's own console lines (job, backend, dry run, run summary): rank 0.
log = logging.getLogger("titan_ledger.train")


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
# Console: which ranks log, and the noise nobody can act on.
# --------------------------------------------------------------------------- #


def _rank() -> int:
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
    rank = _rank() if rank is None else rank
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


# --------------------------------------------------------------------------- #
# End of run
# --------------------------------------------------------------------------- #


def run_summary(dump_folder: str | os.PathLike, ledger_folder: str | os.PathLike = "ledger", *,
                checkpoint_folder: str = "checkpoint") -> str:
    """What the run left on disk and how to look at it (printed by rank 0 at the end).

    All ledger reading is in this one function: the signals file whole (one file, ~600 B
    a step), the data ledger by its offset index only.
    ``ledger_folder`` is relative to ``dump_folder`` (or absolute).
    """
    from titan_ledger.format.records import read_ledger

    dump = Path(dump_folder)
    folder = dump / ledger_folder
    lines = [f"titan_ledger: the ledger is in {folder}"]

    signals = folder / "signals.jsonl"
    steps: list[int] = []
    spike_steps: list[int] = []
    if signals.is_file():
        sig = read_ledger(signals)
        rows = sig.history
        steps = [r["step"] for r in rows]
        spike_steps = [r["step"] for r in rows if r.get("spike")]
        span = f", steps {min(steps)}-{max(r.get('last_step', r['step']) for r in rows)}" if rows else ""
        extra = f"; {len(sig.superseded)} superseded rows of earlier runs" if sig.superseded else ""
        lines.append(f"  signals      {len(rows)} rows{span} ({signals.name}){extra}")
    else:
        lines.append("  signals      none (ledger.signals is off)")

    spikes = folder / "spikes.jsonl"
    events = read_ledger(spikes).history if spikes.is_file() else []
    if spikes.is_file():  # the event log keeps spikes that a rollback rewound
        spike_steps = sorted({r["step"] for r in events if "rules" in r})
    if spike_steps:
        shown = ", ".join(map(str, spike_steps[:10])) + (" ..." if len(spike_steps) > 10 else "")
        lines.append(f"  spikes       {len(spike_steps)} flagged: steps {shown}")
    else:
        lines.append("  spikes       none flagged")
    lines += _response_lines(events)

    # the data ledger's extent per DP rank through its offset index: O(log n) a file (a
    # 512-rank run's data ledger is ~20 GB; rank 0 must not parse it to say goodbye)
    from titan_ledger.errors import LedgerError
    from titan_ledger.format.reader import DataLedger

    try:
        dled = DataLedger(folder)
        ends = {r: dled.last_step_of(r) for r in dled.ranks()}
    except LedgerError:
        ends = {}
    if ends:
        files = "data_dp0.jsonl" if len(ends) == 1 else "data_dp<r>.jsonl"
        if len(set(ends.values())) == 1:
            last = next(iter(ends.values()))
            each = "" if len(ends) == 1 else f" on each of {len(ends)} DP ranks"
            lines.append(f"  data ledger  steps 1-{last}{each} ({files})")
        else:
            per = ", ".join(f"dp{r}: {n}" for r, n in ends.items())
            lines.append(f"  data ledger  last step per DP rank: {per}")
    else:
        lines.append("  data ledger  none (dataloader.tagging is off, or not LedgerDataLoader)")

    # complete DCP checkpoints only: step-N/.metadata is written last
    ckpts = sorted(int(p.name[5:]) for p in (dump / checkpoint_folder).glob("step-*")
                   if p.name[5:].isdigit() and (p / ".metadata").exists())
    if ckpts:
        shown = ", ".join(f"step-{s}" for s in ckpts[-5:])
        more = f"{len(ckpts)} checkpoints, last " if len(ckpts) > 5 else ""
        lines.append(f"  checkpoints  {more}{shown} in {dump / checkpoint_folder}")
    else:
        lines.append("  checkpoints  none")

    opt = f" --ledger-folder {ledger_folder}" if str(ledger_folder) != "ledger" else ""
    look = spike_steps[0] if spike_steps else (max(steps) if steps else 1)
    py = python_command()  # the interpreter that trained: the commands run as printed
    lines += [
        "  look at it:",
        f"    {py} -m titan_ledger.plot {dump} -o {dump / 'signals.png'}{opt}",
        f"    {py} -m titan_ledger.diagnose {dump}{opt}",
        f"    {py} -m titan_ledger.lookup {dump} --step {look}{opt}",
    ]
    if spike_steps:
        lines.append(f"    {py} -m titan_ledger.report {dump} --step {spike_steps[0]} -o "
                     f"{dump / f'incident-step{spike_steps[0]}.html'}{opt}")
    lines.append(f"    {py} -m titan_ledger.export {dump} -o {dump / 'export'}{opt}")
    return "\n".join(lines)


def _response_lines(events: list[dict]) -> list[str]:
    """The summary's lines on what the response did: notes, proofs by verdict and what
    they changed or would have changed, and the response's own events (breaker, steps
    consumed untrained, failures). Pure: ``events`` are spikes.jsonl's."""
    from collections import Counter

    notes = sum(1 for e in events if "notes" in e and "rules" not in e)
    proofs = [e["proof"] for e in events if e.get("proof")]
    out = []
    if notes:
        out.append(f"  notes        {notes} recorded, never acted on")
    if proofs:
        by = Counter(p["verdict"] for p in proofs)
        verdicts = ", ".join(f"{n} {v}" for v, n in by.most_common())
        acted = sum(1 for p in proofs if p.get("applied") not in (None, "original"))
        held = Counter(p["held_back"] for p in proofs if p.get("held_back"))
        done = [f"{acted} acted on"] if acted else []
        done += [f"{n} held back ({'would have acted: --ledger.response.policy observe' if k == 'observe' else k})"
                 for k, n in held.items()]
        out.append(f"  proofs       {len(proofs)}: {verdicts}" + (f"; {'; '.join(done)}" if done else "; nothing changed"))
    stalls = [e for e in events if e.get("stall")]
    if stalls:
        out.append(f"  stalls       {len(stalls)}: " + ", ".join(f"step {e['step']} ({e['stall']['kind']})"
                                                            for e in stalls[:5]))
    failed = sum(1 for e in events if "proof_failed" in e or "response_failure" in e)
    untrained = sum(1 for e in events if e.get("no_tokens"))
    paused = sum(1 for e in events if e.get("breaker") == "paused")
    extra = [f"{failed} failure(s) inside the response, training went on" if failed else "",
             f"{untrained} step(s) consumed untrained (every label masked)" if untrained else "",
             f"acting paused {paused} time(s) by the circuit breaker" if paused else ""]
    if any(extra):
        out.append("  response     " + "; ".join(x for x in extra if x))
    return out


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
    if _rank() != 0:
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
    import torch
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger, logger

    from titan_ledger.trainer import LedgerTrainer

    # ---- body of torchtitan.train.main ----
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
        if not dry_run and config.comm.mode != "local_tensor" and _rank() == 0:
            # CHANGED from torchtitan: one live run per dump folder, before the first write
            from titan_ledger.components.run import run_lock

            lock, stale = run_lock.acquire(config.dump_folder)
            if stale is not None:
                log.warning(f"titan_ledger: took over the stale lock of {stale.describe()} in "
                            f"{config.dump_folder} (that process is gone)")
            if is_ledger:  # CHANGED from torchtitan: a relaunch says what it changes (the run's own lock held)
                say_relaunch(config)
        if config.comm.mode == "local_tensor":
            logger.info("Local tensor mode enabled - skipping training execution")
            return
        if not dry_run:  # CHANGED from torchtitan: a stable W&B run id before wandb.init
            from titan_ledger.components.ledger import dashboards

            dashboards.prepare(config, job, is_metrics_rank=_rank() == metrics_rank(
                config, world_size_from_env(config)))
        trainer = config.build()
        if is_ledger:  # CHANGED from torchtitan: the tools reuse the recorded launch (segment headers)
            from titan_ledger.components.run.run_folder import Launch

            trainer.ledger.launch = Launch(list(argv), os.getcwd(), sys.executable)
        if dry_run:  # CHANGED from torchtitan: build-only dry run
            log.info(
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
            trained = True
    except Exception:  # CHANGED from torchtitan: TitanLedgerError goes up to main
        if trainer:
            trainer.close()
        if lock is not None:
            run_lock.release(lock)
        if backend.installed() == "cpu":  # gloo has no flight recorder: nothing is ever written there
            drop_empty_traces(config)
        raise
    else:
        trainer.close()
        if lock is not None:  # every file of this run is closed
            run_lock.release(lock)
        if torch.distributed.is_initialized():
            if trained and is_ledger:  # CHANGED from torchtitan: every rank's rows are on disk
                # NCCL warns about guessing the device unless it is named
                ids = [torch.cuda.current_device()] if backend.installed() == "cuda" else None
                torch.distributed.barrier(device_ids=ids)
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")
        drop_empty_traces(config)  # CHANGED from torchtitan: every rank is past the barrier
        if trained and is_ledger and _rank() == 0:  # CHANGED from torchtitan
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
