"""Does the online detector see one bad DP rank? Detection rate and false flags, measured.

    python bench/bench_detection.py [--quick] [--start cold|warm] [--prove off|acting|all] [--json FILE]

Real runs of the ``debug_cpu`` config (llama3 debugmodel, bundled corpus, 4 rows x
256 tokens per DP rank, FSDP over gloo ranks): one clean run of ``--clean-steps``
steps (false flags: every flagged step is false), and one run per injection --
``--ledger.rehearsal.inject T:R:KIND`` replaces DP rank R's whole batch at step T by one
repeated token (``repeat``) or uniform random tokens (``random``) -- at DP 2 and DP
4. An injection counts as detected when the trainer flags step T (``spikes.jsonl``);
the table also says which rules fired, which DP rank the event named, and whether
``diagnose`` (without ``--step``) calls step T ``bad_data``. Flags at other steps of an
injection run count as false flags too.

``--start warm``: every run (the clean one too) starts from the warm base's weights
(``bench/warm_base.py``, built first if missing; fresh optimizer, LR schedule and detector
history), where a random or repeated batch is far from what the model predicts; the
cold start's model is at the unigram level, where a random batch scores like text.

The rehearsals of issue 52 (``--cases new``; ``all`` is both): ``bitflip@F`` -- one real
bit of one gradient element on DP rank R at step T, chosen to move the step's grad norm
F x (1.5, 2, 3) -- and ``split``: one degenerate document (" the" repeated) planted in
the corpus across two DP ranks' batches of one step (``zoo.plant_across``: the first
step from T with a document boundary in rank 0's batch; it ends 256 tokens into rank
1's), trained from that corpus in order (``--dataloader.source indexed``).

``--prove off|acting|all``: ``--ledger.proof.scope`` for every run (its own folder names,
``prove_<mode>_``); each injection row adds the proof of step T (``proof_verdict``;
``proof_dp_rank`` the rank it convicted; ``proof_tier`` whether the step was an acting
flag or a note) against what is expected (:func:`expected`): ``hardware`` for a flip
(one of 1.5x may go unseen: the most sensitive rule wants 1.8x), ``bad_data`` naming
the planted document for ``split``, and for a replaced batch ``bad_data`` when its
first update was abnormal, ``outlier`` when it was not (a batch that trains like any
other is not an incident). The clean run adds its proofs by tier and verdict (none may
find a cause).

Takes about 20 minutes on 2 cores for the first cases (``--quick``: DP 2 only, fewer
steps); the new cases about 10 more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.zoo import plant_across, proof_counts, proof_verdict, read_proofs  # noqa: E402
from titan_ledger.format.reader import RunLedger  # noqa: E402

# the launch prefix: $TITAN_LEDGER_TORCHRUN (a site wrapper; the test suite's warm launcher) or torchrun
from titan_ledger.tools.runs import torchrun_prefix  # noqa: E402


def train(dump: Path, nproc: int, steps: int, extra: list[str]) -> float:
    env = dict(os.environ, TITAN_LEDGER_DEVICE="cpu", OMP_NUM_THREADS="1", WANDB_MODE="offline")
    cmd = [*torchrun_prefix(), "--standalone", "--nproc_per_node", str(nproc),
           "-m", "titan_ledger.train", "--job.config_file",
           str(ROOT / "train_configs/debug_cpu.toml"), "--training.steps", str(steps),
           "--dump_folder", str(dump), *extra]
    if nproc != 2:
        cmd += ["--parallelism.data_parallel_shard_degree", str(nproc)]
    t0 = time.monotonic()
    with open(dump.parent / f"{dump.name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"training failed (exit {rc}); log: {dump.parent / f'{dump.name}.log'}")
    return time.monotonic() - t0


def diagnose_verdicts(dump: Path) -> dict[int, dict]:
    out = subprocess.run([sys.executable, "-m", "titan_ledger.diagnose", str(dump), "--json"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, TITAN_LEDGER_DEVICE="cpu"))
    if out.returncode != 0:
        return {}
    return {r["step"]: r for r in json.loads(out.stdout)["spikes"]}


def grad_norm_factor(dump: Path, step: int) -> float | None:
    """How far the step's first execution moved the grad norm: its recorded grad norm over
    the median of the 8 steps before (what a ``bitflip@F`` aimed at, as the ledger saw it)."""
    from statistics import median

    from titan_ledger.format.records import read_ledger

    rows = read_ledger(dump / "ledger" / "signals.jsonl").by_step()
    before = [rows[s]["grad_norm"] for s in range(step - 8, step) if s in rows and rows[s].get("grad_norm")]
    at = rows.get(step, {}).get("grad_norm")
    return round(at / median(before), 3) if at and before else None


def rank_named(row: dict) -> bool:
    """The proof named the rehearsal's DP rank(s) (pure): a flip's rank as the ranks whose
    executions differed, a split document's two ranks, a replaced batch's rank."""
    if row["kind"].startswith("bitflip"):
        return row.get("proof_dp_ranks") == [row["rank"]]
    if row["kind"] == "split":
        return row.get("proof_dp_ranks") == [row["rank"], row["rank"] + 1]
    return row.get("proof_dp_rank") == row["rank"]


def expected(kind: str, abnormal: bool | None) -> str | None:
    """The proof verdict a rehearsal should get (pure): a bit flip ``hardware``; a planted
    document ``bad_data``; a replaced batch ``bad_data`` when the step's first update
    was abnormal, ``outlier`` when it was normal (``abnormal`` None: not proven)."""
    if kind.startswith("bitflip"):
        return "hardware"
    if kind == "split":
        return "bad_data"
    if abnormal is None:
        return None
    return "bad_data" if abnormal else "outlier"


def cases_of(which: str, quick: bool) -> list[tuple[int, int, int, str]]:
    """``(dp, step, rank, kind)`` of each injection run (pure)."""
    steps = (12, 30) if quick else (12, 30, 80)
    old = [(2, step, 1, kind) for step in steps for kind in ("repeat", "random")]
    if not quick:
        old += [(4, 30, 2, kind) for kind in ("repeat", "random")]
    new = [(2, step, 1, f"bitflip@{f}") for step in (12, 30) for f in ("1.5", "2", "3")]
    new += [(2, step, 0, "split") for step in (12, 30)]
    return {"old": old, "new": new, "all": old + new}[which]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clean-steps", type=int, default=300)
    ap.add_argument("--folder", type=Path, help="keep the runs here (default: a temp folder)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cases", choices=("old", "new", "all"), default="all",
                    help="old: replaced batches (repeat, random); new: bit flips of 1.5/2/3x and a document "
                         "split across DP ranks (issue 52); all: both")
    ap.add_argument("--start", choices=("cold", "warm"), default="cold",
                    help="cold: fresh init; warm: the warm base's weights (bench/warm_base.py)")
    ap.add_argument("--prove", choices=("off", "acting", "all"),
                    help="--ledger.proof.scope for every run (default: the config's, acting), and each "
                         "run's proofs read back: an injection's must be bad_data on the injected rank, the "
                         "clean run's none harmful")
    a = ap.parse_args(argv)
    base = a.folder or Path(tempfile.mkdtemp(prefix="bench_detection_"))
    base.mkdir(parents=True, exist_ok=True)
    start: list[str] = []
    pre = ""
    if a.start == "warm":
        from bench import warm_base

        start, pre = warm_base.start_flags(warm_base.ensure(log=print)), "warm_"
    if a.prove:
        start, pre = [*start, "--ledger.proof.scope", a.prove], f"{pre}prove_{a.prove}_"
    cases = cases_of(a.cases, a.quick)
    if a.quick:
        a.clean_steps = min(a.clean_steps, 100)
    results = {"clean": None, "injections": []}
    dump = base / f"{pre}clean_dp2_{a.clean_steps}"
    if not (dump / "ledger" / "signals.jsonl").exists():
        train(dump, 2, a.clean_steps, start)
    flags = RunLedger(dump).spike_events()
    results["clean"] = {"dp": 2, "steps": a.clean_steps, "start": a.start, "false_flags": len(flags),
                        "flagged": [(e["step"], e["rules"]) for e in flags]}
    if a.prove:
        proofs = read_proofs(dump)
        results["clean"].update(proof_verdict(None, None, proofs), proof_counts=proof_counts(proofs),
                                proof_steps=[[p["step"], p["tier"], p["verdict"]] for p in proofs])
    print(f"clean DP 2, {a.clean_steps} steps: {len(flags)} false flags {results['clean']['flagged']}"
          + (f"; proofs {results['clean']['proof_counts']} {results['clean']['proof_steps']}" if a.prove else ""),
          flush=True)
    for dp, step, rank, kind in cases:
        dump = base / f"{pre}inj_dp{dp}_{kind}_{step}"
        planted = None
        if kind == "split":  # the corpus decides the step: the first with a boundary near the rank edge
            planted = plant_across(base / f"corpus_split_{step}", step, dp, 4, 256, 256)
            step, rank = planted.step, planted.dp_ranks[0]
            flags = ["--dataloader.source", "indexed", "--dataloader.paths", str(planted.prefix),
                     "--dataloader.no_shuffle"]
        else:
            flags = ["--ledger.rehearsal.inject", f"{step}:{rank}:{kind}"]
        if not (dump / "ledger" / "signals.jsonl").exists():
            train(dump, dp, step + 4, [*start, *flags])
        led = RunLedger(dump)
        ev = led.spike_events()
        at = [e for e in ev if e["step"] == step]
        noted = [e for e in led.note_events() if e["step"] == step]
        verdict = diagnose_verdicts(dump).get(step, {})
        row = {"dp": dp, "step": step, "rank": rank, "kind": kind, "detected": bool(at),
               "noted": noted[0]["notes"] if noted else (at[0].get("notes") or [] if at else []),
               "rules": at[0]["rules"] if at else [], "named_rank": at[0].get("suspect_dp_rank") if at else None,
               "diagnose": verdict.get("cause"), "diagnose_rank": verdict.get("rank"),
               "other_flags": sorted(e["step"] for e in ev if e["step"] != step)}
        if planted is not None:
            row.update(split_doc=planted.doc, split_tokens=list(planted.tokens))
        if a.prove:  # the proof of step T itself (the injection is that one step)
            proofs = read_proofs(dump)
            mine = [p for p in proofs if p["step"] == step]
            want = expected(kind, mine[0]["abnormal"] if mine else None)
            row.update(proof_verdict("bad_data", step, proofs, before=0, after=0),
                       grad_norm_factor=grad_norm_factor(dump, step), expected=want)
            row["proof_match"] = row["proof_verdict"] == want and want is not None and (
                planted is None or [["split", planted.doc]] == row["proof_documents"])
        results["injections"].append(row)
        print(json.dumps(row), flush=True)
    inj = results["injections"]
    results["summary"] = {
        "detected": f"{sum(r['detected'] for r in inj)}/{len(inj)}",
        "detected_or_noted": f"{sum(r['detected'] or bool(r['noted']) for r in inj)}/{len(inj)}",
        "rank_named": f"{sum(r['named_rank'] == r['rank'] for r in inj)}/{len(inj)}",
        "diagnose_bad_data": f"{sum(r['diagnose'] == 'bad_data' for r in inj)}/{len(inj)}",
        "false_flags_clean": results["clean"]["false_flags"],
        "false_flags_in_injection_runs": sum(len(r["other_flags"]) for r in inj),
    }
    if a.prove:
        results["summary"].update({
            "prove": a.prove,
            "proof_as_expected": f"{sum(r['proof_match'] for r in inj)}/{len(inj)}",
            "proof_rank_named": f"{sum(rank_named(r) for r in inj)}/{len(inj)}",
            "proof_verdicts_at_injection": [r["proof_verdict"] for r in inj],
            "proof_harmful_elsewhere": {f"dp{r['dp']}_{r['kind']}_{r['step']}": r["proof_harmful_elsewhere"]
                                        for r in inj if r["proof_harmful_elsewhere"]},
            "clean_proofs": results["clean"]["proof_counts"],
            "clean_proof_match": results["clean"]["proof_match"]})
    print(json.dumps(results["summary"]))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
