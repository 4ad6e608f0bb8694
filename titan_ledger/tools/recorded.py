"""The launch a run's ledger records: its training flags and world size, for the tools
that train again (``replay rerun``, ``replay resume``, ``diagnose --rerun``).

Design decision: the launch log (``segments.jsonl``, one row per launch or rewind)
is the record. Every row holds the world size and the config digest; a row with
``argv`` (the launch's training flags) lets a tool reuse the launch when the user
gives no flags, and check flags given anyway against it: both are parsed as the
ranks would parse them (:func:`titan_ledger.tools.launch.validate`) and the first
setting that differs is named, in one line. The recorded ``config_digest`` is taken
by the trainer after its setup has filled the model spec (sharding configs), so it
cannot be recomputed from flags; until the ledger records ``argv`` the flags given are
checked only by the existing layout checks (seq_len, global batch, data fingerprint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from titan_ledger.config.launch_diff import config_diff, settings, strip_recorded
from titan_ledger.errors import ConfigError, LedgerCorrupt, LedgerError, TitanLedgerError
from titan_ledger.format import records

DEFAULT_NPROC = 2


def recorded_launches(dump, ledger_folder: str = records.LEDGER_FOLDER) -> list[dict[str, Any]]:
    """Every launch (and rewind) the run's launch log records, oldest first; [] when the
    folder holds no ledger (a fresh ``replay resume`` folder)."""
    from titan_ledger.format.reader import RunLedger

    try:
        led = RunLedger(dump, ledger_folder)
        rows = led.launches()
        if not rows:  # ledgers from before the launch log: the signals header
            segs = led.signals_index.segments  # headers only, through the offset index
            rows = [{**s.header.as_dict(), "seq": s.header.seq} for s in segs]
    except LedgerCorrupt:
        raise
    except LedgerError:
        return []
    return rows


def launch_args(dump, given: list[str], nproc: int | None, *, ledger_folder: str = records.LEDGER_FOLDER,
                what: str = "the rerun") -> tuple[list[str], int]:
    """The training flags and process count to train with: the ones given, else the
    launch the ledger records (its ``argv`` and ``world_size``). Flags given anyway are
    checked against the recorded launch (:func:`check_flags`). Raises ``ConfigError``
    (one line) when no flags are given and the ledger records none."""
    rows = recorded_launches(dump, ledger_folder)
    last = rows[-1] if rows else {}
    world = last.get("world_size")
    if nproc is None:
        nproc = int(world) if isinstance(world, int) and world > 0 else DEFAULT_NPROC
    argv = last.get("argv")
    log = Path(dump) / ledger_folder / records.SEGMENTS_FILE
    if not given:
        if not isinstance(argv, list):
            held = (f"{log} records the launch's world size ({world}) and config digest "
                    f"({last.get('config_digest')}), not its flags" if rows else f"{dump} holds no run ledger")
            raise ConfigError(f"{what} needs the original run's training flags after `--` (at least "
                              f"--job.config_file X.toml): {held}")
        return strip_recorded(argv), nproc
    if isinstance(argv, list):
        check_flags(dump, given, [r for r in rows if isinstance(r.get("argv"), list)], nproc, log)
    return given, nproc


def _parsed(args: list[str], dump, nproc: int) -> dict:
    from titan_ledger.tools.launch import validate

    return settings(validate([*args, "--job.dump_folder", str(dump)], nproc))


def check_flags(dump, given: list[str], recorded: list[dict], nproc: int, log: Path) -> None:
    """ConfigError naming the first setting in which ``given`` differs from every
    recorded launch's ``argv`` (compared with the latest)."""
    if not recorded:
        return
    mine = _parsed(given, dump, nproc)
    first = None
    for row in reversed(recorded):
        try:
            theirs = _parsed(strip_recorded(row["argv"]), dump, nproc)
        except TitanLedgerError:
            continue  # a recorded launch this checkout no longer parses: not a reference
        diff = config_diff(mine, theirs)
        if not diff:
            return
        first = first or (row, diff)
    if first is None:
        return
    row, diff = first
    key, now, was = diff[0]
    more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
    def short(v) -> str:
        r = repr(v)
        return r if len(r) <= 60 else r[:57] + "..."

    raise ConfigError(f"the flags after `--` give --{key} {short(now)}, the run's launch (segment {row.get('seq')} "
                      f"of {log}) had {short(was)}{more}: give the run's own flags, or none to reuse the "
                      f"recorded launch")
