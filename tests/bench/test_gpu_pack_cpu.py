"""The GPU validation pack's CPU mode (bench/device/run.sh --cpu), so the pack cannot rot.

Same code as the GPU run minus the CUDA kernels: the attention check, stock Trainer vs
LedgerTrainer in separate processes, the sync-counting wrappers around the ledger's
calls, and the step-1 signals against an fp32 eager recomputation. The verdicts come
from the pack's own JSON; this test also requires real numbers behind them.
"""

import json
import math
import os
import subprocess
import time

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu_pack")
    env = {k: v for k, v in os.environ.items() if k not in ("PACK_T0", "OUT")}
    env.update(OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run([str(ROOT / "bench/device/run.sh"), "--cpu", "--workdir", str(work)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"no JSON on stdout (rc={proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc, result, elapsed


def test_cpu_pack_passes_with_real_numbers(pack):
    proc, r, elapsed = pack
    assert r["ok"] and proc.returncode == 0, json.dumps({k: r.get(k) for k in (
        "checks", "failed", "not_run", "failed_runs", "signals", "flex_max_logit")}, indent=1, default=str)
    # (no bound on its time: speed is measured in benchmarks, and a loaded CI machine is slow)
    assert r["mode"] == "cpu" and not r["guard_hit"], elapsed
    # (a) the CPU attention equals eager Flex and a brute-force max logit
    fl = r["flex_max_logit"]
    assert fl["cpu_attention_vs_eager_flex"]["max_abs_err"] <= 1e-4
    assert _finite(fl["max_logit_float32"]["cpu_attention"]) and fl["max_logit_float32"]["rel_err"] <= 1e-5
    # (b) both trainers trained and were timed
    st = r["step_time"]["eager"]
    assert st["pairs"] >= 1 and _finite(st["ratio"]) and st["ratio"] > 0
    assert [x["variant"] for x in st["runs"]][:2] == ["stock", "ledger"]
    assert st["stock_step_s"]["median"] > 0 and st["ledger_step_s"]["median"] > 0
    # (c) the counting wrappers saw each of the ledger's per-step calls once per counted step:
    # the rows' provenance (take_provenance, provenance_ready), the step's record (record),
    # the drain. (The sync counts are
    # CUDA-only: 0 here by construction, and the pack says it is no measurement.)
    sy = r["syncs"]
    assert sy["counted"] and sy["meaningful"] is False and "CUDA-only" in sy["note"], sy
    counted = len(sy["in_ledger_calls_per_step"])  # the counted steps of the one CPU ledger run
    assert counted >= 1 and len(sy["ledger_trainer_step_per_step"]) == counted, sy
    assert sy["in_ledger_calls_per_step"] == [0] * counted and sy["added_by_ledger_per_step"] == 0, sy
    calls = sy["ledger_calls"]
    assert {"take_provenance", "provenance_ready", "record", "drain"} <= set(calls), calls
    # the step's own calls once each; every other call a whole number of times in every counted
    # step (``flags``: the deferred step's queued copy and this step's, one name since issue 69)
    assert all(calls[k] == counted for k in ("take_provenance", "provenance_ready", "record", "drain")), calls
    assert all(v % counted == 0 for v in calls.values()), calls
    assert sy["ledger_calls_per_step"] == sum(calls.values()) / counted, sy
    # (d) every signal against the fp32 reference, with values
    sig = r["signals"]
    assert sig["ok"] and sig["precision"] == "float32 vs float32"
    for key in ("loss", "grad_norm", "grad_norm_clipped", "param_norm", "max_logit"):
        assert _finite(sig[key]["ledger"]) and _finite(sig[key]["reference"]), (key, sig[key])
        assert sig[key]["rel_err"] <= sig[key]["tol"], (key, sig[key])
    assert sig["loss"]["reference"] > 1.0  # an untrained model's cross entropy, not a placeholder
    assert sig["num_zeros"]["ok"] and sig["consumed_tokens"]["ledger"] > 0
    # (e)
    pdl = r["per_doc_loss"]  # the step-1 per-document losses against the reference
    assert pdl["ok"] and pdl["entries"] > 0 and pdl["max_rel_err"] <= pdl["tol"], pdl
    assert r["checks"]["per_doc_loss_vs_reference"] is True
    # (f) proofs forced on 5 clean steps of the tiny model with the noise rehearsed: each ran
    # a third execution, measured the floor (the jitter's size) and proved nothing
    pn = r["proof_noise"]["proof_rehearsed_noise"]
    assert [p["step"] for p in pn["proofs"]] == [2, 3, 4, 5, 6] and pn["hardware"] == 0, pn
    assert all(p["executions"] == 3 and p["bit_equal"] is False and 1e-7 < p["noise_floor"] < 1e-4
               for p in pn["proofs"]), pn
    # where the time went: run.sh's setup apart from the checks, and one summary line
    assert {e["what"] for e in r["time_log"]} >= {"flex_max_logit", "eager_stock_1", "eager_ledger_1"}
    assert _finite(r["setup_s"]) and r["setup_s"] >= 0 and "[gpu-pack" in proc.stderr
    assert f"gpu-pack: {r['summary']}" in proc.stderr.splitlines() and r["summary"].startswith(
        f"ok: {len(r['checks'])} of {len(r['checks'])} checks passed (setup "), r["summary"]


def test_llama3_1b_bench_dry_run(tmp_path):
    """The GPU pack's 1B config builds (fake backend, meta weights): flavor, FSDP2, optimizer, data."""
    from helpers import explain, train_cli

    proc = train_cli(["--module", "titan_ledger", "--config", "llama3_1b_bench", "--comm.mode", "fake_backend",
                      "--dump_folder", str(tmp_path)],
                     NGPU="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", timeout=300, warm=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, explain(proc)
    assert "dry run: built LedgerTrainer for world size 1" in out
    assert "Model llama3 1B" in out and "sequence length 4096" in out
