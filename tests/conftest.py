"""Test-session setup: the CPU rehearsal backend, installed before torchtitan imports.

Every test in this suite runs on the CPU backend (also on a GPU machine), so the
numbers it checks are the ones CI sees.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TITAN_LEDGER_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from titan_ledger import backend  # noqa: E402

backend.install("cpu")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
