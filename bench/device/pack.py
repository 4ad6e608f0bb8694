"""GPU validation pack: the GPU path of titan_ledger proven in one command (issue 17).

    bench/device/run.sh            # CUDA (one H200: <= 8 minutes), prints one JSON object
    bench/device/run.sh --cpu      # the same code on CPU (tiny model; CI: tests/bench)

Checks, in order of priority (a wall-clock guard skips what no longer fits and
still prints the JSON, with the skipped items under "not_run"):

(a) ``flex_max_logit``: Flex ``max_scores`` against an eager dense reference
    (``check_flex_max_logit.py``; its CPU form checks the CPU attention).
(d) ``signals``: the ledger's step-1 row (loss, grad norm, clipped grad norm,
    param norm, num_zeros, max logit, tokens) against an fp32 eager recomputation
    of the same batch and weights on the same device, unsharded, one process.
(c) ``syncs``: blocking syncs per step under ``torch.cuda.set_sync_debug_mode("warn")``,
    inside the ledger's calls (goal 0) and for the whole step of the stock Trainer
    and of LedgerTrainer (the difference is what the ledger adds; goal 0).
(b) ``step_time``: stock torchtitan ``Trainer`` vs ``LedgerTrainer`` (every default
    ledger feature on) on the same config, separate processes interleaved
    stock, ledger, stock, ledger; eager, then compiled. Ratio goal <= 1.005.
(e) ``per_doc_loss``: the step-1 per-document losses against the reference (``worker.per_doc_loss``);
    their cost is inside the ledger's step time.
(f) ``proof_noise``: proofs at the alarm forced on clean steps (``--ledger.rehearsal.prove_at``):
    how far re-executions of one step differ on this machine (the noise floor each proof
    measures, ``proof.noise``), that no clean step is proven ``hardware``, and, on CUDA,
    that ``--debug.deterministic`` makes them bit-equal. The CPU mode rehearses the noise
    (``--ledger.rehearsal.nondeterminism 1e-6``).

Exit 0 when every check passed, 1 otherwise (a failed or a not-run check).
Worker logs and this JSON are kept in ``--workdir`` (default ``$OUT/gpu_pack`` when
``$OUT`` is set, else ``outputs/gpu_pack``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# What each mode runs. CUDA: sized for one H200 (see the README's "GPU validation pack").
PLANS = {
    "cuda": {"config": "llama3_1b_bench", "extra": [], "warmup": 5, "timed": 25, "sync_steps": 3,
             "repeats": 2, "compile": [False, True], "budget_s": 450.0, "worker_cap_s": 200.0,
             "flex_cap_s": 150.0,
             "proof": {"config": "llama3_1b_bench", "extra": [], "steps": 6,
                       "runs": {"proof_default": [], "proof_deterministic": ["--debug.deterministic"]}}},
    # CPU: the llama3 debug model, 1 process, few short steps; timing is not a measurement
    # on a shared CPU, only the code path
    "cpu": {"config": "debug_cpu",
            "extra": ["--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "2",
                      "--training.seq_len", "128"],
            "warmup": 1, "timed": 3, "sync_steps": 1, "repeats": 1, "compile": [False],
            "budget_s": 85.0, "worker_cap_s": 60.0, "flex_cap_s": 40.0,
            # the tiny model (tens of ms a step): the proof's code path, with the noise rehearsed
            "proof": {"config": "tiny_cpu", "extra": ["--parallelism.data_parallel_shard_degree", "1"], "steps": 6,
                      "runs": {"proof_rehearsed_noise": ["--ledger.rehearsal.nondeterminism", "1e-6"]}}},
}


class Guard:
    """The checks' wall clock: run.sh exports PACK_T0 when its setup (the venv) is done,
    so the budget is the checks' own; the setup's seconds come apart (PACK_SETUP_S)."""

    def __init__(self, budget_s: float):
        self.t0 = float(os.environ.get("PACK_T0") or time.time())
        self.budget_s = budget_s
        self.log: list[dict] = []

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def note(self, what: str, started: float, **extra) -> None:
        entry = {"what": what, "at_s": round(started - self.t0, 1), "s": round(time.time() - started, 1), **extra}
        self.log.append(entry)
        print(f"[gpu-pack {self.elapsed():6.1f}s] {what}: {entry['s']} s", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TITAN_LEDGER_DEVICE=device, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_child(cmd: list[str], log: Path, timeout: float, device: str) -> tuple[int | None, str]:
    """Run in its own session; kill the whole group on timeout. Returns (rc or None, log tail)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(device), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, log.read_text(errors="replace")[-3000:]


# --------------------------------------------------------------------------- the parts
def flex_check(guard: Guard, plan: dict, work: Path, device: str) -> dict:
    started = time.time()
    cmd = [sys.executable, str(HERE / "check_flex_max_logit.py")]
    rc, tail = run_child(cmd, work / "flex.log", min(plan["flex_cap_s"], guard.left()), device)
    guard.note("flex_max_logit", started, rc=rc)
    text = (work / "flex.log").read_text(errors="replace")
    start = text.rfind("\n{")
    try:
        res = json.loads(text[start + 1 if start >= 0 else 0:])
    except ValueError:
        res = {"ok": False, "error": "no JSON from check_flex_max_logit.py" if rc is not None else "timed out",
               "log_tail": tail}
    res["rc"] = rc
    return res


def worker(guard: Guard, plan: dict, work: Path, device: str, name: str, variant: str, compile_: bool,
           reference: bool = False, extra: list[str] | None = None) -> dict:
    started = time.time()
    out, dump = work / f"{name}.json", work / name
    shutil.rmtree(dump, ignore_errors=True)
    cmd = [sys.executable, str(HERE / "worker.py"), "--variant", variant, "--config", plan["config"],
           "--out", str(out), "--dump", str(dump), "--warmup", str(plan["warmup"]), "--timed", str(plan["timed"]),
           "--sync-steps", str(plan["sync_steps"])]
    cmd += ["--compile"] if compile_ else []
    cmd += ["--reference"] if reference else []
    flags = [*plan["extra"], *(extra or [])]
    cmd += ["--", *flags] if flags else []
    rc, tail = run_child(cmd, work / f"{name}.log", min(plan["worker_cap_s"], guard.left()), device)
    try:
        res = json.loads(out.read_text())
    except (OSError, ValueError):
        res = {"ok": False, "error": "timed out (guard)" if rc is None else f"worker exited {rc} without a result"}
    res["rc"] = rc
    if not res.get("ok"):
        res["log_tail"] = tail
    guard.note(name, started, rc=rc, phases_s=res.get("phases_s"))
    return res


def proof_check(guard: Guard, plan: dict, work: Path, device: str, fits) -> dict | None:
    """(f): per run, every forced proof's verdict, whether its re-execution was bit-equal,
    the noise floor it measured and its seconds (from the run's spikes.jsonl)."""
    pp = plan["proof"]
    sub = {**plan, "config": pp["config"], "extra": pp["extra"], "warmup": 1, "timed": pp["steps"] - 1,
           "sync_steps": 0}
    out: dict = {}
    for name, flags in pp["runs"].items():
        if not fits(30.0, name):
            return out or None
        res = worker(guard, sub, work, device, name, "ledger", False,
                     extra=["--ledger.rehearsal.prove_at", f"2-{pp['steps']}", *flags])
        entry: dict = {"ok": bool(res.get("ok")), "flags": flags}
        if res.get("rc") is None:  # killed by the wall-clock guard: not run, not failed
            entry["timed_out"] = True
        if not res.get("ok"):
            entry["error"] = res.get("error")
            entry["log_tail"] = res.get("log_tail")
        else:
            from titan_ledger.format.records import read_ledger

            hist = read_ledger(work / name / "ledger" / "spikes.jsonl").history
            proofs = [(e["step"], e["proof"]) for e in hist if "proof" in e]
            entry["proofs"] = [{"step": st, "verdict": p["verdict"], "applied": p["applied"],
                                "bit_equal": p["executions"][1].get("bit_equal"),
                                "executions": len(p["executions"]),
                                "noise_floor": (p.get("noise") or {}).get("floor"), "seconds": p["seconds"]}
                               for st, p in proofs]
            floors = [x["noise_floor"] for x in entry["proofs"] if x["noise_floor"] is not None]
            entry["noise_floor_max"] = max(floors) if floors else None
            entry["bit_equal"] = sum(1 for x in entry["proofs"] if x["bit_equal"])
            entry["hardware"] = sum(1 for x in entry["proofs"] if x["verdict"] == "hardware")
        out[name] = entry
    return out


def proof_verdicts(proof: dict | None, cuda: bool) -> dict[str, bool | None]:
    """(f)'s checks: no clean step proven hardware; the rehearsed noise measured (CPU);
    bit-equal re-executions under --debug.deterministic (CUDA)."""
    runs = {k: r for k, r in (proof or {}).items() if not r.get("timed_out")}  # the guard's: not run
    ok = [r for r in runs.values() if r.get("ok") and r.get("proofs")]
    checks: dict[str, bool | None] = {
        "proof_no_hardware_on_clean_steps": (all(r["hardware"] == 0 for r in ok) and len(ok) == len(runs))
        if runs else None}
    if cuda:
        det = runs.get("proof_deterministic")
        checks["proof_bit_equal_when_deterministic"] = None if det is None else bool(
            det.get("ok") and det.get("proofs") and det["bit_equal"] == len(det["proofs"]))
    else:
        reh = runs.get("proof_rehearsed_noise")
        checks["proof_measures_rehearsed_noise"] = None if reh is None else bool(
            reh.get("ok") and reh.get("proofs") and reh["noise_floor_max"] and 0 < reh["noise_floor_max"] < 1e-4)
    return checks


def pair_stats(runs: list[tuple[dict, dict]]) -> dict:
    """Interleaved (stock, ledger) pairs -> per-pair median ratio, its spread, pooled medians."""
    pairs = [(s, l) for s, l in runs if s.get("ok") and l.get("ok") and s.get("step_s") and l.get("step_s")]
    if not pairs:
        return {"pairs": 0}
    ratios = [statistics.median(l["step_s"]) / statistics.median(s["step_s"]) for s, l in pairs]
    stock = [t for s, _ in pairs for t in s["step_s"]]
    ledger = [t for _, l in pairs for t in l["step_s"]]
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {
        "pairs": len(pairs),
        "ratio": statistics.median(ratios),
        "ratio_per_pair": ratios,
        "ratio_spread": [min(ratios), max(ratios)],
        "ratio_pooled_median": statistics.median(ledger) / statistics.median(stock),
        "stock_step_s": {"median": statistics.median(stock), "p10": q(stock, 0.1), "p90": q(stock, 0.9), "n": len(stock)},
        "ledger_step_s": {"median": statistics.median(ledger), "p10": q(ledger, 0.1), "p90": q(ledger, 0.9),
                          "n": len(ledger)},
        "wall_s_per_step": {"stock": [s.get("wall_s_per_step") for s, _ in pairs],
                            "ledger": [l.get("wall_s_per_step") for _, l in pairs]},
        "goal": 1.005,
    }


def sync_summary(stock: list[dict], ledger: list[dict], cuda: bool) -> dict:
    ok_l = [r for r in ledger if r.get("ok") and r.get("syncs", {}).get("counted_steps")]
    ok_s = [r for r in stock if r.get("ok") and r.get("syncs", {}).get("counted_steps")]
    if not ok_l or not ok_s:
        return {"counted": False}
    per = lambda rs, k: [n for r in rs for n in r["syncs"][k]]  # noqa: E731
    led_total, stock_total = per(ok_l, "per_step_total"), per(ok_s, "per_step_total")
    out = {
        "counted": True,
        "meaningful": cuda,
        "in_ledger_calls_per_step": per(ok_l, "per_step_in_ledger_calls"),
        "ledger_trainer_step_per_step": led_total,
        "stock_trainer_step_per_step": stock_total,
        "added_by_ledger_per_step": max(led_total) - min(stock_total),
        "ledger_calls_per_step": min(r["syncs"]["ledger_calls_per_step"] for r in ok_l),
        "ledger_calls": ok_l[0]["syncs"]["ledger_calls"],
        "where_ledger_trainer": ok_l[0]["syncs"]["where"],
        "where_in_ledger_calls": ok_l[0]["syncs"]["ledger_where"],
        "where_stock_trainer": ok_s[0]["syncs"]["where"],
        "goal": 0,
    }
    if not cuda:
        out["note"] = ("torch.cuda.set_sync_debug_mode is CUDA-only: on CPU nothing can be counted, so "
                       "these zeros are not a measurement; the CPU mode proves the counting code runs and "
                       "sees the ledger's calls (ledger_calls_per_step > 0)")
    return out


def setup_s() -> float | None:
    """The seconds run.sh spent before the checks (venv check or creation), or None when
    pack.py was started without run.sh."""
    try:
        return float(os.environ["PACK_SETUP_S"])
    except (KeyError, ValueError):
        return None


def summary_line(result: dict) -> str:
    """One line that says what the run proved: how many checks passed, failed or did not
    run, and why nothing ran when nothing did (a fresh machine's setup is the usual cause)."""
    checks = result["checks"]
    ran = {k: v for k, v in checks.items() if v is not None}
    setup = result.get("setup_s")
    times = f"setup {setup:.0f} s, checks {result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget" \
        if setup is not None else f"checks {result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget"
    if not ran:
        return (f"CHECKED NOTHING: the budget ran out before the first check ({times}); "
                f"give the checks more time with --budget S")
    verdict = "ok" if result["ok"] else "NOT OK"
    parts = [f"{sum(ran.values())} of {len(checks)} checks passed"]
    if result["failed"]:
        parts.append(f"failed: {', '.join(result['failed'])}")
    if result["not_run"]:
        parts.append(f"not run (budget): {', '.join(result['not_run'])}")
    return f"{verdict}: {'; '.join(parts)} ({times})"


# --------------------------------------------------------------------------- main
def pick_device(cpu: bool) -> str:
    """``cuda`` or ``cpu``: ``--cpu`` (exported as ``TITAN_LEDGER_DEVICE=cpu`` for the
    children), else ``TITAN_LEDGER_DEVICE``, else CUDA when torch sees it."""
    if cpu:
        os.environ["TITAN_LEDGER_DEVICE"] = "cpu"
    requested = os.environ.get("TITAN_LEDGER_DEVICE", "auto")
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the CPU mode (same as TITAN_LEDGER_DEVICE=cpu)")
    ap.add_argument("--budget", type=float, help="seconds for the checks, counted after run.sh's setup (default: 450 CUDA, 85 CPU)")
    ap.add_argument("--repeats", type=int, help="stock/ledger pairs per compile setting (default 2 CUDA, 1 CPU)")
    ap.add_argument("--workdir", help="logs and results (default $OUT/gpu_pack or outputs/gpu_pack)")
    args = ap.parse_args(argv)
    device = pick_device(args.cpu)
    cuda = device == "cuda"
    plan = dict(PLANS[device])
    if args.budget:
        plan["budget_s"] = args.budget
    if args.repeats:
        plan["repeats"] = args.repeats
    guard = Guard(plan["budget_s"])
    work = Path(args.workdir or (Path(os.environ["OUT"]) / "gpu_pack" if os.environ.get("OUT")
                                 else ROOT / "outputs" / "gpu_pack"))
    work.mkdir(parents=True, exist_ok=True)

    result: dict = {"pack": "titan_ledger GPU validation pack", "mode": device, "config": plan["config"],
                    "budget_s": plan["budget_s"], "workdir": str(work)}
    not_run: list[str] = []

    def fits(need_s: float, what: str) -> bool:
        if guard.left() >= need_s:
            return True
        not_run.append(what)
        return False

    # (a)
    result["flex_max_logit"] = flex_check(guard, plan, work, device) if fits(20, "flex_max_logit") else None

    # (b) + (c) + (d): interleaved pairs, eager first; the first ledger run also checks the signals
    step_time: dict = {}
    stock_runs: list[dict] = []
    ledger_runs: list[dict] = []
    worker_s: list[float] = []
    for compile_ in plan["compile"]:
        tag = "compile" if compile_ else "eager"
        pairs: list[tuple[dict, dict]] = []
        for rep in range(plan["repeats"]):
            pair = []
            for variant in ("stock", "ledger"):
                name = f"{tag}_{variant}_{rep + 1}"
                # a compiled worker compiles (the first one cold): expect longer than eager ones
                need = (max(worker_s) if worker_s else 20.0) * (2.0 if compile_ and rep == 0 else 1.0)
                if not fits(min(need, plan["worker_cap_s"]), name):
                    break
                t = time.time()
                res = worker(guard, plan, work, device, name, variant, compile_,
                             reference=(variant == "ledger" and not compile_ and rep == 0))
                if not compile_:
                    worker_s.append(time.time() - t)
                pair.append(res)
                (stock_runs if variant == "stock" else ledger_runs).append(res)
            if len(pair) == 2:
                pairs.append((pair[0], pair[1]))
            else:
                break
        step_time[tag] = pair_stats(pairs)
        step_time[tag]["runs"] = [{k: r.get(k) for k in ("variant", "ok", "median_step_s", "wall_s_per_step",
                                                         "phases_s", "total_s", "error", "log_tail")}
                                  for p in pairs for r in p]
    result["step_time"] = step_time
    result["syncs"] = sync_summary(stock_runs, ledger_runs, cuda)
    ref_run = next((r for r in ledger_runs if "reference" in r), None)
    result["signals"] = ref_run["reference"] if ref_run else None
    result["per_doc_loss"] = ref_run.get("per_doc_loss", "absent") if ref_run else "absent"
    # (f): after the pairs (their timing is the pack's first purpose)
    result["proof_noise"] = proof_check(guard, plan, work, device, fits)
    failed_runs = [{"variant": r.get("variant"), "compile": r.get("compile"), "error": r.get("error"),
                    "log_tail": r.get("log_tail"), "traceback": r.get("traceback")}
                   for r in stock_runs + ledger_runs if not r.get("ok")]
    if failed_runs:
        result["failed_runs"] = failed_runs

    # verdicts: True (pass), False (fail), None (not run)
    checks: dict[str, bool | None] = {}
    fl = result["flex_max_logit"]
    checks["flex_max_logit"] = None if fl is None else bool(fl.get("ok"))
    checks["signals_vs_fp32_reference"] = None if result["signals"] is None else bool(result["signals"]["ok"])
    pdl = result["per_doc_loss"]
    checks["per_doc_loss_vs_reference"] = bool(pdl["ok"]) if isinstance(pdl, dict) and "ok" in pdl else None
    sy = result["syncs"]
    if not sy.get("counted"):
        checks["syncs_seen_ledger_calls"] = None
    else:
        checks["syncs_seen_ledger_calls"] = sy["ledger_calls_per_step"] > 0
        if cuda:
            checks["no_sync_in_ledger_calls"] = max(sy["in_ledger_calls_per_step"]) == 0
            checks["ledger_step_adds_no_sync"] = sy["added_by_ledger_per_step"] <= 0
    for tag in ("eager", "compile") if cuda else ("eager",):
        st = step_time.get(tag, {})
        if cuda:
            checks[f"overhead_{tag}"] = (st["ratio"] <= st["goal"]) if st.get("pairs") else None
        else:  # CPU: numbers must exist; a shared CPU's timing is no verdict on overhead
            checks[f"timing_{tag}_measured"] = (st["ratio"] > 0) if st.get("pairs") else None
    checks.update(proof_verdicts(result["proof_noise"], cuda))
    if failed_runs:
        checks["all_runs_completed"] = False
    result["checks"] = checks
    result["failed"] = [k for k, v in checks.items() if v is False]
    result["not_run"] = sorted(set(not_run) | {k for k, v in checks.items() if v is None})
    result["guard_hit"] = bool(not_run)
    result["ok"] = not result["failed"] and not result["not_run"]
    result["elapsed_s"] = round(guard.elapsed(), 1)
    result["setup_s"] = setup_s()
    result["time_log"] = guard.log
    result["summary"] = summary_line(result)
    text = json.dumps(result, indent=1, default=str)
    (work / "pack.json").write_text(text)
    print(text, flush=True)
    print(f"gpu-pack: {result['summary']}", file=sys.stderr, flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
