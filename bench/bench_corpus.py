"""Indexed corpus at scale: prepare throughput, index build, reopen, memory, fetch rate.

    python bench/bench_corpus.py [--tokens 100000000] [--prepare-tokens 5000000] [--workers 2]

1. prepare: synthetic English-like JSONL (~``--prepare-tokens`` tokens) through
   ``titan_ledger.prepare`` with the bundled tokenizer and ``--workers`` processes.
2. scale: a synthetic ``--tokens`` corpus written straight to .bin/.idx (random
   token ids, document lengths 50..4000), then: epoch-0 index build time,
   reopen time (open + first row, index arrays already cached), resident memory
   of the open corpus (and after the fetches, which page in what they touch), and
   random-sample fetch rate at seq_len 2048.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_ledger.data.indexed import Blend, IndexedCorpus, IndexedWriter  # noqa: E402


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_prepare(tmp: Path, tokens: int, workers: int) -> dict:
    rnd = random.Random(0)
    words = [w.strip(".,:;()'\"") for w in (ROOT / "README.md").read_text().split() if w.isascii()]
    words = [w for w in words if w] or ["token"]
    src = tmp / "synthetic.jsonl"
    chars = tokens * 4  # ~4 characters per token for this tokenizer on English-ish text
    with open(src, "w") as f:
        written = 0
        while written < chars:
            doc = " ".join(rnd.choice(words) for _ in range(rnd.randint(50, 800)))
            f.write(json.dumps({"text": doc}) + "\n")
            written += len(doc)
    out = subprocess.run([sys.executable, "-m", "titan_ledger.prepare", "--input", str(src),
                          "--output-prefix", str(tmp / "prepared"), "--workers", str(workers)],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    meta = json.loads((tmp / "prepared.json").read_text())
    return {"prepare_tokens": meta["tokens"], "prepare_s": meta["seconds"],
            "prepare_tokens_per_s": meta["tokens_per_s"], "workers": workers,
            "input_mb": round(src.stat().st_size / 2 ** 20, 1)}


def bench_scale(tmp: Path, tokens: int) -> dict:
    rng = np.random.default_rng(0)
    prefix = tmp / "big"
    t0 = time.perf_counter()
    w = IndexedWriter(prefix, np.uint16)
    left = tokens
    while left > 0:
        lens = np.minimum(rng.integers(50, 4000, size=4096), left)
        lens = lens[np.cumsum(lens) <= left] if left > 4000 else lens[:1]
        block = rng.integers(3, 2048, size=int(lens.sum()), dtype=np.uint16)
        o = 0
        for n in lens:
            w.add(block[o:o + n])
            o += n
        left -= int(lens.sum())
    w.finish()
    write_s = time.perf_counter() - t0
    rss0 = rss_mib()
    t0 = time.perf_counter()
    c = IndexedCorpus(prefix, seq_len=2048, seed=1234)
    c.row(0)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    c2 = IndexedCorpus(prefix, seq_len=2048, seed=1234)
    blend = Blend([c2], [1.0])
    blend.row(0)
    reopen_s = time.perf_counter() - t0
    rss_open = rss_mib() - rss0
    idx = rng.integers(0, c2.samples_per_epoch * 3, size=20000)
    t0 = time.perf_counter()
    for i in idx:
        blend.row(int(i))
    fetch = len(idx) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in idx[:5000]:
        blend.tag(int(i))
    tag_rate = 5000 / (time.perf_counter() - t0)
    return {"tokens": tokens, "documents": c.n_docs, "bin_mb": round(os.path.getsize(f"{prefix}.bin") / 2 ** 20),
            "write_s": round(write_s, 2), "index_build_s": round(build_s, 3),
            "reopen_s": round(reopen_s, 4), "rss_open_mib": round(rss_open, 1),
            "rss_after_fetch_mib": round(rss_mib() - rss0, 1),
            "fetch_rows_per_s": round(fetch), "fetch_tokens_per_s": round(fetch * 2048),
            "tag_lookups_per_s": round(tag_rate)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=10 ** 8)
    ap.add_argument("--prepare-tokens", type=int, default=5 * 10 ** 6)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        res = {**bench_prepare(tmp, a.prepare_tokens, a.workers), **bench_scale(tmp, a.tokens)}
    for k, v in res.items():
        print(f"{k:<22}{v}")


if __name__ == "__main__":
    main()
