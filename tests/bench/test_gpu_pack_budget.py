"""The GPU pack's budget and its one summary line, without running a check: a budget that
ran out before the first check (a fresh machine's setup took it, issue 37) must say
"CHECKED NOTHING" in one line, not ``ok: false`` with ``failed: []``."""

import contextlib
import importlib.util
import io
import json

from helpers import ROOT


def _pack():
    spec = importlib.util.spec_from_file_location("gpu_pack", ROOT / "bench" / "device" / "pack.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_run_that_checked_nothing_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PACK_SETUP_S", "107.4")  # as run.sh measured it on a fresh machine
    monkeypatch.delenv("PACK_T0", raising=False)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = _pack().main(["--cpu", "--budget", "1", "--workdir", str(tmp_path)])
    r = json.loads(out.getvalue())
    assert rc == 1 and not r["ok"] and r["failed"] == [] and r["guard_hit"]
    assert set(r["checks"].values()) == {None} and set(r["checks"]) <= set(r["not_run"]) and r["setup_s"] == 107.4
    lines = [x for x in err.getvalue().splitlines() if x.startswith("gpu-pack: ")]
    assert lines == [f"gpu-pack: {r['summary']}"], err.getvalue()
    assert lines[0].startswith("gpu-pack: CHECKED NOTHING: the budget ran out before the first check "
                               "(setup 107 s, checks 0 s of a 1 s budget)") and "--budget" in lines[0]
    assert json.loads((tmp_path / "pack.json").read_text()) == r


def test_the_summary_counts_what_passed_failed_and_did_not_run():
    pack = _pack()
    r = {"checks": {"a": True, "b": False, "c": None}, "failed": ["b"], "not_run": ["c"], "ok": False,
         "setup_s": None, "elapsed_s": 80.2, "budget_s": 85.0}
    assert pack.summary_line(r) == "NOT OK: 1 of 3 checks passed; failed: b; not run (budget): c " \
                                   "(checks 80 s of a 85 s budget)"
    r.update(checks={"a": True}, failed=[], not_run=[], ok=True, setup_s=3.0)
    assert pack.summary_line(r) == "ok: 1 of 1 checks passed (setup 3 s, checks 80 s of a 85 s budget)"


def test_proof_noise_verdicts():
    """(f): a clean step proven hardware fails; a run the guard killed is not run, not failed;
    on CUDA the deterministic run must be bit-equal; on CPU the rehearsed floor must show."""
    pv = _pack().proof_verdicts
    p = lambda verdict="outlier", bit=False, floor=3e-6: {"step": 2, "verdict": verdict, "bit_equal": bit,  # noqa: E731
                                                           "noise_floor": floor}
    run = lambda proofs, floor: {"ok": True, "proofs": proofs, "hardware": sum(x["verdict"] == "hardware"  # noqa: E731
                                                                               for x in proofs),
                                 "bit_equal": sum(bool(x["bit_equal"]) for x in proofs), "noise_floor_max": floor}
    assert pv(None, False) == {"proof_no_hardware_on_clean_steps": None, "proof_measures_rehearsed_noise": None}
    good = {"proof_rehearsed_noise": run([p(), p()], 3e-6)}
    assert set(pv(good, False).values()) == {True}
    assert pv({"proof_rehearsed_noise": run([p(), p("hardware")], 3e-6)}, False)[
        "proof_no_hardware_on_clean_steps"] is False
    assert pv({"proof_rehearsed_noise": run([p(floor=None)], None)}, False)["proof_measures_rehearsed_noise"] is False
    cuda = {"proof_default": run([p()], 1e-5), "proof_deterministic": run([p(bit=True, floor=None)], None)}
    assert set(pv(cuda, True).values()) == {True}
    cuda["proof_deterministic"] = run([p(bit=False)], 1e-7)
    assert pv(cuda, True)["proof_bit_equal_when_deterministic"] is False
    cuda["proof_deterministic"] = {"ok": False, "timed_out": True, "flags": []}
    assert pv(cuda, True) == {"proof_no_hardware_on_clean_steps": True, "proof_bit_equal_when_deterministic": None}
