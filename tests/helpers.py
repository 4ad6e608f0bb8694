"""Shared helpers for the multi-process and end-to-end tests: real torchrun, real files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "train_configs"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TITAN_LEDGER_DEVICE="cpu",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WANDB_MODE="offline",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
    )
    # the venv's torchrun/python first, as for a user who activated it
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra)
    return env


from titan_ledger.replay import _free_port as free_port  # noqa: E402
from titan_ledger.replay import kill9_tree  # noqa: E402,F401  (re-exported for the tests)


def _torchrun_cmd(args: list[str], nproc: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
        "-m", "titan_ledger.train", *args,
    ]


def torchrun(args: list[str], nproc: int = 2, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N -m titan_ledger.train ARGS`` on localhost."""
    return subprocess.run(_torchrun_cmd(args, nproc), cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def torchrun_popen(args: list[str], nproc: int = 2, **env) -> subprocess.Popen:
    """Start torchrun in its own process group (so a test can SIGKILL every rank)."""
    return subprocess.Popen(_torchrun_cmd(args, nproc), cwd=ROOT, env=child_env(**env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def train_cli(args: list[str], timeout: int = 300, **env) -> subprocess.CompletedProcess:
    """``python -m titan_ledger.train ARGS`` without torchrun (config errors, dry runs)."""
    return subprocess.run([sys.executable, "-m", "titan_ledger.train", *args], cwd=ROOT,
                          env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout tail\n{proc.stdout[-3000:]}\n--- stderr tail\n{proc.stderr[-6000:]}"


def read_tb(folder: Path, tag: str = "loss_metrics/global_avg_loss") -> dict[int, float]:
    """All values of one TensorBoard scalar under ``folder`` (float32, as logged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for events in sorted(Path(folder).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def logged_losses(text: str) -> dict[int, float]:
    """Console ``step: N loss: X`` lines (any rank printing a real loss)."""
    out = {}
    for m in re.finditer(r"step:\s*(\d+)\s+loss:\s*(-?[0-9.]+)", _ANSI.sub("", text)):
        step, loss = int(m.group(1)), float(m.group(2))
        if loss != -1.0:  # PP stages without the loss print -1
            out[step] = loss
    return out


def read_wandb_history(folder: Path) -> list[dict]:
    """History rows of the W&B offline run(s) under ``folder``, read from the .wandb file.

    wandb 0.31 ships no reader, so this decodes its LevelDB-style log directly: a
    7-byte file header, 32 KiB blocks of records (crc32 4, length 2, type 1:
    1 full, 2 first, 3 middle, 4 last), each payload a ``wandb_internal_pb2.Record``.
    """
    import json as _json
    import struct

    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(Path(folder).rglob("*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        pos, block, chunks = 7, 32768, []
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            payload = data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind == 0 and length == 0:
                pos += block - pos % block if pos % block else 0
                continue
            chunks.append(payload)
            if kind in (1, 4):
                rec = wandb_internal_pb2.Record()
                rec.ParseFromString(b"".join(chunks))
                chunks = []
                if rec.WhichOneof("record_type") == "history":
                    rows.append({(i.key or "/".join(i.nested_key)): _json.loads(i.value_json)
                                 for i in rec.history.item})
    return rows
