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


@pytest.mark.slow
def test_tiny_run_reports_both_instruments(tmp_path):
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_ledger_cost.py"), "--repeats", "1",
                           "--steps", "2", "--warmup", "1", "--direct-steps", "2", "--no-pin", "--json", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    comps = rep["direct"]["components"]
    assert set(comps) == set(blc.COMPONENTS)
    for c in comps.values():  # absent (None) or a real fraction
        assert c is None or 0 <= c["fraction"] < 1
    ratio = rep["paired"]["variants"]["ledger"]["cpu_ratio"]["ratio"]
    assert 0.5 < ratio < 2
    assert "(a) direct" in proc.stdout and "(b) paired" in proc.stdout
