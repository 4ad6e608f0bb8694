"""The stall rule replayed over recorded ledgers: its false alarms on clean runs, its hits on
the real set, without training anything again (issue 61 item 2).

    python bench/stall_replay.py DUMP_OR_LEDGER [...] [--json]

Design decision: the stall rule (``components.detection.stall``) is pure and reads only the
written signals rows (loss, max attention logit), so running it over a ledger gives the
flags the trainer would raise on that run with the rule's defaults -- whatever version of
the code trained it. A folder that holds several runs (``bench/adversarial.py``'s,
``bench/false_alarms.py``'s, ``bench/zoo.py``'s) is searched for their ledgers. Each run
prints its trained steps, its flags (step, kind, the best window median, the median max
logit) and the steps a flag needs at least (``window`` x (``patience`` + 1)); the last
line sums the steps and the flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_ledger.components.detection.stall import StallConfig, StallWatch  # noqa: E402
from titan_ledger.format import records  # noqa: E402
from titan_ledger.format.reader import RunLedger  # noqa: E402


def ledgers(paths: list[str]) -> list[Path]:
    """Every ledger folder under ``paths`` (a dump folder, a ledger folder, or a folder of runs)."""
    out = []
    for p in map(Path, paths):
        out += sorted({f.parent for f in p.rglob(records.SIGNALS_FILE)})
    return out


def replay(folder: Path, config: StallConfig) -> dict:
    rows = RunLedger.at(folder).trained_rows()
    watch = StallWatch(config)
    flags = [ev for row in rows if (ev := watch.observe(row)) is not None]
    return {"run": str(folder.parent), "steps": len(rows),
            "flags": [[ev["step"], ev["stall"]["kind"], ev["stall"]["best"], ev["stall"]["max_logit"]] for ev in flags]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="dump folders, ledger folders, or folders holding runs")
    ap.add_argument("--json", action="store_true", help="one JSON object per run, then the total")
    args = ap.parse_args(argv)
    config = StallConfig()
    found = ledgers(args.paths)
    if not found:
        print(f"stall_replay: error: no {records.SIGNALS_FILE} under {', '.join(args.paths)}", file=sys.stderr)
        return 2
    total_steps = total_flags = 0
    for folder in found:
        r = replay(folder, config)
        total_steps += r["steps"]
        total_flags += len(r["flags"])
        print(json.dumps(r) if args.json else f"{r['run']}: {r['steps']} steps, flags {r['flags'] or 'none'}")
    least = config.window * (config.patience + 1)
    summary = {"runs": len(found), "steps": total_steps, "flags": total_flags, "least_steps_to_flag": least}
    print(json.dumps(summary) if args.json else
          f"{len(found)} runs, {total_steps} steps, {total_flags} stall flags (a flag needs >= {least} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
