"""``python -m titan_ledger.launch --nproc N [torchrun options] -- <train flags>``.

Design decision: a config error must reach the user as ONE line and exit 2, but
under plain ``torchrun -m titan_ledger.train`` every rank parses the config, rank 0
prints the line, and torchrun then adds its own multi-line failure summary and
exits 1. So this entry point parses the config once, in this process, before any
rank starts (``titan_ledger.train.load_config`` with the world size the job will
have: ``--nproc`` x ``--nnodes``; with the checks from files, ``train.check_files``:
tokenizer folder, corpus files, the run already in the dump folder and its data
fingerprint), prints ``titan_ledger.launch: error: ...`` and
exits 2 on bad input, and otherwise ``exec``s torchrun with the same arguments
(``-m titan_ledger.train``). The ranks parse again (cheap) -- the check is a gate,
not a second source of truth. ``launch/run.sh`` and ``launch/multinode.sh`` use it.
``$TITAN_LEDGER_TORCHRUN`` replaces ``python -m torch.distributed.run`` (as in every
launch of the tools: ``titan_ledger/tools/runs.py``).

Examples::

    python -m titan_ledger.launch --nproc 2 -- --job.config_file train_configs/debug_cpu.toml
    python -m titan_ledger.launch --nproc 8 --nnodes 2 --rdzv_backend c10d \\
        --rdzv_endpoint node0:29500 --rdzv_id run42 -- --job.config_file train_configs/llama3_8b.toml
    python -m titan_ledger.launch --nproc 2 --print -- --job.config_file X.toml   # show, do not run
"""

from __future__ import annotations

import os
import shlex
import sys

from titan_ledger.errors import EXIT_BAD_INPUT, ConfigError, TitanLedgerError, fail_line
from titan_ledger.tools.runs import torchrun_prefix

PROG = "titan_ledger.launch"


def split_argv(argv: list[str]) -> tuple[int | None, bool, list[str], list[str]]:
    """-> (nproc, print_only, torchrun options, train flags)."""
    own = argv[:argv.index("--")] if "--" in argv else argv
    if any(a in ("-h", "--help") for a in own):  # this tool's help (`-- --help`: the trainer's flags)
        raise SystemExit(print(__doc__) or 0)
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
    from titan_ledger.components import run_lock

    run_lock.check(config.dump_folder)


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        nproc, print_only, opts, train_args = split_argv(argv)
        nproc = nproc or default_nproc()
        validate(train_args, nproc * nnodes_of(opts))
    except TitanLedgerError as e:
        print(fail_line(PROG, e), file=sys.stderr, flush=True)
        return e.exit_code
    except SystemExit as e:  # --help (tyro prints it)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT if e.code else 0
    cmd = torchrun_argv(nproc, opts, train_args)
    if print_only:
        print(shlex.join(cmd))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; no torchrun banner
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
