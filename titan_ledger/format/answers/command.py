"""A fix as a command: the run's own launch, relaunched with the fix from the checkpoint
before the onset (or from scratch) into a new dump folder.

Design decision: the command is built from what the run recorded (its launch's flags,
working directory, interpreter and world size; the checkpoints on disk), never from what a
user would retype: a fix is proven the way a user applies it, so the printed command is the
relaunch itself. It never names the run's own dump folder, whose checkpoints and ledger are
the evidence, and a recorded old spelling is written in today's (the command runs as printed).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from titan_ledger.format.answers.records import Context, Fix
from titan_ledger.format.spellings import renamed_argv


def start_of(ctx: Context, onset: int | None, resumes: bool) -> tuple[int | None, str]:
    """The checkpoint a fix's relaunch starts from: the last complete one at or before the
    onset; None (scratch) when there is none or the change is a new model."""
    if not resumes or onset is None:
        return None, "scratch" + ("" if resumes else " (the change is a new model)")
    before = [c for c in ctx.checkpoints if 0 < c <= onset]
    if not before:
        return None, f"scratch (no checkpoint at or before the onset, step {onset})"
    return before[-1], f"checkpoint step-{before[-1]}"


def new_dump_folder(dump: str, step: int, variant: str, exists=None) -> str:
    """A dump folder beside the run's for a fix's relaunch, that does not exist yet."""
    exists = exists or (lambda p: Path(p).exists())
    base = f"{str(dump).rstrip('/')}-fix{step}-{variant}"
    path, n = base, 2
    while exists(path):
        path, n = f"{base}-{n}", n + 1
    return path


#: flags of the recorded launch a fix's relaunch sets itself
_OWN_FLAGS = ("--job.dump_folder", "--dump_folder", "--checkpoint.load_step", "--checkpoint.initial_load_path",
              "--checkpoint.initial_load_model_only", "--checkpoint.no_initial_load_model_only")


def _strip(argv: tuple[str, ...]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        key, eq, _ = str(argv[i]).partition("=")
        if key in _OWN_FLAGS:
            takes = key not in ("--checkpoint.initial_load_model_only", "--checkpoint.no_initial_load_model_only")
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            i += 1 if (eq or not takes or (nxt is not None and str(nxt).startswith("--"))) else 2
            continue
        out.append(str(argv[i]))
        i += 1
    return out


def _units(args: list[str]) -> list[tuple[str, list[str]]]:
    """Flags as (flag, its values): ``--x=1`` as ``--x 1``; a value is whatever follows a flag
    up to the next ``--`` word (a list flag takes several; a boolean none)."""
    out: list[tuple[str, list[str]]] = []
    for a in args:
        if a.startswith("--"):
            key, eq, val = a.partition("=")
            out.append((key, [val] if eq else []))
        elif out:
            out[-1][1].append(a)
        else:
            out.append((a, []))
    return out


def _key(flag: str) -> str:
    """One key for a boolean and its negation (``--model.qk_norm`` / ``--model.no_qk_norm``)."""
    head, dot, last = flag[2:].rpartition(".")
    return head + dot + last.removeprefix("no_")


def once(args: list[str]) -> list[str]:
    """Each flag once, where it first stood, with its last value (tyro's rule: the last wins) --
    a printed command a user can read and edit, not the run's flags with the fix's appended."""
    last: dict[str, tuple[str, list[str]]] = {}
    order: list[str] = []
    for flag, vals in _units(args):
        k = _key(flag) if flag.startswith("--") else flag
        if k not in last:
            order.append(k)
        last[k] = (flag, vals)
    return [x for k in order for x in (last[k][0], *last[k][1])]


def fix_command(ctx: Context, flags: tuple[str, ...], start: int | None, new_dump: str) -> str | None:
    """The relaunch of this run with ``flags`` from checkpoint ``start`` (None: from scratch)
    into ``new_dump``, from the run's working directory with its interpreter: its own
    training flags (less its dump folder and checkpoint position), the checkpoint loaded
    whole (model, optimizer, data position, step: ``--checkpoint.initial_load_path`` with
    ``initial_load_model_only`` off) and the fix's flags, each flag once with its last value
    (:func:`once`)."""
    if ctx.argv is None:
        return None
    args = renamed_argv(_strip(ctx.argv))  # an old run recorded old spellings: today's, so it runs as printed
    if start is not None:
        ck = Path(ctx.dump) / ctx.checkpoint_folder / f"step-{start}"
        args += ["--checkpoint.enable", "--checkpoint.initial_load_path", str(ck.absolute() if not ck.is_absolute()
                                                                             else ck),
                 "--checkpoint.no_initial_load_model_only"]
    args += ["--job.dump_folder", new_dump, *flags]
    cmd = [ctx.python or "python", "-m", "titan_ledger.launch", "--nproc", str(ctx.world_size), "--", *once(args)]
    return (f"cd {shlex.quote(ctx.cwd)} && " if ctx.cwd else "") + shlex.join(cmd)


def command_of(step: int, chosen: Fix | None, onset: int | None, ctx: Context,
               exists=None) -> tuple[str | None, str | None, str | None]:
    """(start, command, new dump folder) of the relaunch that applies ``chosen``; a
    quarantine's command writes the convicted documents' file first."""
    if chosen is None or not chosen.flags or not ctx.dump:
        return None, None, None
    ck, start = start_of(ctx, onset, chosen.resumes)
    new_dump = new_dump_folder(ctx.dump, step, chosen.variant, exists)
    command = fix_command(ctx, chosen.flags, ck, new_dump)
    if command and chosen.variant == "quarantine":  # the file the flag names: the convicted documents, written first
        write = shlex.join([ctx.python or "python", "-m", "titan_ledger.diagnose", str(ctx.dump), "--step", str(step),
                            "--write-quarantine", chosen.flags[1]])
        head, sep, launch = command.partition(" && ") if ctx.cwd else ("", "", command)
        command = f"{head}{sep}{write} && {launch}"
    return start, command, new_dump
