"""bench/bench_ledger_cost.py: its span clock, statistics and step baton (fast), and one
tiny end-to-end run of both instruments (slow: it trains)."""

import json
import math
import subprocess
import sys
import threading
import time

import pytest
from helpers import ROOT, child_env, load_bench

blc = load_bench("bench_ledger_cost")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_span_clock_counts_outermost_and_union(monkeypatch):
    import torch.autograd.profiler as autograd_profiler
    import torch.profiler

    # restored at teardown: the clock replaces record_function process-wide
    monkeypatch.setattr(autograd_profiler, "record_function", autograd_profiler.record_function)
    monkeypatch.setattr(torch.profiler, "record_function", torch.profiler.record_function)
    totals, counts = {}, {}
    blc._install_span_clock(totals, counts)
    rf = torch.profiler.record_function
    with rf("titan_ledger.signals"):
        _spin(0.02)
        with rf("titan_ledger.signals"):  # nested same name: counted once
            _spin(0.01)
        with rf("titan_ledger.spike_rules"):  # nested other component: its own, and once in the union
            _spin(0.01)
    with rf("someone.else"):  # not a ledger span
        _spin(0.01)
    with rf("titan_ledger.drain"):
        _spin(0.01)
    assert counts == {"signals": 1, "spike_rules": 1, "drain": 1, blc.ANY: 2}
    assert 0.04 <= totals["signals"] < 0.06
    assert 0.01 <= totals["spike_rules"] < 0.03
    assert 0.05 <= totals[blc.ANY] < 0.08  # signals (with its children) + drain


def test_ratio_stats_interval():
    r = blc.ratio_stats([1.01, 1.02, 1.03, 1.02, 1.01, 1.03])
    assert r["n"] == 6 and math.isclose(r["ratio"], 1.02, abs_tol=1e-3)
    lo, hi = r["ci95_t"]
    assert lo < r["ratio"] < hi and hi - lo < 0.03
    assert r["ci95_bootstrap"][0] <= r["ratio"] <= r["ci95_bootstrap"][1]
    assert 0 < r["ci95_halfwidth_pct"] < 1.5
    assert "ci95_t" not in blc.ratio_stats([1.05])  # one repeat: no interval


def test_baton_runs_one_thread_at_a_time_in_schedule_order():
    schedule = [0, 1, 1, 0, 0, 1]
    baton = blc._Baton(schedule)
    seen, running = [], []

    def body(me):
        ok = False
        try:
            baton.start(me)
            for _ in range(3):
                baton.before_step(me)
                running.append(me)
                assert len(running) == 1
                seen.append(me)
                time.sleep(0.01)
                running.remove(me)
            ok = True
        finally:
            baton.done(me, ok)

    threads = [threading.Thread(target=body, args=(i,)) for i in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == schedule


BUSY_MS = 3000.0  # a known CPU cost per step, large against one step's own noise on a loaded machine (fresh-clone CI: a 1.8 s step measured 0.4 s apart between two trainers, so 1000 ms at 35% did not hold)


@pytest.mark.slow
def test_tiny_run_reports_both_instruments(tmp_path):
    """Both instruments, one kept step each: every ledger span measured, and the paired
    instrument finds the calibration's known cost (stock_busy: stock + BUSY_MS of CPU a
    step; the third trainer adds no measurable time to the run)."""
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_ledger_cost.py"), "--repeats", "1",
                           "--steps", "2", "--warmup", "1", "--direct-steps", "2", "--no-pin", "--variants",
                           "stock_busy", "--busy-ms", str(BUSY_MS), "--json", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert "(a) direct" in proc.stdout and "(b) paired" in proc.stdout
    assert f"calibration: {BUSY_MS:g} ms/step added" in proc.stdout
    check_tiny_report(report)


def check_tiny_report(report: dict) -> None:
    """What the tiny run's report must hold (a function: it is also run on doctored reports)."""
    # (a) direct: every component's span opened (all default features are on), each a real
    # share of the step, and the union of the spans between the largest one and their sum
    d = report["direct"]
    assert d["steps"] == 1 and d["step_cpu_s_median"] > 0
    comps = d["components"]
    assert set(comps) == set(blc.COMPONENTS) and d["other_spans"] == []
    absent = [c for c in blc.COMPONENTS if comps[c] is None]
    assert not absent, f"spans that never opened: {absent}"
    for name, c in comps.items():
        assert 0 < c["fraction"] < 1 and c["calls"] >= 1, (name, c)
        assert math.isclose(c["ms_per_step"], 1e3 * c["fraction"] * d["step_cpu_s_median"], rel_tol=1e-6), (name, c)
    fractions = [c["fraction"] for c in comps.values()]
    assert max(fractions) <= d["total_present"] <= sum(fractions) + 1e-9, (d["total_present"], fractions)
    assert d["total_present"] < 0.5, d["total_present"]

    # (b) paired: the numbers are the kept (post-warm-up) step's, the ratio is theirs, and the
    # calibration's known added cost is found
    p = report["paired"]
    (rep,) = p["repeats"]
    for v in ("stock", "ledger", "stock_busy"):
        assert len(rep[v]["steps_cpu_s"]) == 2 and rep[v]["cpu_s"] == rep[v]["steps_cpu_s"][1], (v, rep[v])
    var = p["variants"]
    for v in ("ledger", "stock_busy"):
        r = var[v]["cpu_ratio"]
        assert r["n"] == 1 and "ci95_t" not in r  # one repeat: no interval claimed
        assert math.isclose(r["ratio"], rep[v]["cpu_s"] / rep["stock"]["cpu_s"], rel_tol=1e-9), (v, r)
        assert math.isclose(var[v]["step_pair_ratio"]["median"], r["ratio"], rel_tol=1e-9)
    cal = var["stock_busy"]
    assert cal["busy_ms"] == BUSY_MS
    assert math.isclose(cal["expected_cpu_ratio"], 1 + BUSY_MS / 1e3 / var["stock"]["cpu_s_median"], rel_tol=1e-9)
    found_ms = 1e3 * (rep["stock_busy"]["cpu_s"] - rep["stock"]["cpu_s"])
    assert abs(found_ms - BUSY_MS) <= 0.35 * BUSY_MS, (found_ms, cal)  # (stock and stock_busy step alike)
    assert abs(cal["cpu_ratio"]["ratio"] - cal["expected_cpu_ratio"]) <= 0.35 * (cal["expected_cpu_ratio"] - 1), cal
    # the ledger's own ratio is a measurement of one kept step, not a claim: on a loaded
    # 2-core machine one step measured 0.918 and another 1.367 (fresh-clone CI runs), so no
    # band holds it; the cost claim is the benchmark's (repeats, a 95% interval). The
    # instrument must still have measured it
    ratio = var["ledger"]["cpu_ratio"]["ratio"]
    assert math.isfinite(ratio) and ratio > 0, ratio
