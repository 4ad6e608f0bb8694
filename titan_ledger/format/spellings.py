"""The flags' spellings over time: one table of renamed flags, read by the refusal, the
TOML front end and every reader of a recorded launch.

Design decision: a renamed flag is refused where a user types it (one line naming the
new spelling: :func:`refuse_renamed`, :func:`renamed_table`), but a launch the ledger
recorded under the old spelling is read in today's (:func:`renamed_argv`): an old run's
fix command and its relaunch comparison work as printed, without retyping what the run
recorded. It lives in the record format's layer because the answers (``format``) build
commands from recorded launches.
"""

from __future__ import annotations

import re

from titan_ledger.errors import ConfigError

#: every field of the old ``[ledger.on_spike]`` and the window-proof fields of the old
#: ``[ledger.snapshots]`` -> its new ``section.field`` (under ``ledger.``). The one owner of
#: the renaming: the refusal, the TOML front end and the reading of recorded launches.
RENAMED: dict[str, str] = {
    "on_spike.act": "response.policy", "on_spike.action": "response.action",
    "on_spike.ladder_horizon": "response.repeat_horizon", "on_spike.defer": "response.defer",
    "on_spike.prove": "proof.scope", "on_spike.prove_notes_rate": "proof.notes_rate",
    "on_spike.prove_notes_burst": "proof.notes_burst", "on_spike.prove_rtol": "proof.rtol",
    "on_spike.prove_noise_factor": "proof.noise_factor", "on_spike.prove_bisect": "proof.bisect",
    "on_spike.prove_timeout": "proof.timeout",
    "on_spike.adam_check": "adam_check.ratio", "on_spike.adam_horizon": "adam_check.horizon",
    "on_spike.quarantine_max": "conviction.max_share", "on_spike.quarantine_fragile": "conviction.fragile",
    "on_spike.unstable_flags": "conviction.unstable_flags", "on_spike.lookback": "conviction.lookback",
    "on_spike.rollback_back": "rollback.back", "on_spike.rollback_skip": "rollback.skip",
    "on_spike.max_rollbacks": "rollback.limit",
    "on_spike.breaker_actions": "breaker.actions", "on_spike.breaker_window": "breaker.window",
    **{f"snapshots.{k}": f"window.{k}" for k in ("causes", "lr_factor", "beta2", "eps", "eps_fix", "logit_cap",
                                                 "zloss", "cost_steps", "control", "max_proofs",
                                                 "max_stall_proofs")},
}


def _renamed_flag(arg: str) -> tuple[str, str] | None:
    """``--ledger.on_spike.prove_bisect`` / ``--ledger.on_spike.no-prove-bisect=x`` -> (the old
    flag as written, the new one), None when ``arg`` is no old spelling."""
    name, eq, value = arg.partition("=")
    if not name.startswith("--ledger."):
        return None
    section, dot, key = name[len("--ledger."):].replace("-", "_").partition(".")
    if not dot:
        return None
    neg = key.startswith("no_") and f"{section}.{key[3:]}" in RENAMED
    new = RENAMED.get(f"{section}.{key[3:]}" if neg else f"{section}.{key}")
    if new is None:
        return None
    sec, _, field_ = new.partition(".")
    return name, f"--ledger.{sec}.{'no_' if neg else ''}{field_}" + eq + value


def refuse_renamed(args: list[str]) -> None:
    """Refuse a launch that spells a renamed flag the old way: one line naming the new one."""
    for a in args:
        hit = _renamed_flag(str(a))
        if hit is not None:
            raise ConfigError(f"{hit[0]} was renamed: use {hit[1].partition('=')[0]} (the response's sections, "
                              f"docs/toml.md)")


def renamed_table(section: str, key: str) -> str | None:
    """``[ledger.proof] scope`` -> ``[ledger.proof] scope`` (None: not renamed)."""
    new = RENAMED.get(f"{section}.{key}")
    if new is None:
        return None
    sec, _, field_ = new.partition(".")
    return f"[ledger.{sec}] {field_}"


def renamed_argv(args: list[str] | tuple[str, ...]) -> list[str]:
    """A recorded launch's flags in today's spelling (an old run's fix command works as printed)."""
    out = []
    for a in args:
        hit = _renamed_flag(str(a))
        out.append(hit[1] if hit is not None else str(a))
    return out


_FLAG = re.compile(r"--ledger\.(on_spike|snapshots)\.(no[_-])?([A-Za-z_-]+)")


def renamed_text(text: str) -> str:
    """Every old flag spelled in ``text`` in today's spelling (a recorded launch's argv
    inside a ledger line; ``bench/ledger_equal.py --spellings`` compares dumps across a
    rename so)."""
    def sub(m: re.Match) -> str:
        hit = _renamed_flag(m.group(0))
        return hit[1] if hit is not None else m.group(0)

    return _FLAG.sub(sub, text)
