"""``python -m titan_ledger.launch --nproc N [torchrun options] -- <train flags>``.

Design decision: a config error must reach the user as ONE line and exit 2, but
under plain ``torchrun -m titan_ledger.train`` every rank parses the config, rank 0
prints the line, and torchrun then adds its own multi-line failure summary and
exits 1. So this entry point parses the config once, in this process, before any
rank starts (``titan_ledger.train.load_config`` with the world size the job will
have: ``--nproc`` x ``--nnodes``; with the checks from files, ``train.check_files``:
tokenizer folder, corpus files, the run already in the dump folder and its data
fingerprint), prints ``titan_ledger.launch: error: ...`` and
exits 2 on bad input, and otherwise runs torchrun with the same arguments
(``-m titan_ledger.train``). The ranks parse again (cheap) -- the check is a gate,
not a second source of truth. ``launch/run.sh`` and ``launch/multinode.sh`` use it.
``$TITAN_LEDGER_TORCHRUN`` replaces ``python -m torch.distributed.run`` (as in every
launch of the tools: ``titan_ledger/tools/runs.py``).

Second decision: torchrun is a child, not an ``exec``, so that the launcher has the
last word when a rank dies alone (the OOM killer's SIGKILL, a segfault, an exit):
torchrun's own summary names a rank in its "Root Cause" block, 200 lines below the
other ranks' tracebacks, and says nothing of the run. The launcher passes torchrun's
stderr through line by line, reads the summary (:func:`parse_failures`, :func:`cause_of`), and ends with
three lines (:func:`lost_rank_lines`; a full disk: one line in all, the rest held back by
:class:`HeldOutput`): which rank died of what, the last step the ledger
completed and the newest complete checkpoint, and the command that resumes (the same
one). SIGINT/SIGTERM reach torchrun as before (the terminal's process group; a SIGTERM
to the launcher is passed on), and torchrun dies with the launcher (``PDEATHSIG``).

Examples::

    python -m titan_ledger.launch --nproc 2 -- --job.config_file train_configs/debug_cpu.toml
    python -m titan_ledger.launch --nproc 8 --nnodes 2 --rdzv_backend c10d \\
        --rdzv_endpoint node0:29500 --rdzv_id run42 -- --job.config_file train_configs/llama3_8b.toml
    python -m titan_ledger.launch --nproc 2 --print -- --job.config_file X.toml   # show, do not run
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import warnings
from collections import deque
from dataclasses import dataclass, field

from titan_ledger.errors import EXIT_BAD_INPUT, EXIT_DISK_FULL, ConfigError, TitanLedgerError, fail_line
from titan_ledger.tools.runs import torchrun_prefix

PROG = "titan_ledger.launch"
#: ``--help``'s first screen: the options, then the design note (the module docstring)
USAGE = f"""usage: python -m {PROG} [--nproc N] [--print] [torchrun options] -- <training flags>

Start the training ranks under torchrun once the configuration parses: one line and exit 2 on
bad input, and three lines of its own when a rank dies.

options:
  --nproc N, --nproc_per_node N
                  processes per node (default: the visible GPUs, else 2); the world size checked
                  is N x --nnodes
  --print, --dry-run
                  print the torchrun command and exit (nothing starts)
  -h, --help      this help; `-- --help` prints the trainer's flags
  torchrun options
                  passed on as they are (--nnodes, --rdzv_backend, --rdzv_endpoint, --rdzv_id, ...)
  -- <training flags>
                  titan_ledger.train's flags, at least --job.config_file X.toml

environment: $TITAN_LEDGER_TORCHRUN replaces `python -m torch.distributed.run`."""


def split_argv(argv: list[str]) -> tuple[int | None, bool, list[str], list[str]]:
    """-> (nproc, print_only, torchrun options, train flags)."""
    own = argv[:argv.index("--")] if "--" in argv else argv
    if any(a in ("-h", "--help") for a in own):  # this tool's help (`-- --help`: the trainer's flags)
        raise SystemExit(print(USAGE + "\n\n" + __doc__) or 0)
    if "--" not in argv:
        raise ConfigError("command line: put the training flags after `--`, e.g. "
                          f"python -m {PROG} --nproc 2 -- --job.config_file train_configs/debug_cpu.toml")
    i = argv.index("--")
    own, train_args = argv[:i], argv[i + 1:]
    nproc, print_only, rest, k = None, False, [], 0
    while k < len(own):
        a = own[k]
        name, eq, val = a.partition("=")
        if name in ("--nproc", "--nproc_per_node", "--nproc-per-node"):
            if not eq:
                if k + 1 >= len(own):
                    raise ConfigError(f"command line: {name} needs a value (processes per node)")
                val, k = own[k + 1], k + 1
            try:
                nproc = int(val)
            except ValueError:
                raise ConfigError(f"command line: {name} {val!r}: expected a number of processes "
                                  f"per node") from None
            if nproc < 1:
                raise ConfigError(f"command line: {name} {nproc}: give at least 1 process")
        elif a in ("--print", "--dry-run"):
            print_only = True
        else:
            rest.append(a)
        k += 1
    if not train_args:
        raise ConfigError("command line: no training flags after `--`; give at least "
                          "--job.config_file X.toml")
    return nproc, print_only, rest, train_args


def nnodes_of(torchrun_opts: list[str]) -> int:
    """The node count torchrun will wait for (the minimum of an elastic ``MIN:MAX``)."""
    val = None
    for k, a in enumerate(torchrun_opts):
        name, eq, v = a.partition("=")
        if name == "--nnodes":
            val = v if eq else (torchrun_opts[k + 1] if k + 1 < len(torchrun_opts) else None)
    if val is None:
        return 1
    try:
        return int(val.split(":")[0])
    except ValueError:
        raise ConfigError(f"command line: --nnodes {val!r}: expected N or MIN:MAX") from None


def validate(train_args: list[str], world_size: int):
    """Parse the training config as the ranks will, for ``world_size`` ranks, in this
    process (no process group). Returns the config; raises TitanLedgerError."""
    from titan_ledger import train

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    try:
        train.quiet_imports()
        config, _ = train.load_config(list(train_args), files=False)
        check_dump_folder(config)
        # the checks the ranks repeat from files (train.check_files): the tokenizer folder,
        # the corpus files, the run already in the dump folder (seq_len, global batch, data
        # fingerprint), after the lock: a live run there is named as such
        train.check_files(config, world_size)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return config


def check_dump_folder(config) -> None:
    """Another live run in the dump folder (``run_lock``): refused before any rank starts
    (the ranks cannot check it: rank 0 takes the lock while the others still parse)."""
    if config.comm.mode == "fake_backend":
        return
    from titan_ledger.components.run import run_lock

    run_lock.check(config.dump_folder)


def warn_disk(config, world: int) -> None:
    """The dump folder's free space against what the run will write (a warning, never a
    refusal: ``components/run/disk_space.py``)."""
    if config.comm.mode == "fake_backend":
        return
    from titan_ledger.components.run.disk_space import warn_before_launch

    try:
        line = warn_before_launch(config, world)
    except (OSError, RuntimeError, ValueError, AttributeError) as e:  # an estimate, never a launch failure
        line = f"titan_ledger: note: the disk-space estimate failed ({type(e).__name__}: {e})"
    if line is not None:
        print(line.replace("titan_ledger: ", f"{PROG}: ", 1), file=sys.stderr, flush=True)


def default_nproc() -> int:
    try:
        import torch

        return torch.cuda.device_count() or 2
    except Exception:
        return 2


def torchrun_argv(nproc: int, torchrun_opts: list[str], train_args: list[str]) -> list[str]:
    opts = list(torchrun_opts)
    if not any(o.partition("=")[0] in ("--standalone", "--rdzv_endpoint", "--rdzv-endpoint",
                                        "--master_addr", "--master-addr") for o in opts):
        opts = ["--standalone", *opts]  # one node, a free port
    return [*torchrun_prefix(), "--nproc_per_node", str(nproc), *opts,  # $TITAN_LEDGER_TORCHRUN or torchrun
            "-m", "titan_ledger.train", *train_args]


#: what a rank's own error says when it failed because a peer vanished (it is a bystander):
#: gloo's broken socket, NCCL's remote exit
_LOST_PEER = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|"
                        r"remote process exited")


@dataclass
class RankFailure:
    """One rank's failure in torchrun's summary; ``error``: its traceback there (its error
    file's; for a signal, torchrun's "Signal 9 (SIGKILL) received by PID ...")."""

    rank: int
    local_rank: int
    exitcode: int
    host: str = ""
    error: str = field(default="", compare=False, repr=False)

    @property
    def lost_peer(self) -> str | None:
        """An exit on a vanished peer (its own error says so): the words, else None."""
        m = _LOST_PEER.search(self.error) if self.exitcode > 0 else None
        return m.group(0) if m else None

    def what(self) -> str:
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            why = " (what the OOM killer sends)" if name == "SIGKILL" else ""
            return f"was killed by {name} (signal {-self.exitcode}){why}"
        if self.lost_peer:
            return (f"exited with code {self.exitcode} on a lost peer ({self.lost_peer}): another rank died "
                    f"first, and torchrun's summary does not name it (another node's?)")
        return f"exited with code {self.exitcode}"


_BLOCK = re.compile(r"^\[\d+\]:\s*$")
_FIELD = re.compile(r"^\s*(rank|exitcode|host|traceback)\s*:\s*(.*?)\s*$")


def parse_failures(lines: list[str]) -> list[RankFailure]:
    """Every rank failure in torchrun's failure summary (``ChildFailedError``: its
    "Failures:" and "Root Cause" blocks, the root cause first; the last summary in the
    lines), each with its traceback there (``RankFailure.error``), [] when the lines hold
    none (torchrun itself failed, or was killed)."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Failures:")] or \
        [i for i, line in enumerate(lines) if line.startswith("Root Cause (first observed failure):")]
    if not starts:
        return []
    blocks: list[dict[str, str]] = []
    root: list[dict[str, str]] = []
    into, in_traceback = blocks, False
    for line in lines[starts[-1]:]:
        if line.startswith("Root Cause"):
            into, in_traceback = root, False
        elif _BLOCK.match(line):
            into.append({})
            in_traceback = False
        elif line.startswith(("-----", "=====")):  # a section's end (a traceback's too)
            in_traceback = False
        elif into and in_traceback:  # the traceback's next line (torchrun indents them)
            into[-1]["traceback"] += "\n" + line.strip()
        elif into and (m := _FIELD.match(line)) and m.group(1) not in into[-1]:
            into[-1][m.group(1)] = m.group(2)
            in_traceback = m.group(1) == "traceback"
        if line.startswith("=====") and into is root:
            break
    out = []
    for fields in root + blocks:
        rank = re.match(r"(\d+)(?: \(local_rank: (\d+)\))?", fields.get("rank", ""))
        code = re.match(r"(-?\d+)", fields.get("exitcode", ""))
        if rank and code:
            local = int(rank.group(2)) if rank.group(2) is not None else int(rank.group(1))
            f = RankFailure(int(rank.group(1)), local, int(code.group(1)), fields.get("host", ""),
                            fields.get("traceback", "").strip())
            if f not in out:
                out.append(f)
    return out


def cause_of(failures: list[RankFailure]) -> RankFailure | None:
    """The rank that died first, whatever the order of ``failures``. torchrun's "first
    observed failure" is not always it: it orders by whole seconds, a SIGKILLed rank's
    time being when torchrun noticed it (it leaves no error file) and its peer's the
    moment its collective broke (exit 1, "Connection reset by peer"), often a second
    earlier. So the ranks' own evidence decides: leave out the ranks torchrun itself
    stopped (SIGTERM, its stop signal); then a rank killed by a signal (SIGKILL, SIGSEGV,
    SIGABRT) is the cause; else a rank that exited on its own error; a rank whose error
    says its peer vanished (``RankFailure.lost_peer``) last; among equals torchrun's
    order (its root cause first)."""
    if not failures:
        return None
    ours = [f for f in failures if f.exitcode != -signal.SIGTERM] or failures
    return min(ours, key=lambda f: 0 if f.exitcode < 0 else 2 if f.lost_peer else 1)  # min: the first of equals


def run_state(config) -> tuple[int | None, int | None]:
    """(the last step the ledger completed, the newest complete checkpoint's step), None
    for what is not there (the run died before its first row; checkpoints off or none)."""
    from titan_ledger.errors import LedgerError
    from titan_ledger.format.reader import RunLedger, checkpoints

    last = None
    try:
        with warnings.catch_warnings():  # a torn last line (the dead rank's) is read past
            warnings.simplefilter("ignore")
            last = RunLedger(config.dump_folder, config.ledger.folder).last_signal_step()
    except (LedgerError, OSError):
        pass
    ckpt = None
    if config.checkpoint.enable:
        steps = checkpoints(config.dump_folder, config.checkpoint.folder)
        ckpt = steps[-1] if steps else None
    return last, ckpt


def lost_rank_lines(failure: RankFailure | None, code: int, last_step: int | None, checkpoint: int | None,
                    checkpoints_on: bool, resume: str, others: int = 0, disk_full: str | None = None) -> list[str]:
    """The launcher's last lines after a failed job (pure: unit-tested). A rank that
    stopped on bad input (exit 2) already said why in its one line: nothing to resume. A
    full disk (exit 3) is ONE line in all: the rank's own line (``disk_full``, held back by
    :class:`HeldOutput`: the path, its filesystem, the free space) with the run's state
    and the command that resumes."""
    if failure is not None and failure.exitcode == EXIT_BAD_INPUT:
        return [f"{PROG}: rank {failure.rank} stopped on bad input (its error line is above); fix it and "
                f"launch again"]
    done = f"the ledger's last complete step: {last_step}" if last_step is not None else \
        "the ledger completed no step"
    if checkpoint is not None:
        state = f"{done}; newest complete checkpoint: step {checkpoint}"
        again = f"resume (the same command; it loads checkpoint step-{checkpoint}): {resume}"
    else:
        state = f"{done}; {'no complete checkpoint yet' if checkpoints_on else 'checkpoints are off (--checkpoint.enable)'}"
        again = f"train again (the same command; no checkpoint to resume from, it starts at step 1): {resume}"
    if failure is not None and failure.exitcode == EXIT_DISK_FULL:
        what = disk_full.split(";")[0] if disk_full else "disk full (the path was not reported)"
        return [f"{PROG}: the run stopped, {what}; {state}; free space there or move "
                f"--job.dump_folder, then {again}"]
    if failure is None:
        head = f"torchrun exited with code {code} and named no failed rank (its output is above)"
    else:
        on = f" on {failure.host}" if failure.host else ""
        head = f"rank {failure.rank} (local rank {failure.local_rank}{on}) {failure.what()}; torchrun " \
               f"stopped the other ranks"
        if others:
            head += f"; {others} other rank(s) failed after it (their tracebacks above follow from it)"
    return [f"{PROG}: {head}", f"{PROG}: {state}", f"{PROG}: {again}"]


_RANK_ERROR = "titan_ledger.train: error: "
_DISK_FULL = _RANK_ERROR + "disk full: "


class HeldOutput:
    """What of torchrun's stderr the launcher passes on now, and what it holds back (pure:
    unit-tested). A rank's own error line (bad input, a full disk) already says everything;
    what follows it -- the other ranks' broken collectives, torchrun's "closing signal"
    lines and its 200-line ``ChildFailedError`` summary -- is held, and dropped at the end
    when the cause is that rank's exit 2 or 3 (:meth:`finish`), printed otherwise. A full
    disk's own lines are held too: every rank that met it prints one, and the launcher
    says it once (:func:`lost_rank_lines`)."""

    def __init__(self) -> None:
        self.holding = False
        self.held: list[str] = []
        self.disk_full: str | None = None  # the first rank's line, less its prefix
        self._said: set[str] = set()

    def feed(self, line: str) -> str | None:
        """The line to print now, or None (held)."""
        text = line.rstrip("\n")
        if text.startswith(_DISK_FULL):
            self.holding = True
            if self.disk_full is None:
                self.disk_full = text[len(_RANK_ERROR):]
            return None
        if text.startswith(_RANK_ERROR) and not self.holding:
            self.holding = True
            self._said.add(text)
            return line
        if self.holding:
            if text not in self._said:  # the same bad-input line from every rank: once
                self.held.append(line)
            return None
        return line

    def finish(self, exitcode: int | None) -> list[str]:
        """The held lines to print after all: none when the cause said it in its own line."""
        if exitcode in (EXIT_BAD_INPUT, EXIT_DISK_FULL):
            return []
        return self.held + ([_RANK_ERROR + self.disk_full + "\n"] if self.disk_full else [])


def without_rehearsal_death(argv: list[str]) -> list[str]:
    """``argv`` less ``--ledger.rehearsal.die X`` (a rehearsed death is not part of the run:
    the printed resume command must not die again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--ledger.rehearsal.die":
            skip = True
        elif not a.startswith("--ledger.rehearsal.die="):
            out.append(a)
    return out


def _pdeathsig() -> None:
    """In the torchrun child: SIGTERM it when the launcher dies (it stops its ranks)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(cmd: list[str]) -> tuple[int, list[str], HeldOutput]:
    """Run torchrun; its stderr passes through line by line, less what :class:`HeldOutput`
    holds. Returns (exit code, the last stderr lines, the held output): 20,000 lines, room
    for torchrun's whole failure summary (a traceback per failed rank: 8 ranks' fill 400
    lines, and a tail that cut its "Failures:" block would lose the killed rank)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, preexec_fn=_pdeathsig)
    prev = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    tail: deque[str] = deque(maxlen=20_000)
    held = HeldOutput()
    try:
        for raw in proc.stderr:
            line = raw.decode(errors="replace")
            if (now := held.feed(line)) is not None:
                sys.stderr.write(now)
                sys.stderr.flush()
            tail.append(line.rstrip("\n"))
        code = proc.wait()
    except KeyboardInterrupt:  # the terminal's SIGINT reached torchrun too: let it finish
        code = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, prev)
    return code, list(tail), held


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        nproc, print_only, opts, train_args = split_argv(argv)
        nproc = nproc or default_nproc()
        config = validate(train_args, nproc * nnodes_of(opts))
    except TitanLedgerError as e:
        print(fail_line(PROG, e), file=sys.stderr, flush=True)
        return e.exit_code
    except SystemExit as e:  # --help (tyro prints it)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT if e.code else 0
    cmd = torchrun_argv(nproc, opts, train_args)
    if print_only:
        print(shlex.join(cmd))
        return 0
    warn_disk(config, nproc * nnodes_of(opts))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; no torchrun banner
    sys.stdout.flush()
    sys.stderr.flush()
    code, tail, held = supervise(cmd)
    if code == 0:
        sys.stderr.writelines(held.finish(None))
    else:
        from titan_ledger.errors import python_command

        failures = parse_failures(tail)
        failure = cause_of(failures)
        last, ckpt = run_state(config)
        resume = shlex.join([python_command(), "-m", PROG, *without_rehearsal_death(argv)])
        sys.stderr.writelines(held.finish(failure.exitcode if failure is not None else None))
        for line in lost_rank_lines(failure, code, last, ckpt, config.checkpoint.enable, resume,
                                    others=sum(f != failure and f.exitcode != -signal.SIGTERM for f in failures),
                                    disk_full=held.disk_full):
            print(line, file=sys.stderr, flush=True)
        if failure is not None and failure.exitcode in (EXIT_BAD_INPUT, EXIT_DISK_FULL):
            return failure.exitcode  # the rank's own code (torchrun says 1)
    return code


if __name__ == "__main__":
    sys.exit(main())
