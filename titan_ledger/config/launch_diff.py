"""Two launches of one run, setting by setting: what a relaunch changed, and what it will do.

Design decision: a launch is compared with another as two *parsed* configs, never as two
command lines (a TOML file, an overlay and a flag can set the same value; the parse
through torchtitan's ``ConfigManager`` is the one judge of what a launch means). The
caller parses both through its own parse path -- ``train.parse_flags`` for a relaunch,
``tools/launch.validate`` for a tool's flags -- and this module, pure and without torch,
says what differs. It is the one owner of the facts both the entry point (a relaunch says
what it changed) and the tools (``replay``'s flags checked against the recorded launch)
need: which settings a tool or a relaunch changes on purpose (:data:`VOLATILE`, each with
why), a config as comparable values (:func:`settings`), the diff, and the relaunch's
lines (one line each: what differs, what differs as expected, the checkpoints a rewind
replaces, a launch that had nothing left to train).
"""

from __future__ import annotations

import json
import os
from typing import Any

from titan_ledger.format.spellings import renamed_argv

#: settings a tool or a relaunch changes on purpose, and why: named as expected, never a mismatch
VOLATILE: dict[str, str] = {
    "dump_folder": "the launch's own folder",
    "checkpoint.load_step": "a rollback's checkpoint",
    "checkpoint.interval": "how often the launch saves",
    "checkpoint.enable": "whether the launch saves",
    "ledger.rehearsal.rerun": "a rerun's variant",
    "ledger.skip.steps": "a rollback's skip window",
    "ledger.filter.quarantine": "a quarantine",
    "ledger.response.action": "the response's action",
}

#: the flags that name a file the launch reads before parsing (a recorded launch's are
#: relative to its working directory)
_FILE_FLAGS = ("--job.config_file", "--job.config-file", "--job.overlay")
_DUMP_FLAGS = ("--job.dump_folder", "--job.dump-folder", "--dump_folder")

#: at most this many settings named on a line (the rest counted)
SHOWN = 8


def strip_recorded(argv: list[str]) -> list[str]:
    """A recorded launch's flags minus its dump folder (the caller sets its own), in today's
    spelling (``format.spellings``: a run launched before a rename is compared with, rerun
    and relaunched without retyping its flags)."""
    out, i = [], 0
    while i < len(argv):
        key, eq, _ = str(argv[i]).partition("=")
        if key in _DUMP_FLAGS:
            i += 1 if eq else 2
            continue
        out.append(str(argv[i]))
        i += 1
    return renamed_argv(out)


def rooted(argv: list[str], cwd: str | os.PathLike | None) -> list[str]:
    """``argv`` with the files it names (config file, overlays) relative to ``cwd``, the
    recorded launch's working directory: a relaunch from another directory reads the files
    the run was launched with. Other values stay as given (compared as given)."""
    if not cwd:
        return list(argv)
    out, i = [], 0
    while i < len(argv):
        a = str(argv[i])
        key, eq, val = a.partition("=")
        if key in _FILE_FLAGS and eq:
            out.append(f"{key}={_under(val, cwd)}")
        elif a in _FILE_FLAGS and i + 1 < len(argv):
            out += [a, _under(str(argv[i + 1]), cwd)]
            i += 1
        else:
            out.append(a)
        i += 1
    return out


def _under(path: str, cwd) -> str:
    return path if os.path.isabs(path) else os.path.join(str(cwd), path)


def settings(config) -> dict[str, Any]:
    """The config as comparable values: ``to_dict()`` as the ledger's config digest
    serializes it (``run_folder.config_json``: no object addresses), read back."""
    from titan_ledger.components.run.run_folder import config_json

    return json.loads(config_json(config))


def flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (a setting's flag name without ``--``)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out


def is_volatile(key: str) -> bool:
    return any(key == v or key.startswith(v + ".") for v in VOLATILE)


def _all_diffs(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    fa, fb = flat(a), flat(b)
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def config_diff(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """``(key, a's value, b's value)`` of every setting that differs, volatile ones left out."""
    return [d for d in _all_diffs(a, b) if not is_volatile(d[0])]


def expected_diff(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """The volatile settings that differ (:data:`VOLATILE`): what a rollback, a quarantine
    or a tool changes on purpose."""
    return [d for d in _all_diffs(a, b) if is_volatile(d[0]) and d[0] != "dump_folder"]


def value(v: Any, width: int = 160) -> str:
    """A setting's value as it reads on a command line (a list space-separated, an empty
    one or None as ``none``), cut to ``width`` characters."""
    if isinstance(v, (list, tuple)):
        s = " ".join(map(str, v)) if v else "none"
    elif v is None or v == "":
        s = "none"
    elif isinstance(v, bool):
        s = str(v).lower()
    else:
        s = str(v)
    return s if len(s) <= width else s[:width - 3] + "..."


def _why(key: str) -> str:
    return next(why for v, why in VOLATILE.items() if key == v or key.startswith(v + "."))


def _listed(items: list[str]) -> str:
    more = f", and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def relaunch_lines(now: dict, then: dict, *, seq: Any, log: str | os.PathLike, world_now: int | None = None,
                   world_then: int | None = None) -> list[tuple[str, str]]:
    """What a relaunch changed against the run's recorded launch (segment ``seq`` of the
    launch log ``log``), as ``(level, line)``: one line for the settings that differ
    (``warning``), one for the expected differences (``info``, each with why); the same
    settings: one ``info`` line saying so. ``now``/``then``: :func:`settings` of each."""
    where = f"the run's recorded launch (segment {seq} of {log})"
    differ = [f"--{k} {value(a)} (was {value(b)})" for k, a, b in config_diff(now, then)]
    if world_now is not None and world_then is not None and world_now != world_then:
        differ.insert(0, f"world size {world_now} (was {world_then})")
    expected = [f"--{k} {value(a)} (was {value(b)}: {_why(k)})" for k, a, b in expected_diff(now, then)]
    out = []
    if differ:
        n = len(differ)
        out.append(("warning", f"titan_ledger: relaunch: {n} setting{'s' if n != 1 else ''} differ"
                               f"{'s' if n == 1 else ''} from {where}: {_listed(differ)}"))
    if expected:
        out.append(("info", f"titan_ledger: relaunch: expected differences from {where if not differ else 'it'}: "
                            f"{_listed(expected)}"))
    if not out:
        out.append(("info", f"titan_ledger: relaunch: the settings of {where}"))
    return out


def saves(start: int, steps: int, interval: int) -> list[int]:
    """The steps after ``start`` (up to ``steps``) at which torchtitan's checkpointer saves:
    every ``interval``-th step and the last (torchtitan's ``checkpointer/dcp.py`` ``_should_save``)."""
    return [s for s in range(start + 1, steps + 1) if s == steps or (interval > 0 and s % interval == 0)]


def rewind_line(load_step: int, on_disk: list[int], steps: int, interval: int) -> str | None:
    """The one line for the checkpoints of the old trajectory that a relaunch from
    ``step-{load_step}`` will write again (torch's DCP writer warns once per rank per
    save: "Detected an existing checkpoint ... overwriting"); None when it replaces none."""
    if load_step is None or load_step < 0:
        return None
    replaced = sorted(set(c for c in on_disk if c > load_step) & set(saves(load_step, steps, interval)))
    if not replaced:
        return None
    names = ", ".join(f"step-{s}" for s in replaced)
    one = len(replaced) == 1
    return (f"titan_ledger: this relaunch rewinds to step-{load_step}: checkpoint{'' if one else 's'} {names} of "
            f"the old trajectory will be replaced as the run passes {'it' if one else 'them'}")


def nothing_left_line(step: int, steps: int) -> str:
    """A launch that resumed at or past its last step and trained nothing (exit 0)."""
    reached = f"step {step} of {steps}" if step == steps else f"step {step}, past --training.steps {steps}"
    return (f"titan_ledger: the run already reached {reached}; nothing trained; to train again with these flags "
            f"use a new --dump_folder, to go on raise --training.steps")
