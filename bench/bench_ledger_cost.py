"""The ledger's cost per training step, measured so that a 2% difference is visible.

    python bench/bench_ledger_cost.py [--repeats 12] [--steps 16] [--warmup 3] [--snapshot] [--json FILE]

Two instruments, both on titan_ledger's ``debug_cpu`` config (llama3 debugmodel,
bundled corpus, 4 x 256 tokens per step) in **one process, world size 1** (no
torchrun; the ledger's collective is skipped at world size 1), one intra-op thread
(``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), pinned to one CPU (``--cpu``,
default the last one). Every repeat is a fresh subprocess of this script
(``--worker``) that builds the trainers with ``titan_ledger.train.load_config`` +
``config.build()``, runs each trainer's own ``train()`` in a thread, and times
``trainer.train_step`` from the outside. A baton lets exactly one trainer run at a time
and hands over only at step boundaries, so the trainers' steps interleave (A B B A A B
...) and the process CPU time of a step is that step's alone. Everything is CPU time:
time spent waiting for a core on a loaded machine does not enter it (contention for
caches and memory bandwidth still does: that is the noise left, see the spread).

(a) Direct. One LedgerTrainer. Before titan_ledger is imported,
``torch.profiler.record_function`` is replaced by a subclass that still opens the
profiler range and also adds the **thread CPU time** (``time.thread_time``) of every
outermost ``titan_ledger.<component>`` span to a per-component counter (and of the
union of all of them, the total, so nested spans count once). The per-step sums are
divided by the step's process CPU time. This costs two clock reads per span instead of
a profiler's per-op events. A component whose span never opened is reported as
``absent`` (not 0): the spans are the product's. ``--profiler`` adds a run under
``torch.profiler.profile(activities=[CPU])`` and reports the spans' ``cpu_time_total``
(self + children; the profiler measures it as wall time on the thread) against a
``bench.step`` range around each step: a cross-check that includes the profiler's own
per-op overhead.

(b) Paired. Stock torchtitan ``Trainer`` (``bench/stock_cpu.py``: its own
``train_step``, torchtitan's text loader, no ledger) against ``LedgerTrainer`` with
every default feature on, both in the same process, steps interleaved as above;
``--repeats`` fresh processes, the build order and first step alternating. A repeat's
value is the ratio of the two trainers' median step CPU time after ``--warmup`` steps.
The reported ratio is the geometric mean over repeats, with a 95% t interval on the
mean log ratio and a 95% bootstrap (percentile, 10000 resamples over repeats)
interval; spread is the repeats' min/max and standard deviation. The interval's
half-width is the smallest cost the instrument resolves at that number of repeats.

``--json FILE`` writes everything (per-step values included); ``--only direct`` /
``--only paired`` runs one instrument; ``--snapshot`` measures the committed HEAD (a
``git archive`` copy) instead of a working tree others may be editing; ``--variants``
adds ``ledger_no_max_logit`` / ``ledger_no_signals`` / ``ledger_no_tagging`` /
``ledger_no_doc_loss`` and the prevention features ``ledger_zloss`` (``--loss.z_loss_weight
1e-4``) / ``ledger_qk_norm`` (``--model.qk_norm``) / ``ledger_qk_clip`` (``--qk_clip.enable``), the proof at
the alarm ``ledger_prove_off`` / ``ledger_prove_all`` (``--ledger.proof.scope``; both:
their ratio is printed), ``ledger_no_defer`` (``--ledger.response.no_defer``: decisions in the step,
a host read per step; ``ledger / ledger_no_defer`` is what deferring costs), ``ledger_snapshots``
(``--ledger.snapshots.every 4 --ledger.snapshots.keep 2``: its copy comes once in 4 steps, so
``ledger_snapshots / ledger`` is printed on the mean step, with the host memory the ring held)
to the paired repeats, and ``stock_busy``,
the calibration: the stock Trainer plus
``--busy-ms`` of CPU time spun after every step (11 ms is ~2% of a step here); the
instrument must report stock_busy / stock at 1 + busy / step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER_ROOT = ROOT  # where the workers import titan_ledger and the bench from (--snapshot: a copy of HEAD)

COMPONENTS = ("signals", "max_logit", "spike_rules", "doc_loss", "tagging", "data_write", "drain")
SPAN_PREFIX = "titan_ledger."
ANY = "*"  # key of the union of every titan_ledger.* span (the total, nested spans once)

COMMON = ["--debug.seed", "0", "--metrics.log_freq", "1", "--parallelism.data_parallel_shard_degree", "1"]
VARIANTS = {
    "stock": ["--module", "bench.stock_cpu", "--config", "debug_cpu_stock"],
    "ledger": ["--module", "titan_ledger", "--config", "debug_cpu"],
    "ledger_no_max_logit": ["--module", "titan_ledger", "--config", "debug_cpu", "--ledger.no_max_logit"],
    "ledger_no_signals": ["--module", "titan_ledger", "--config", "debug_cpu", "--ledger.no_signals"],
    "ledger_no_tagging": ["--module", "titan_ledger", "--config", "debug_cpu", "--dataloader.no_tagging"],
    "ledger_no_doc_loss": ["--module", "titan_ledger", "--config", "debug_cpu", "--ledger.doc_loss.no_enable"],
    # prevention (design article §3): what each feature costs on top of the ledger
    "ledger_zloss": ["--module", "titan_ledger", "--config", "debug_cpu", "--loss.z_loss_weight", "1e-4"],
    "ledger_qk_norm": ["--module", "titan_ledger", "--config", "debug_cpu", "--model.qk_norm"],
    "ledger_qk_clip": ["--module", "titan_ledger", "--config", "debug_cpu", "--qk_clip.enable"],
    # the proof at the alarm (issue 35): what proving every note costs on steps that are
    # not proven (clean training: the flag's host read per step) against no proof at all
    "ledger_prove_off": ["--module", "titan_ledger", "--config", "debug_cpu", "--ledger.proof.scope", "off"],
    "ledger_prove_all": ["--module", "titan_ledger", "--config", "debug_cpu", "--ledger.proof.scope", "all"],
    # decisions in the step (a host read of the flag per step) instead of deferred ones
    "ledger_no_defer": ["--module", "titan_ledger", "--config", "debug_cpu", "--ledger.response.no_defer"],
    # host-memory snapshots (issue 51): a copy of the parameters and Adam's moments every 4
    # steps, a ring of 2; its cost comes once in 4 steps, so it is compared by the mean
    "ledger_snapshots": ["--module", "titan_ledger", "--config", "debug_cpu", "--ledger.snapshots.every", "4",
                         "--ledger.snapshots.keep", "2"],
    # calibration: the stock Trainer plus a known CPU cost per step (--busy-ms of thread
    # CPU time spun in Python after each train_step); the paired ratio must find it
    "stock_busy": ["--module", "bench.stock_cpu", "--config", "debug_cpu_stock"],
}


# ---------------------------------------------------------------------------- worker
def _install_span_clock(totals: dict[str, float], counts: dict[str, int]) -> None:
    """Make every ``record_function("titan_ledger.X")`` also add its thread CPU time
    to ``totals["X"]`` (outermost span of a name only: nested same-name spans are not
    counted twice). Must run before titan_ledger (or anything that does
    ``from torch.profiler import record_function``) is imported."""
    import torch.autograd.profiler as autograd_profiler
    import torch.profiler

    base = autograd_profiler.record_function
    depth: dict[str, int] = {}
    anyspan = {"depth": 0, "t0": 0.0}  # the union of all components: no double counting

    class timed_record_function(base):  # type: ignore[misc, valid-type]
        def __enter__(self):
            name = self.name
            if name.startswith(SPAN_PREFIX):
                key = name[len(SPAN_PREFIX):]
                d = depth.get(key, 0)
                depth[key] = d + 1
                now = time.thread_time()
                if d == 0:
                    self._bench_t0 = now
                if anyspan["depth"] == 0:
                    anyspan["t0"] = now
                anyspan["depth"] += 1
            return super().__enter__()

        def __exit__(self, *exc):
            out = super().__exit__(*exc)
            name = self.name
            if name.startswith(SPAN_PREFIX):
                key = name[len(SPAN_PREFIX):]
                depth[key] -= 1
                now = time.thread_time()
                if depth[key] == 0:
                    totals[key] = totals.get(key, 0.0) + now - self._bench_t0
                    counts[key] = counts.get(key, 0) + 1
                anyspan["depth"] -= 1
                if anyspan["depth"] == 0:
                    totals[ANY] = totals.get(ANY, 0.0) + now - anyspan["t0"]
                    counts[ANY] = counts.get(ANY, 0) + 1
            return out

    autograd_profiler.record_function = timed_record_function
    torch.profiler.record_function = timed_record_function


class _Baton:
    """Lets exactly one trainer thread run at a time and hands over at step boundaries.

    A thread owns the baton from the moment it may run until it hands it on; between
    two of its steps (torchtitan's per-step checkpoint/profiler/gc calls) it still owns
    it, so no two trainers ever run concurrently and process CPU time per step is
    clean. ``schedule`` is the order of steps (by trainer index), e.g. ABBAABBA.
    """

    def __init__(self, schedule: list[int]):
        import threading

        self.cv = threading.Condition()
        self.schedule = schedule
        self.pos = 0
        self.owner = schedule[0]
        self.finished: set[int] = set()
        self.failed = False

    def _wait(self, me: int) -> None:
        self.cv.wait_for(lambda: self.owner == me or self.failed)
        if self.failed:
            raise RuntimeError("another trainer failed")

    def start(self, me: int) -> None:
        with self.cv:
            self._wait(me)

    def before_step(self, me: int) -> None:
        with self.cv:
            if self.pos >= len(self.schedule):
                raise RuntimeError("more steps than scheduled")
            nxt = self.schedule[self.pos]
            if nxt != me:
                self.owner = nxt
                self.cv.notify_all()
                self._wait(me)
            self.pos += 1

    def done(self, me: int, ok: bool) -> None:
        with self.cv:
            self.finished.add(me)
            if not ok:
                self.failed = True
            rest = [i for i in self.schedule[self.pos:] if i not in self.finished]
            others = sorted({i for i in range(max(self.schedule) + 1)} - self.finished)
            self.owner = rest[0] if rest else (others[0] if others else None)
            self.cv.notify_all()


def worker(args: argparse.Namespace, _train_args: list[str]) -> None:
    """Build every trainer of ``--spec`` in this process and train them with their
    steps interleaved (one thread per trainer, one running at a time, order ABBA...);
    write per-step CPU/wall times (and span times) as JSON."""
    import socket
    import threading

    spec = json.loads(Path(args.spec).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    import torch

    torch.set_num_threads(1)
    span_totals: dict[str, float] = {}
    span_counts: dict[str, int] = {}
    if args.spans:
        _install_span_clock(span_totals, span_counts)
    sys.path.insert(0, str(ROOT))
    from titan_ledger.train import load_config

    # every config first: the backend must be installed before torchtitan is imported
    configs = [load_config(entry["args"])[0] for entry in spec["trainers"]]
    import torchtitan.trainer as tt_trainer

    class _NoSleep:  # torchtitan's train() ends with time.sleep(2) "for other ranks": none here
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(_s):
            return None

    tt_trainer.time = _NoSleep()
    trainers = [config.build() for config in configs]
    n = len(trainers)
    steps_each = spec["steps"]
    schedule: list[int] = []
    for k in range(steps_each):
        order = list(range(n)) if k % 2 == 0 else list(range(n))[::-1]
        schedule += order
    baton = _Baton(schedule)
    records: list[list[dict]] = [[] for _ in trainers]
    step_range = torch.profiler.record_function if args.profiler else None

    def wrap(i: int, trainer, busy_ms: float):
        inner = trainer.train_step

        def timed_train_step(data_iterator):
            baton.before_step(i)
            spans0 = dict(span_totals)
            c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            if step_range is not None:
                with step_range("bench.step"):
                    out = inner(data_iterator)
            else:
                out = inner(data_iterator)
            if busy_ms:
                end = time.thread_time() + busy_ms / 1e3
                while time.thread_time() < end:
                    pass
            c1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
            records[i].append({"step": trainer.step, "cpu_s": c1 - c0, "thread_s": t1 - t0, "wall_s": w1 - w0,
                               "spans_s": {k: v - spans0.get(k, 0.0) for k, v in span_totals.items()}})
            return out

        trainer.train_step = timed_train_step

    errors: list[BaseException] = []

    def body(i: int, trainer) -> None:
        ok = False
        try:
            baton.start(i)
            if args.profiler:  # the profiler records the thread that starts it
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    trainer.train()
                profs.append(prof)
            else:
                trainer.train()
            ok = True
        except BaseException as e:
            errors.append(e)
        finally:
            baton.done(i, ok)

    for i, (trainer, entry) in enumerate(zip(trainers, spec["trainers"])):
        wrap(i, trainer, entry.get("busy_ms", 0.0))
    if args.profiler and len(trainers) != 1:
        raise SystemExit("--profiler takes one trainer")
    profs: list = []
    threads = [threading.Thread(target=body, args=(i, t), daemon=True) for i, t in enumerate(trainers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for trainer in trainers:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if errors:
        raise errors[0]
    result = {"trainers": [{"name": e["name"], "class": type(t).__name__, "steps": r,
                            "snapshot_bytes": t.recovery.snapshots.nbytes if hasattr(t, "recovery") else None}
                           for e, t, r in zip(spec["trainers"], trainers, records)],
              "span_counts": span_counts, "num_threads": torch.get_num_threads(),
              "titan_ledger": str(Path(sys.modules["titan_ledger"].__file__).parent),
              "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    if profs:
        result["profiler"] = _profiler_spans(profs[0], args.warmup)
    Path(args.out).write_text(json.dumps(result))


def _profiler_spans(prof, warmup: int) -> dict:
    """Outermost ``titan_ledger.*`` events inside the kept ``bench.step`` ranges:
    their cpu_time_total (self + children, µs) summed per component, and the steps'."""
    events = [e for e in prof.events() if e.name == "bench.step" or e.name.startswith(SPAN_PREFIX)]
    step_events = sorted((e for e in events if e.name == "bench.step"), key=lambda e: e.time_range.start)
    kept = step_events[warmup:]
    total_step_us = sum(e.cpu_time_total for e in kept)
    per: dict[str, float] = {}
    for e in events:
        if not e.name.startswith(SPAN_PREFIX):
            continue
        ancestors = []
        parent = e.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if not any(s.time_range.start <= e.time_range.start and e.time_range.end <= s.time_range.end
                   for s in kept):
            continue
        key = e.name[len(SPAN_PREFIX):]
        if e.name not in ancestors:  # outermost of its name: inclusive time once
            per[key] = per.get(key, 0.0) + e.cpu_time_total
        if not any(a.startswith(SPAN_PREFIX) for a in ancestors):  # outermost of any: the union
            per[ANY] = per.get(ANY, 0.0) + e.cpu_time_total
    return {"step_us": total_step_us, "steps": len(kept), "spans_us": per}


# ---------------------------------------------------------------------------- driver
def run_one(variants: list[str], steps: int, cpu: int | None, warmup: int, spans: bool = False,
            profiler: bool = False, busy_ms: float = 0.0, timeout: int = 1200) -> dict:
    """One fresh worker process training ``variants`` (built and stepped in this order,
    steps interleaved ABBA...), ``steps`` steps each. Returns its JSON result by name."""
    with tempfile.TemporaryDirectory() as out:
        res = Path(out) / "result.json"
        spec = {"steps": steps, "trainers": [
            {"name": v, "busy_ms": busy_ms if v == "stock_busy" else 0.0,
             "args": [*VARIANTS[v], *COMMON, "--training.steps", str(steps), "--dump_folder", f"{out}/{v}"]}
            for v in variants]}
        (Path(out) / "spec.json").write_text(json.dumps(spec))
        cmd = [sys.executable, str(WORKER_ROOT / "bench" / "bench_ledger_cost.py"), "--worker", "--spec", f"{out}/spec.json",
               "--out", str(res), "--warmup", str(warmup)]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        if spans:
            cmd.append("--spans")
        if profiler:
            cmd.append("--profiler")
        env = dict(os.environ, TITAN_LEDGER_DEVICE="cpu", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
                   PYTHONPATH=os.pathsep.join([str(WORKER_ROOT), os.environ.get("PYTHONPATH", "")]))
        w0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=WORKER_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not res.exists():
            sys.exit(f"run of {variants} failed: rc={proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
                     f"--- stderr\n{proc.stderr[-6000:]}")
        result = json.loads(res.read_text())
        result["run_wall_s"] = time.perf_counter() - w0
        result["by_name"] = {t["name"]: t["steps"] for t in result["trainers"]}
        result["snapshot_bytes"] = {t["name"]: t.get("snapshot_bytes") for t in result["trainers"]}
        return result


def kept_steps(steps: list[dict], warmup: int) -> list[dict]:
    kept = steps[warmup:]
    if not kept:
        sys.exit(f"no steps left after dropping {warmup} warm-up steps")
    return kept


def direct(args) -> dict:
    res = run_one(["ledger"], args.direct_steps, args.cpu, args.warmup, spans=True)
    kept = kept_steps(res["by_name"]["ledger"], args.warmup)
    step_cpu = sum(s["cpu_s"] for s in kept)
    comps = {}
    others = sorted(set(res["span_counts"]) - set(COMPONENTS) - {ANY})
    for c in [*COMPONENTS, *others]:
        if c not in res["span_counts"]:
            comps[c] = None  # the span never opened: absent, not zero
            continue
        t = sum(s["spans_s"].get(c, 0.0) for s in kept)
        per_step = [s["spans_s"].get(c, 0.0) / s["cpu_s"] for s in kept]
        comps[c] = {"fraction": t / step_cpu, "ms_per_step": 1e3 * t / len(kept),
                    "calls": res["span_counts"][c], "fraction_min": min(per_step), "fraction_max": max(per_step)}
    union = sum(s["spans_s"].get(ANY, 0.0) for s in kept)
    out = {"steps": len(kept), "step_cpu_s_median": statistics.median(s["cpu_s"] for s in kept),
           "step_wall_s_median": statistics.median(s["wall_s"] for s in kept),
           "components": comps, "total_present": union / step_cpu if ANY in res["span_counts"] else None,
           "other_spans": others, "run_wall_s": res["run_wall_s"]}
    if args.profiler:
        pres = run_one(["ledger"], args.direct_steps, args.cpu, args.warmup, profiler=True)
        p = pres["profiler"]
        out["profiler"] = {"steps": p["steps"], "step_ms_mean": p["step_us"] / 1e3 / max(p["steps"], 1),
                           "components": {c: (None if c not in p["spans_us"] else
                                              {"fraction": p["spans_us"][c] / p["step_us"],
                                               "ms_per_step": p["spans_us"][c] / 1e3 / p["steps"]})
                                          for c in [*COMPONENTS, *(set(p["spans_us"]) - set(COMPONENTS) - {ANY})]},
                           "total_present": (p["spans_us"][ANY] / p["step_us"] if ANY in p["spans_us"] else None)}
    return out


_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def ratio_stats(ratios: list[float], seed: int = 0) -> dict:
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = statistics.fmean(logs)
    out = {"n": n, "ratio": math.exp(mean), "min": min(ratios), "max": max(ratios),
           "median": statistics.median(ratios)}
    if n >= 2:
        sd = statistics.stdev(logs)
        half = t975(n - 1) * sd / math.sqrt(n)
        rng = random.Random(seed)
        boots = sorted(math.exp(statistics.fmean(rng.choices(logs, k=n))) for _ in range(10000))
        out.update(sd_pct=100 * sd, ci95_t=[math.exp(mean - half), math.exp(mean + half)],
                   ci95_halfwidth_pct=100 * (math.exp(half) - 1),
                   ci95_bootstrap=[boots[249], boots[9749]])
    return out


def paired(args) -> dict:
    variants = ["stock", "ledger", *[v for v in args.variants if v not in ("stock", "ledger")]]
    busy_ms = 11.0 if args.busy_ms is None else args.busy_ms
    runs: list[dict] = []
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        order = variants if rep % 2 == 0 else variants[::-1]  # build order and first step alternate
        res = run_one(order, args.steps, args.cpu, args.warmup, busy_ms=busy_ms)
        rec: dict = {"repeat": rep, "order": order, "run_wall_s": res["run_wall_s"]}
        for v in variants:
            kept = kept_steps(res["by_name"][v], args.warmup)
            rec[v] = {"cpu_s": statistics.median(s["cpu_s"] for s in kept),
                      "cpu_s_mean": statistics.fmean(s["cpu_s"] for s in kept),
                      "snapshot_bytes": res["snapshot_bytes"].get(v),
                      "thread_s": statistics.median(s["thread_s"] for s in kept),
                      "wall_s": statistics.median(s["wall_s"] for s in kept),
                      "steps_cpu_s": [s["cpu_s"] for s in res["by_name"][v]],
                      "steps_wall_s": [s["wall_s"] for s in res["by_name"][v]]}
        # within the process: the ratio of each adjacent step pair (k-th step of each)
        for v in variants[1:]:
            a = kept_steps(res["by_name"]["stock"], args.warmup)
            b = kept_steps(res["by_name"][v], args.warmup)
            pair = [y["cpu_s"] / x["cpu_s"] for x, y in zip(a, b)]
            rec[v]["pair_ratios"] = pair
        runs.append(rec)
        line = ", ".join(f"{v} {rec[v]['cpu_s'] * 1e3:.1f} ms" for v in variants)
        ratios = ", ".join(f"{v}/stock {rec[v]['cpu_s'] / rec['stock']['cpu_s']:.4f}" for v in variants[1:])
        print(f"repeat {rep + 1}/{args.repeats} ({time.perf_counter() - t_start:.0f} s): {line}; {ratios}",
              file=sys.stderr, flush=True)
    out = {"repeats": runs, "variants": {}}
    for v in variants:
        cpu = [r[v]["cpu_s"] for r in runs]
        wall = [r[v]["wall_s"] for r in runs]
        out["variants"][v] = {"cpu_s_median": statistics.median(cpu), "cpu_s_min": min(cpu), "cpu_s_max": max(cpu),
                              "wall_s_median": statistics.median(wall), "wall_s_min": min(wall),
                              "wall_s_max": max(wall)}
        if v != "stock":
            out["variants"][v]["cpu_ratio"] = ratio_stats([r[v]["cpu_s"] / r["stock"]["cpu_s"] for r in runs])
            out["variants"][v]["thread_ratio"] = ratio_stats([r[v]["thread_s"] / r["stock"]["thread_s"]
                                                              for r in runs])
            out["variants"][v]["wall_ratio"] = ratio_stats([r[v]["wall_s"] / r["stock"]["wall_s"] for r in runs])
            pairs = [x for r in runs for x in r[v]["pair_ratios"]]
            out["variants"][v]["step_pair_ratio"] = {"n": len(pairs), "median": statistics.median(pairs),
                                                     "sd_pct": 100 * statistics.stdev(pairs) if len(pairs) > 1
                                                     else None}
    for v in variants[2:]:
        # each feature's own cost: the full ledger against the ledger without it, same process
        if v.startswith("ledger_no_"):
            out["variants"][v]["ledger_over_this"] = ratio_stats([r["ledger"]["cpu_s"] / r[v]["cpu_s"] for r in runs])
            print(f"ledger / {v}: {out['variants'][v]['ledger_over_this']}", file=sys.stderr, flush=True)
    if {"ledger_prove_off", "ledger_prove_all"} <= set(variants):
        out["prove_all_over_off"] = ratio_stats([r["ledger_prove_all"]["cpu_s"] / r["ledger_prove_off"]["cpu_s"]
                                                 for r in runs])
        print(f"ledger_prove_all / ledger_prove_off: {out['prove_all_over_off']}", file=sys.stderr, flush=True)
    if "ledger_snapshots" in variants:
        # a cost once every K steps: the mean step (amortised), not the median
        out["snapshots_over_ledger_mean"] = ratio_stats([r["ledger_snapshots"]["cpu_s_mean"] / r["ledger"]["cpu_s_mean"]
                                                         for r in runs])
        out["snapshot_bytes"] = runs[0]["ledger_snapshots"]["snapshot_bytes"]
        print(f"ledger_snapshots / ledger (mean step CPU, every 4 keep 2): {out['snapshots_over_ledger_mean']}; "
              f"host memory held: {out['snapshot_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    if "stock_busy" in variants:
        out["variants"]["stock_busy"]["busy_ms"] = busy_ms
        out["variants"]["stock_busy"]["expected_cpu_ratio"] = (
            1 + busy_ms / 1e3 / out["variants"]["stock"]["cpu_s_median"])
    out["elapsed_s"] = time.perf_counter() - t_start
    return out


def _pct(x: float | None) -> str:
    return "absent" if x is None else f"{100 * x:6.2f}%"


def print_report(rep: dict) -> None:
    cfg = rep["setup"]
    print(f"# titan_ledger cost: debug_cpu, world size 1, 1 thread, cpu {cfg['cpu']}, "
          f"{cfg['nproc']} CPUs, load average {cfg['loadavg_before']} -> {cfg.get('loadavg_after')}")
    print(f"# code: {cfg['code']}")
    if "direct" in rep:
        d = rep["direct"]
        print(f"\n(a) direct: LedgerTrainer, {d['steps']} steps kept, step CPU {d['step_cpu_s_median'] * 1e3:.1f} ms "
              f"(median; wall {d['step_wall_s_median'] * 1e3:.1f} ms)")
        prof = d.get("profiler")
        print(f"{'component':<12} {'span':<34} {'CPU/step':>9} {'ms/step':>8} {'calls':>6}"
              + (f" {'profiler':>9}" if prof else ""))
        for c in [*COMPONENTS, *d["other_spans"]]:
            v = d["components"][c]
            name = SPAN_PREFIX + c + (" (other)" if c not in COMPONENTS else "")
            pv = prof["components"].get(c) if prof else None
            ptxt = (f" {_pct(pv['fraction'] if pv else None):>9}") if prof else ""
            if v is None:
                print(f"{c:<12} {name:<34} {'absent':>9} {'-':>8} {'-':>6}{ptxt}")
            else:
                print(f"{c:<12} {name:<34} {_pct(v['fraction']):>9} {v['ms_per_step']:8.2f} {v['calls']:6d}{ptxt}")
        absent = [c for c in COMPONENTS if d["components"][c] is None]
        print(f"{'total':<12} {'(union of all titan_ledger.* spans)':<34} {_pct(d['total_present']):>9} {'':>8} {'':>6}"
              + (f" {_pct(prof['total_present']):>9}" if prof else "")
              + (f"   absent: {', '.join(absent)}" if absent else ""))
    if "paired" in rep:
        p = rep["paired"]
        print(f"\n(b) paired: {len(p['repeats'])} repeats (fresh processes), each training every variant "
              f"{cfg['steps']} steps with steps interleaved ABBA, {cfg['warmup']} warm-up steps dropped; "
              f"per repeat the median step; {p['elapsed_s']:.0f} s")
        print(f"{'variant':<20} {'CPU ms/step':>11} {'(min - max)':>17} {'wall ms/step':>12} {'(min - max)':>17}")
        for v, s in p["variants"].items():
            print(f"{v:<20} {s['cpu_s_median'] * 1e3:11.1f} {s['cpu_s_min'] * 1e3:8.1f}-{s['cpu_s_max'] * 1e3:<8.1f} "
                  f"{s['wall_s_median'] * 1e3:12.1f} {s['wall_s_min'] * 1e3:8.1f}-{s['wall_s_max'] * 1e3:<8.1f}")
        for v, s in p["variants"].items():
            if v == "stock":
                continue
            for kind in ("cpu_ratio", "thread_ratio", "wall_ratio"):
                r = s[kind]
                if "ci95_t" not in r:
                    print(f"{v}/stock {kind}: {r['ratio']:.4f} (one repeat: no interval)")
                    continue
                print(f"{v}/stock {kind:<12}: {r['ratio']:.4f}  95% CI {r['ci95_t'][0]:.4f}-{r['ci95_t'][1]:.4f} "
                      f"(bootstrap {r['ci95_bootstrap'][0]:.4f}-{r['ci95_bootstrap'][1]:.4f}), "
                      f"resolves +-{r['ci95_halfwidth_pct']:.2f}%; repeats {r['min']:.4f}-{r['max']:.4f}, "
                      f"sd {r['sd_pct']:.2f}%")
            sp = s["step_pair_ratio"]
            print(f"  {v}/stock per step pair: median {sp['median']:.4f}, sd {sp['sd_pct'] or 0:.2f}% (n={sp['n']})")
            if "expected_cpu_ratio" in s:
                print(f"  calibration: {s['busy_ms']:g} ms/step added, expected cpu ratio {s['expected_cpu_ratio']:.4f}")


def _code_version() -> str:
    """The commit the runs import titan_ledger from, and whether titan_ledger/ differs from it
    (other people's uncommitted edits change the product between repeats)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "titan_ledger"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"{ROOT} (no git)"
    if not head:
        return f"{ROOT} (not a git checkout)"
    return f"{head}{' + uncommitted titan_ledger/ edits' if dirty else ''} ({ROOT})"


def main() -> None:
    argv = sys.argv[1:]
    train_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=12,
                    help="paired repeats: fresh processes, each training stock and ledger interleaved")
    ap.add_argument("--steps", type=int, default=16, help="training steps of each trainer per repeat")
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped from each run")
    ap.add_argument("--direct-steps", type=int, default=20, help="training steps of the direct run")
    ap.add_argument("--profiler", action="store_true", help="direct: also a torch.profiler run (cross-check)")
    ap.add_argument("--only", choices=["direct", "paired"], default=None)
    ap.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v], default=[],
                    help=f"extra paired variants, comma-separated: {', '.join(list(VARIANTS)[2:])}")
    ap.add_argument("--busy-ms", type=float, default=None,
                    help="variant stock_busy: CPU ms added per step (11 ms ~ 2%% of a debug_cpu step)")
    ap.add_argument("--cpu", type=int, default=None, help="pin the runs to this CPU (default: the last one)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the runs to one CPU")
    ap.add_argument("--json", default=None, help="also write the full report as JSON to this file")
    ap.add_argument("--snapshot", action="store_true",
                    help="run the committed HEAD (git archive into a temporary folder), not the working "
                         "tree: uncommitted edits by others cannot change the product between repeats")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--spans", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args, train_args)
        return
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    global WORKER_ROOT
    snapshot_dir = None
    code = _code_version()
    if args.snapshot:
        snapshot_dir = tempfile.TemporaryDirectory(prefix="bench_ledger_cost_")
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", snapshot_dir.name], input=archive, check=True)
        WORKER_ROOT = Path(snapshot_dir.name)
        code = f"{head} (snapshot of HEAD in {WORKER_ROOT})"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.no_pin:
        args.cpu = None
    elif args.cpu is None and cpus:
        args.cpu = cpus[-1]
    rep: dict = {"setup": {"cpu": args.cpu, "nproc": os.cpu_count(), "steps": args.steps, "warmup": args.warmup,
                           "repeats": args.repeats, "direct_steps": args.direct_steps,
                           "loadavg_before": [round(x, 2) for x in os.getloadavg()],
                           "command": " ".join([Path(sys.executable).name, *sys.argv]),
                           "code": code}}
    try:
        if args.only in (None, "direct"):
            rep["direct"] = direct(args)
        if args.only in (None, "paired"):
            rep["paired"] = paired(args)
    finally:
        if snapshot_dir is not None:
            snapshot_dir.cleanup()
    rep["setup"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print_report(rep)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
