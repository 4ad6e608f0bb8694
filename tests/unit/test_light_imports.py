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
