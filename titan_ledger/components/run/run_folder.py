"""The run folder: which run a dump folder holds, the run's identity, and its launch.

Design decision: a dump folder belongs to one run configuration, and every segment
(launch or in-process rewind) of that run is numbered once, by rank 0, from the
launch log (``segments.jsonl``, :func:`titan_ledger.format.records.next_seq`) and
agreed with every rank in one broadcast. The launch (the flags and working directory
the entry point received) is a value handed to the ledger by ``train.run`` -- not a
process global -- and goes into every segment header, so the tools (``replay rerun``,
``replay resume``, ``diagnose --rerun``) can reuse the run's own launch.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan_ledger.errors import ConfigError, TitanLedgerError
from titan_ledger.format import records
from titan_ledger.format.reader import latest_data_header


@dataclass(frozen=True)
class Launch:
    """The launch as the entry point received it: its training flags, working directory and
    interpreter (the tools' printed commands use the run's own: a venv's python has torch)."""

    argv: list[str] = field(default_factory=list)
    cwd: str = ""
    python: str = ""

    def header(self) -> dict[str, Any]:
        """The segment-header keys (empty when the trainer was built without ``train.run``)."""
        if not self.cwd:
            return {}
        return {"argv": [str(a) for a in self.argv], "cwd": str(self.cwd), **({"python": self.python} if self.python
                                                                               else {})}


@dataclass(frozen=True)
class RunIdentity:
    """What every rank agrees on at setup: rank 0's run id and the next segment number."""

    run_id: str
    next_seq: int


def agree_identity(folder: Path, is_rank0: bool, claim_error: str | None) -> RunIdentity:
    """Rank 0's run id and next ``seq`` (and its claim refusal, raised on every rank)."""
    agreed = [uuid.uuid4().hex[:12], records.next_seq(folder) if is_rank0 else 0, claim_error]
    if dist.is_initialized():
        dist.broadcast_object_list(agreed, src=0)
    if agreed[2] is not None:  # every rank stops with rank 0's line
        raise ConfigError(agreed[2])
    return RunIdentity(agreed[0], int(agreed[1]))


#: the data-ledger header keys that make a run's data layout (``claim_dump_folder``)
LAYOUT_KEYS = {"seq_len": "--training.seq_len",
               "global_batch": "--training.local_batch_size x DP size x gradient accumulation",
               "fingerprint": "the data fingerprint: source, tokenizer, seq_len, seed"}


def claim_dump_folder(dump_folder, ledger_folder: str, layout: dict[str, Any], *, new_run: bool = False,
                      allow_data_change: bool = False, checkpoint_folder: str = "checkpoint",
                      checkpoint_enabled: bool = True, read_only: bool = False) -> list[str]:
    """A dump folder belongs to one run configuration (every rank before the process
    group, ``read_only``; rank 0 again at setup, where ``new_run`` moves an old run aside).

    Reads the run already in ``dump_folder`` through :func:`latest_data_header` (the latest
    data-ledger header, O(1) in the run's length) and compares its layout with ``layout`` (:data:`LAYOUT_KEYS`).
    A value of ``layout`` may be a function returning it (or None: unknown, not
    compared), called only when there is a recorded value to compare it with and the
    comparison can decide: the data fingerprint costs a tokenizer and the corpus index,
    a fresh folder pays nothing. Same layout: a resume, nothing to do. Another layout:
    ``ConfigError`` naming the folder, the key and the fix -- or, with ``new_run``, the
    ledger and checkpoint folders are renamed ``<name>.old-<n>`` (returned) so runs are
    never mixed; ``read_only`` (a check before the ranks start) renames nothing and
    returns ``[]``. ``allow_data_change`` accepts the change (a deliberate resume on
    other data). A folder without a readable data ledger has no layout to compare.
    When the launch will resume from a complete checkpoint, a changed seq_len or
    fingerprint is left to the checkpoint load, which refuses it with its own line
    naming ``--ledger.allow_data_change`` (``LedgerDataLoader.load_state_dict``).
    """
    dump = Path(dump_folder)
    folder = dump / ledger_folder
    if not folder.is_dir() or allow_data_change or (new_run and read_only):
        return []
    try:  # the newest header only: O(1) in the run's length (a relaunch of a 10^5-step run)
        old = latest_data_header(folder)
    except TitanLedgerError:
        return []
    if old is None:
        return []
    resuming = None  # the launch will load a complete checkpoint (asked once, if needed)
    diffs = []
    for k in LAYOUT_KEYS:
        if layout.get(k) is None or old.get(k) is None:
            continue
        if k in ("seq_len", "fingerprint") and not new_run:
            if resuming is None:
                from titan_ledger.format.reader import checkpoints

                resuming = bool(checkpoint_enabled and checkpoints(dump, checkpoint_folder))
            if resuming:
                continue  # a resume: the checkpoint's data state decides
        now = layout[k]() if callable(layout[k]) else layout[k]
        if now is not None and now != old[k]:
            diffs.append((k, old[k], now))
            break  # the first difference is the one named
    if not diffs:
        return []
    key, was, now = diffs[0]
    if not new_run:
        raise ConfigError(
            f"{dump}: holds a run with {key} {was!r}, this run has {now!r} ({LAYOUT_KEYS[key]}); a "
            f"dump folder belongs to one run: use another --dump_folder, or pass --ledger.new_run "
            f"to move the old {ledger_folder}/ and {checkpoint_folder}/ aside ({ledger_folder}.old-N) "
            f"and start a new run there")
    moved = [p for p in (folder, dump / checkpoint_folder) if p.exists()]
    n = 1
    while any(p.with_name(f"{p.name}.old-{n}").exists() for p in moved):
        n += 1
    for p in moved:
        p.rename(p.with_name(f"{p.name}.old-{n}"))
    return [str(p.with_name(f"{p.name}.old-{n}")) for p in moved]


def config_json(config) -> str:
    """The config as JSON, stable across processes: keys sorted, no object addresses (a
    function in the model spec reprs with one). The digest hashes it; a relaunch and the
    tools compare launches by it (``config/launch_diff.settings``)."""
    blob = json.dumps(config.to_dict(), sort_keys=True, default=repr)
    return re.sub(r" at 0x[0-9a-f]+", "", blob)


def config_digest(config) -> str:
    """SHA-256 of the config, stable across processes (no object addresses)."""
    return hashlib.sha256(config_json(config).encode()).hexdigest()[:16]
