"""A real relaunch into a long run: what the ledger adds between ``torchrun`` and the first step.

    python bench/bench_relaunch.py [--dp 2] [--steps 100000] [--repeats 3]

Trains 2 steps of the recorded run's command (the scale bench's real source run: the
debug model on the bundled corpus as an indexed corpus, ``bench/ledger_grow.py``) with
``torchrun`` into (a) an empty dump folder and (b) a copy of a ledger grown to DP ``dp``
x ``steps`` steps, interleaved (a, b, a, b, ...), and times each launch from spawn to
the log line ``Training starts at step 1`` (torchtitan's, after every launch check,
the checkpoint decision and the ledger's setup). Printed: each launch's seconds, the
medians, and b - a: the ledger's share of a relaunch. Checkpoints are off (the grown
ledger's checkpoint folders are markers, not weights): the launch reads the folder's
layout and opens a new segment after the recorded history, as a resume does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ledger_grow

MARK = b"Training starts at step"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(args: list[str], dump: Path, log: Path) -> float:
    """Seconds from spawn to the first step's start; the run is then let finish."""
    cmd = list(args)
    for flag in ("--job.dump_folder", "--training.steps", "--ledger.rehearsal.inject"):
        while flag in cmd:
            i = cmd.index(flag)
            del cmd[i:i + 2]
    cmd = [*cmd, "--job.dump_folder", str(dump), "--training.steps", "2"]  # checkpoints off (the TOML)
    t0 = time.perf_counter()
    seen = None
    with open(log, "wb") as out:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
        for line in p.stdout:
            out.write(line)
            if seen is None and MARK in line:
                seen = time.perf_counter() - t0
        rc = p.wait()
    if rc != 0 or seen is None:
        kept = Path(tempfile.gettempdir()) / f"bench_relaunch_failed_{log.name}"
        shutil.copy(log, kept)
        raise SystemExit(f"bench_relaunch: the launch failed (exit {rc}); log: {kept}")
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ledger_scale"))
    a = ap.parse_args()
    src = ledger_grow.source_run(a.work)  # <work>/source/run
    grown, _ = ledger_grow.grown(a.work, a.dp, a.steps)
    args = json.loads((src.parent / "source.json").read_text())["args"]  # the recorded command
    # the recorded command trains DP 2; a grown DP other than 2 would be refused by the
    # layout check (global batch): the relaunch must be of the same run
    if a.dp != 2:
        raise SystemExit("bench_relaunch: the source run trains DP 2; use --dp 2")
    times: dict[str, list[float]] = {"empty": [], "grown": []}
    with tempfile.TemporaryDirectory(prefix="relaunch_") as tmp:
        tmp = Path(tmp)
        for k in range(a.repeats):
            for kind in ("empty", "grown"):
                dump = tmp / f"{kind}{k}"
                if kind == "grown":
                    shutil.copytree(grown / "ledger", dump / "ledger")
                s = launch(args, dump, tmp / f"{kind}{k}.log")
                times[kind].append(s)
                print(f"{kind:>6} launch {k + 1}: {s:6.2f} s to step 1", flush=True)
                shutil.rmtree(dump, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    size = sum(p.stat().st_size for p in (grown / "ledger").glob("*.jsonl")) / 1e6
    print(f"median to step 1: empty {med['empty']:.2f} s, into DP {a.dp} x {a.steps} ({size:.0f} MB of ledger) "
          f"{med['grown']:.2f} s: the ledger adds {med['grown'] - med['empty']:+.2f} s "
          f"(min/max empty {min(times['empty']):.2f}/{max(times['empty']):.2f}, grown "
          f"{min(times['grown']):.2f}/{max(times['grown']):.2f})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
