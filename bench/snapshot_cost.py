"""What a host snapshot costs: one capture and one restore of a rank's state, timed.

    python bench/snapshot_cost.py [--config debug_cpu] [--repeats 20] [--json]

Builds the config's trainer in this process (world size 1, one thread, the CPU rehearsal
backend), trains 3 steps (so Adam's moments exist), then times ``HostState.capture`` and
``HostState.restore`` (``titan_ledger.components.response.snapshots``) ``--repeats``
times each: the parameters and optimizer state copied to host memory and back, the size
held, min/median/max milliseconds. What it costs a run: one capture every
``--ledger.snapshots.every`` steps (the paired per-step instrument is ``python
bench/bench_ledger_cost.py --only paired --variants ledger_snapshots``), and ``keep`` + 1
such copies of host memory; a window proof costs (causes + 1) x the window's steps of
training on top. On a GPU the copy goes to pinned buffers on a side stream (not measured
here: no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="debug_cpu", help="a titan_ledger config function")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TITAN_LEDGER_DEVICE="cpu", WANDB_MODE="offline")
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from titan_ledger.train import load_config

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(["--module", "titan_ledger", "--config", a.config, "--debug.seed", "0",
                           "--parallelism.data_parallel_shard_degree", "1", "--training.steps", "3",
                           "--dump_folder", out])[0]  # installs the CPU backend before torchtitan is imported
        from titan_ledger.components.response.snapshots import HostState

        trainer = cfg.build()
        trainer.train()
        params = [p for m in trainer.model_parts for p in m.parameters()]
        opts = list(trainer.optimizers.optimizers)
        state = HostState().capture(params, opts)  # allocates its buffers (the first capture of a ring slot)
        cap, res = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            state.capture(params, opts)
            t1 = time.perf_counter()
            state.restore(params, opts)
            res.append(time.perf_counter() - t1)
            cap.append(t1 - t0)
        trainer.close()
    n_params = sum(p.numel() for p in params)

    def ms(xs):
        return {"min": 1e3 * min(xs), "median": 1e3 * statistics.median(xs), "max": 1e3 * max(xs)}

    rep = {"config": a.config, "parameters": n_params, "snapshot_mib": state.nbytes / 2**20,
           "capture_ms": ms(cap), "restore_ms": ms(res), "repeats": a.repeats}
    if a.json:
        print(json.dumps(rep))
    else:
        print(f"{a.config}: {n_params / 1e6:.2f} M parameters, a snapshot holds {rep['snapshot_mib']:.1f} MiB; "
              f"capture {rep['capture_ms']['median']:.1f} ms (min {rep['capture_ms']['min']:.1f}, max "
              f"{rep['capture_ms']['max']:.1f}), restore {rep['restore_ms']['median']:.1f} ms (min "
              f"{rep['restore_ms']['min']:.1f}, max {rep['restore_ms']['max']:.1f}) over {a.repeats} repeats")


if __name__ == "__main__":
    main()
