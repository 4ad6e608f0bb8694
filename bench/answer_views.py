"""What a user reads of a run's incidents, from two source trees, compared (issue 76).

    python bench/answer_views.py --tree DIR --dumps D1 D2 ... --out OUT   # render with DIR's code
    python bench/answer_views.py --compare A B [--mask PATH ...]         # the same text? exit 1 if not

Design decision: a restructure of the answer must leave what a user reads unchanged, and the
ledger-equality bench (``bench/ledger_equal.py``) only compares what the trainer wrote. This
renders the same recorded runs with each tree's code -- ``diagnose DUMP`` (every incident),
and for every step with an answer ``diagnose DUMP --step N`` and ``report DUMP --step N`` (the
page's text, its images and timing left out) -- in a process with ``DIR`` first on
``PYTHONPATH``, and compares the outputs line by line. The dumps are read, never written
(``report`` writes its page under OUT).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path


def _steps(dump: Path) -> list[int]:
    """Every step a recorded answer names (spikes.jsonl's ``answer``), from the file itself."""
    path = dump / "ledger" / "spikes.jsonl"
    out = set()
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        a = e.get("answer") if isinstance(e, dict) else None
        if isinstance(a, dict) and "step" in a:
            out.add(int(a["step"]))
    return sorted(out)


def _page_text(html: str) -> str:
    html = re.sub(r"<img[^>]*>", "<img>", html)
    html = re.sub(r"data:image/[^\"']+", "<image>", html)
    html = re.sub(r"<script.*?</script>", "", html, flags=re.S)
    return re.sub(r"<[^>]+>", "\n", html)


def render(tree: Path, dumps: list[Path], out: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    py = sys.executable
    out.mkdir(parents=True, exist_ok=True)

    def run(args: list[str]) -> str:
        p = subprocess.run([py, "-m", *args], env=env, cwd="/", capture_output=True, text=True, timeout=600)
        return (p.stdout + p.stderr).replace(str(tree), "<TREE>")

    for dump in dumps:
        d = out / dump.name
        d.mkdir(exist_ok=True)
        (d / "diagnose.txt").write_text(run(["titan_ledger.diagnose", str(dump)]))
        for step in _steps(dump):
            (d / f"diagnose_{step}.txt").write_text(run(["titan_ledger.diagnose", str(dump), "--step", str(step)]))
            page = d / f"page_{step}.html"
            run(["titan_ledger.report", str(dump), "--step", str(step), "-o", str(page)])
            (d / f"page_{step}.txt").write_text(_page_text(page.read_text()) if page.exists() else "(no page)")
            page.unlink(missing_ok=True)
        print(f"{dump.name}: {len(_steps(dump))} incidents rendered", flush=True)
    return 0


def compare(a: Path, b: Path, mask: list[str] = ()) -> int:
    """Every rendered file of ``a`` against ``b``'s, line by line; ``mask``: paths that read
    as ``<TREE>`` in both (the tree a run was trained in, which a recorded command names)."""

    def norm(text: str) -> list[str]:
        for m in mask:
            text = text.replace(m, "<TREE>")
        # the datasets library's own progress line when its cache is cold (not the tools' output)
        lines = [x for x in text.splitlines() if not x.startswith("Generating train split")]
        while lines and not lines[-1].strip():
            lines.pop()
        return lines

    bad = 0
    files = sorted({p.relative_to(a) for p in a.rglob("*.txt")} | {p.relative_to(b) for p in b.rglob("*.txt")})
    for rel in files:
        x = norm((a / rel).read_text()) if (a / rel).exists() else ["(missing)"]
        y = norm((b / rel).read_text()) if (b / rel).exists() else ["(missing)"]
        if x != y:
            bad += 1
            print(f"DIFFERS {rel}")
            for line in list(difflib.unified_diff(x, y, lineterm="", n=0))[2:14]:
                print("   ", line[:240])
    print(f"{len(files) - bad} of {len(files)} files equal" + ("" if bad else ": ALL EQUAL"))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path)
    ap.add_argument("--dumps", type=Path, nargs="*", default=[])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", type=Path, nargs=2)
    ap.add_argument("--mask", nargs="*", default=[], help="--compare: paths read as <TREE> in both")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare, mask=a.mask)
    return render(a.tree.resolve(), [d.resolve() for d in a.dumps], a.out)


if __name__ == "__main__":
    raise SystemExit(main())
