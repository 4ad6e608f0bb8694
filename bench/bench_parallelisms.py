"""Seconds per step of the CPU debug run under FSDP2, TP and PP (2 ranks each).

    python bench/bench_parallelisms.py [--steps 12] [--repeats 2]

Each configuration trains ``--steps`` steps from its TOML through the real CLI
(torchrun, gloo); the step time is torchtitan's own ``time_metrics/end_to_end(s)``
from TensorBoard (log_freq 1). The first two steps (warm-up) are dropped; the
median of the rest, over all repeats, is reported. Repeats are interleaved
(FSDP, TP, PP, FSDP, ...) so machine noise hits every configuration alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers import CONFIGS, explain, read_tb, torchrun  # noqa: E402

CASES = {"FSDP2 (dp_shard 2)": "debug_cpu.toml", "TP 2": "debug_cpu_tp.toml", "PP 2 (1F1B)": "debug_cpu_pp.toml"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for rep in range(args.repeats):
        for name, toml in CASES.items():
            with tempfile.TemporaryDirectory() as out:
                proc = torchrun(["--job.config_file", str(CONFIGS / toml), "--training.steps", str(args.steps),
                                 "--dump_folder", out, "--metrics.enable_tensorboard"])
                if proc.returncode != 0:
                    sys.exit(explain(proc))
                per_step = read_tb(Path(out), "time_metrics/end_to_end(s)")
                times[name] += [t for s, t in sorted(per_step.items()) if s > 2]
            print(f"repeat {rep + 1}: {name} done", file=sys.stderr)
    print(f"{'configuration':<22} {'median s/step':>14} {'min':>8} {'max':>8}  (n)")
    for name, ts in times.items():
        print(f"{name:<22} {statistics.median(ts):>14.3f} {min(ts):>8.3f} {max(ts):>8.3f}  ({len(ts)})")
    base = statistics.median(times["FSDP2 (dp_shard 2)"])
    print("ratios to FSDP2: " + ", ".join(f"{n}: {statistics.median(t) / base:.2f}" for n, t in times.items()))


if __name__ == "__main__":
    main()
