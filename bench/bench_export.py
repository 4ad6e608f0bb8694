"""How long a 10^5-step run takes into pandas/polars/DuckDB: ``signals_table`` and ``export``.

    python bench/bench_export.py [--rows 137000] [--folder DIR] [--repeats 3] [--clean]

Writes a signals ledger of ``--rows`` rows with :class:`records.RecordWriter` (every key
of ``SIGNAL_KEYS``, full-precision floats; two launches: the second resumed 1000 steps
back, so 1000 rows are superseded; a 50-step skipped window; a NaN loss and a ``-inf``
worst-rank loss now and then, as a diverging run writes them; none with ``--clean``), plus a 2-rank data
ledger of the last steps. Then, each in a fresh process of this script (``--worker``),
so that the peak RSS is that measurement's alone: ``signals_table`` (fast path),
``RunLedger.signal_rows()`` (the exact reader, for comparison), and ``python -m
titan_ledger.export DUMP -o OUT --step S`` in-process (its ``main``). Prints wall
seconds (the best of ``--repeats`` within the process) and the process's peak RSS
(``resource.getrusage``) in MB; then the export CLI as a process of its own, end to end
(interpreter start and imports included; its peak RSS from ``os.wait4``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_run(dump: Path, rows: int, data_steps: int = 200, clean: bool = False) -> int:
    """The ledger; returns the last step. ``clean``: no non-finite values."""
    from titan_ledger.format import records

    led = dump / "ledger"
    rng = random.Random(0)
    resume_at = rows - 20_000  # the second launch resumes from checkpoint resume_at - 1000
    window = (rows // 2, rows // 2 + 49)
    plan = [(1, "run-a", 0, 1, resume_at), (2, "run-b", resume_at - 1000, resume_at - 999, rows - 1000 + 50)]
    for seq, run, resumed, first, last in plan:
        hdr = records.Header(schema="", run_id=run, seq=seq, resumed_from=resumed, time=float(seq),
                             extra={"world_size": 8, "dp_size": 8, "config_digest": "bench"})
        records.append_segment(led, hdr)
        w = records.RecordWriter(led / records.SIGNALS_FILE, {**hdr.to_json(), "schema": records.SIGNALS.id,
                                                              "keys": list(records.SIGNAL_KEYS)})
        s = first
        while s <= last:
            if s == window[0]:
                w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": s, "last_step": window[1],
                         "skipped": True, "skip_lr": "freeze", "lr": 3e-4, "consumed_samples": 512 * s,
                         "consumed_tokens": 2_000_000 * s, "skipped_samples": 512 * 50,
                         "update_skipped": False, "step_time_s": 0.02, "data_loading_s": 0.0})
                s = window[1] + 1
                continue
            loss = 2.0 + 8.0 / math.sqrt(s) + rng.gauss(0, 0.02)
            w.write({"step": s, "consumed_samples": 512 * s, "consumed_tokens": 2_000_000 * s,
                     "loss": math.nan if s % 20_000 == 7 and not clean else loss,
                     "loss_max": -math.inf if s % 30_000 == 11 and not clean else loss + abs(rng.gauss(0, 0.05)),
                     "loss_max_rank": rng.randrange(8), "grad_norm": abs(rng.gauss(0.3, 0.05)),
                     "grad_norm_clipped": min(1.0, abs(rng.gauss(0.3, 0.05))), "num_zeros": rng.randrange(10**6),
                     "masked_tokens": 0, "param_norm": 400 + s / 1000, "update_norm": None,
                     "max_logit": 20 + rng.random(), "z_loss": 1e-4 * rng.random(), "logz_mean": rng.random(),
                     "logz_max": 5 + rng.random(), "qk_clip_heads": None, "qk_clip_eta_min": None,
                     "lr": 3e-4 * min(1.0, s / 2000), "skipped": False, "skipped_samples": 512 * 50 * (s > window[1]),
                     "spike": False, "spike_note": None, "update_skipped": False,
                     "step_time_s": 1.2 + rng.random() / 10, "data_loading_s": rng.random() / 100})
            s += 1
        w.close()
    last = plan[-1][-1]
    for r in range(2):  # the data ledger's last steps (2 DP ranks, 4 rows of 2 documents each)
        hdr = {"schema": records.DATA.id, "run_id": "run-b", "seq": 2, "resumed_from": 0, "time": 2.0,
               "dp_size": 2, "dp_rank": r, "mbs": 4, "global_batch": 8, "source_kind": "text"}
        w = records.RecordWriter(led / records.data_file(r), hdr)
        for s in range(last - data_steps + 1, last + 1):
            w.write({"step": s, "skipped": False, "rows": [[8 * s + 4 * r + j, "web", [[s * 10 + j, 0, 1500],
                                                            [s * 10 + j + 1, 0, 548]]] for j in range(4)]})
        w.close()
    return last


def worker(what: str, dump: str, step: int, repeats: int) -> dict:
    import contextlib
    import io

    import pyarrow.parquet  # noqa: F401  (imports are not what is timed)

    from titan_ledger.format.arrow import signals_table
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools.export import main

    best, info, t = math.inf, "", None
    for i in range(repeats):
        t0 = time.perf_counter()
        if what == "table":
            t = signals_table(dump)
            info = f"{t.num_rows} rows x {t.num_columns} columns"
        elif what == "rows":
            info = f"{len(RunLedger(dump).signal_rows())} rows"
        else:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert main([dump, "-o", str(Path(dump) / f"export{i}"), "--step", str(step)]) == 0
            info = out.getvalue().strip().replace("\n", " | ")
        best = min(best, time.perf_counter() - t0)
        t = None  # the next repeat does not hold two tables
    return {"seconds": best, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "info": info}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=137_000)
    ap.add_argument("--folder", help="dump folder to write (default: a temporary one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clean", action="store_true", help="no NaN/inf values (pyarrow reads the file once)")
    ap.add_argument("--worker", nargs=3, metavar=("WHAT", "DUMP", "STEP"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        what, dump, step = a.worker
        print(json.dumps(worker(what, dump, int(step), a.repeats)))
        return
    dump = Path(a.folder or tempfile.mkdtemp(prefix="bench_export_")) / "run"
    t0 = time.perf_counter()
    step = write_run(dump, a.rows, clean=a.clean)
    size = (dump / "ledger" / "signals.jsonl").stat().st_size
    lines = sum(1 for _ in open(dump / "ledger" / "signals.jsonl", "rb"))
    print(f"wrote {dump}/ledger/signals.jsonl: {lines} lines, {size / 2**20:.1f} MB in "
          f"{time.perf_counter() - t0:.1f} s")
    for what, name in (("table", "signals_table(dump)"), ("rows", "RunLedger(dump).signal_rows()"),
                       ("export", f"export main([dump, '-o', OUT, '--step', {step}])")):
        p = subprocess.run([sys.executable, __file__, "--repeats", str(a.repeats), "--worker", what, str(dump),
                            str(step)], capture_output=True, text=True, cwd=ROOT, check=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{name:48s} {r['seconds']:6.2f} s  peak RSS {r['peak_rss_mb']:6.0f} MB  ({r['info']})")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "titan_ledger.export", str(dump), "-o", str(dump / "export_cli"),
                          "--step", str(step)], stdout=subprocess.PIPE, cwd=ROOT)
    out = p.stdout.read().decode()
    _, status, usage = os.wait4(p.pid, 0)  # this child's own peak RSS
    wall = time.perf_counter() - t0
    assert status == 0, status
    print(f"{'python -m titan_ledger.export (a process)':48s} {wall:6.2f} s  peak RSS {usage.ru_maxrss / 1024:6.0f} MB"
          f"\n  " + out.strip().replace("\n", "\n  "))


if __name__ == "__main__":
    main()
