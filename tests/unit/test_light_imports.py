"""The read-only tools import without torch or torchtitan (issue 34, item 5): a reader of
JSONL starts in a fraction of a second; torch comes in only with a function that needs it
(the spike rules run offline, ``--rerun``, ``lookup --text``)."""

import subprocess
import sys

LIGHT = ("diagnose", "lookup", "plot", "report", "rollback", "replay", "export")


def test_read_only_tools_import_without_torch():
    code = ("import sys\n"
            + "".join(f"import titan_ledger.{m}, titan_ledger.tools.{m}\n" for m in LIGHT)
            + "import titan_ledger.tools.decision, titan_ledger.tools.postmortem\n"
            + "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'torchtitan')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_diagnose_help_runs_without_torch():
    code = ("import sys, runpy\n"
            "sys.argv = ['titan_ledger.diagnose', '--help']\n"
            "try:\n"
            "    runpy.run_module('titan_ledger.diagnose', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'LIGHT')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and out.stdout.strip().endswith("LIGHT"), out.stdout[-300:]


def test_diagnose_of_a_recorded_step_runs_without_torch(tmp_path):
    """``diagnose --step`` on a flagged, proven step reads the run's own rule settings from
    its spikes.jsonl header (issue 62: at DP 512 torch's import was 2.5 of the 3.6-7.8 s and
    649 of the 650 MB)."""
    from titan_ledger.format import records

    from .bad_input_ledgers import signal_row

    led = tmp_path / "run" / "ledger"
    led.mkdir(parents=True)
    hdr = {"run_id": "a", "seq": 1, "resumed_from": 0, "time": 1.0, "world_size": 1, "dp_size": 1}
    records.append_segment(led, records.Header(schema="", run_id="a", seq=1, resumed_from=0, time=1.0))
    w = records.RecordWriter(led / records.SIGNALS_FILE, {"schema": records.SIGNALS.id, **hdr})
    for s in range(1, 31):
        w.write(signal_row(s, loss=3.05, grad_norm=10.0, spike=True) if s == 25 else signal_row(s))
    w.close()
    rules = {"zscore": 6.0, "ratio": 3.0, "loss_jump": 0.05, "min_history": 8, "doc_outlier_floor": 0.7}
    e = records.RecordWriter(led / records.SPIKES_FILE, {"schema": records.SPIKES.id, **hdr, "rules": rules})
    e.write({"step": 25, "loss": 3.05, "grad_norm": 10.0, "rules": ["ratio"], "grad_norm_median": 1.0,
             "proof": {"verdict": "optimizer_state", "applied": "original", "why": "Adam's second moment ...",
                       "executions": [{"variant": "original"}, {"variant": "same"}], "seconds": 0.1}})
    e.close()
    code = ("import sys\nfrom titan_ledger.tools import diagnose\n"
            f"rc = diagnose.main([{str(tmp_path / 'run')!r}, '--step', '25'])\n"
            "print('RC', rc, sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'torchtitan'))[:3])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "at step 25: Adam's state" in out.stdout and out.stdout.strip().endswith("RC 0 []"), out.stdout[-600:]
