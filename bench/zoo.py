"""Spike zoo (a first part of issue 14): spikes produced for real, and what ``diagnose`` names.

    python bench/zoo.py [--only NAME] [--json] [--folder DIR]

Each scenario trains the ``debug_cpu`` model (FSDP over 2 gloo ranks, 4 rows x 256
tokens per rank, checkpoints every 10 steps) for ``STEPS`` steps, then runs
``diagnose --json`` (the heuristics) and ``diagnose --rerun --json`` (the proof), and
prints one object per scenario: ``scenario``, ``true_cause``, ``named_cause``,
``named_cause_rerun``, ``true_step``, ``flagged_step`` (null when nothing was flagged;
``true_cause`` null for the clean control) and, for bad data, the true and named
documents.

Scenarios in this first part (the others the issue lists -- learning rate, logit
growth, optimizer state, precision -- and the held-out variants are not built yet):

* ``bad_data_repeat`` / ``bad_data_random``: an indexed corpus prepared from the
  bundled one with ONE degenerate document planted (one token repeated; random
  printable characters) at a document index the sequential order (``shuffle = false``)
  reaches around step ``PLANT_STEP``; no runtime injection. The true step is the first
  step whose data ledger lists the planted document.
* ``hardware``: ``--ledger.inject T:0:bitflip`` (one gradient bit, once).
* ``clean``: the bad-data corpus without the planted document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 40
PLANT_STEP = 28
TOKENS_PER_STEP = 2 * 4 * 256
CORPUS = ROOT / "titan_ledger" / "assets" / "corpus" / "data.jsonl"
SCENARIOS = ("bad_data_repeat", "bad_data_random", "hardware", "clean")


def env() -> dict:
    return dict(os.environ, TITAN_LEDGER_DEVICE="cpu", OMP_NUM_THREADS="1", WANDB_MODE="offline",
                HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")


def build_corpus(folder: Path, plant: str | None) -> tuple[Path, int | None]:
    """The bundled documents in order, one degenerate document inserted where the
    sequential order reaches it at about step PLANT_STEP; returns (prefix, its doc id)."""
    from titan_ledger.prepare import load_tokenizer

    tok = load_tokenizer(str(ROOT / "titan_ledger" / "assets" / "tokenizer"))
    docs = [json.loads(x) for x in CORPUS.read_text().splitlines() if x.strip()]
    out, seen, planted = [], 0, None
    target = PLANT_STEP * TOKENS_PER_STEP
    for d in docs:
        if plant and planted is None and seen >= target:
            rnd = random.Random(0)
            text = (" the" * 1200 if plant == "repeat"
                    else "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz0123456789{}[]<>#@!?") for _ in range(4000)))
            planted = len(out)
            out.append({"text": text})
        out.append({"text": d["text"]})
        seen += len(tok.encode(d["text"], add_bos=True, add_eos=True))
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "zoo.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in out))
    prefix = folder / "zoo"
    subprocess.run([sys.executable, "-m", "titan_ledger.prepare", "--input", str(src), "--output-prefix",
                    str(prefix), "--workers", "0"], cwd=ROOT, env=env(), check=True, capture_output=True)
    return prefix, planted


def train_args(prefix: Path | None) -> list[str]:
    args = ["--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml"), "--training.steps", str(STEPS),
            "--checkpoint.enable", "--checkpoint.interval", "10"]
    if prefix is not None:
        args += ["--dataloader.source", "indexed", "--dataloader.paths", str(prefix), "--dataloader.no_shuffle"]
    return args


def run(name: str, base: Path) -> dict:
    dump = base / name
    shutil.rmtree(dump, ignore_errors=True)
    true_cause, true_step, true_docs, extra = None, None, [], []
    prefix = None
    if name.startswith("bad_data") or name == "clean":
        prefix, planted = build_corpus(base / f"corpus_{name}", None if name == "clean" else name.split("_")[-1])
        if planted is not None:
            true_cause, true_docs = "bad_data", [planted]
    if name == "hardware":
        true_cause, true_step = "hardware", PLANT_STEP
        extra = ["--ledger.inject", f"{PLANT_STEP}:0:bitflip"]
    args = train_args(prefix)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "titan_ledger.train", *args, *extra, "--dump_folder", str(dump)]
    with open(base / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT).returncode
    out = {"scenario": name, "true_cause": true_cause, "train_rc": rc}
    from titan_ledger.reader import RunLedger

    led = RunLedger(dump)
    if true_docs:
        steps = sorted(s for r in led.data.ranks() for s in range(1, STEPS + 1)
                       if led.data.at(s, r) and any(seg.doc in true_docs for t in led.data.at(s, r).tags
                                                    for seg in t.segments))
        true_step = steps[0] if steps else None
        out["true_documents"] = true_docs
    flagged = led.spike_steps()
    out.update(true_step=true_step, flagged_steps=flagged)
    diag = subprocess.run([sys.executable, "-m", "titan_ledger.diagnose", str(dump), "--json"], cwd=ROOT,
                          env=env(), capture_output=True, text=True)
    verdicts = json.loads(diag.stdout)["spikes"] if diag.returncode == 0 else []
    at = [v for v in verdicts if true_step is not None and abs(v["step"] - true_step) <= 1] or verdicts[:1]
    out["flagged_step"] = at[0]["step"] if at else None
    out["named_cause"] = at[0]["cause"] if at else None
    out["named_documents"] = sorted({d["doc"] for d in at[0].get("documents", [])}) if at else []
    out["named_cause_rerun"] = None
    if at:
        rr = subprocess.run([sys.executable, "-m", "titan_ledger.diagnose", str(dump), "--step",
                             str(at[0]["step"]), "--rerun", "--json", "--", *args, *extra], cwd=ROOT,
                            env=env(), capture_output=True, text=True)
        if rr.returncode == 0:
            v = json.loads(rr.stdout.strip().splitlines()[-1])["spikes"][0]
            out["named_cause_rerun"] = (v.get("rerun") or {}).get("cause")
        else:
            out["rerun_error"] = (rr.stderr or rr.stdout)[-300:]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=SCENARIOS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--folder", type=Path, default=Path("/tmp/titan_ledger_zoo"))
    a = ap.parse_args(argv)
    a.folder.mkdir(parents=True, exist_ok=True)
    for name in [a.only] if a.only else SCENARIOS:
        res = run(name, a.folder)
        print(json.dumps(res) if a.json else
              f"{name:<16} true {res['true_cause']!s:<9} step {res['true_step']!s:<5} flagged "
              f"{res['flagged_step']!s:<5} heuristic {res['named_cause']!s:<16} rerun {res['named_cause_rerun']}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
