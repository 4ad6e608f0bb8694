"""Retired: folded into ``bench/bench_ledger_cost.py`` (its paired instrument).

    python bench/bench_ledger_overhead.py [--steps 20] [--repeats 8] [--warmup 3] [...]

is ``python bench/bench_ledger_cost.py --only paired --variants ledger_no_max_logit
[...]``: stock ``Trainer`` vs ``LedgerTrainer`` (and the ledger without max_logit),
per-step process CPU time with the trainers' steps interleaved in one process, the ratio
with a 95% interval. The old design (2-rank torchrun runs, torchtitan's wall-clock
step timer, 3 repeats) moved ±40% between runs on a 2-core machine; see
bench_ledger_cost.py for why and what replaced it. Every argument is passed through.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    new = Path(__file__).resolve().with_name("bench_ledger_cost.py")
    print("bench_ledger_overhead.py is retired; running bench_ledger_cost.py --only paired", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, str(new), "--only", "paired", "--variants", "ledger_no_max_logit",
                              *sys.argv[1:]])
