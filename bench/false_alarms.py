"""False alarms of the spike rules on clean runs (issue 24, item 2), every rule counted separately.

    python bench/false_alarms.py [--quick] [--json] [--folder DIR] [--steps N] [--seeds 0 1 ...]
                                 [--corpus text hetero copy] [--dp 2 4] [--start cold warm]
                                 [--local-batch-size B] [--seq-len L]
                                 [--replay-only [--rules KEY=VALUE ...]] [--prove off|acting|all]

Clean runs -- no fault of any kind: no injection, no planted document, the LR
schedule untouched -- of the ``debug_cpu`` model (``train_configs/debug_cpu.toml``:
llama3 debugmodel, fp32, FSDP over gloo ranks, LR 8e-4, warmup 2, linear decay to 0
over the last 80 % of the steps, ``--ledger.response.action none`` so a flag only
records) over the grid {corpus} x {DP size} x {start} x {seed}:

* corpus (``bench/corpora.py``): ``text`` (the bundled docstrings), ``hetero`` (the
  heterogeneous clean corpus), ``copy`` (zoo's copy corpus); an indexed corpus read
  in a seeded shuffled order (``--dataloader.seed`` = seed);
* DP size: 2 or 4 gloo ranks (``--parallelism.data_parallel_shard_degree``);
* start: ``cold`` (fresh init, ``--debug.seed`` = seed) or ``warm`` (the weights of
  the warm base, ``bench/warm_base.py``, loaded model-only at step 1 with a fresh
  optimizer, LR schedule and detector history);
* seed.

Every flag is false (there is nothing to find). Per rule and tier (``spike_rules.RULES``;
a step flagged by two rules counts once for each) it prints the acting flags, their
rate per 10^4 clean steps and the steps (``run@step``), and the notes. ``acting_flags``
counts steps with an acting rule (an alert each, and with ``[ledger.response] policy = "act"`` an action);
``note_steps`` the steps with notes only (recorded, never acted on). ``clean_steps``
counts trained steps, all of them (the history rules abstain for their first steps:
``min_history`` 8, the z-score rule ``window/2`` = 64).

``--prove all`` (``--ledger.proof.scope``; default: the config's, ``acting``) proves
every flagged step and every note in step (issue 35 item 7): ``proofs`` counts them,
``proofs_by_verdict`` per tier and verdict, ``proofs_found_cause`` each proof that found a
harmful cause (``bad_data``/``hardware``: on a clean run each one is wrong) and
``promoted_notes`` the notes such a proof turned into alarms (counted as notes here: the
detector's decision was a note). The proofs are read from ``spikes.jsonl`` through the
format's reader (``bench/zoo.py``'s ``read_proofs``), also by ``--replay-only``.

Offline replay: ``replay(dump)`` runs ``SpikeDetector`` over the recorded ledger with
the run's own rule config (spikes.jsonl's header) -- the global loss and grad norm
from ``signals.jsonl``, the per-DP-rank document summary (median segment loss,
highest and lowest document mean loss, ranked documents) from each
``data_dp<r>.jsonl`` row's ``doc_loss``, each DP rank's loss (``rank_loss``) from
``rank<r>.jsonl`` -- and ``check_replay`` compares it with the online decision step by
step (the ``spike`` field of every signals row, and the rules of every spikes.jsonl
event). The ledger rounds
the document summary (median to 1e-6, loss sums to 1e-4), so replayed statistics
can differ from the online ones in the 7th significant digit; the check reports
the largest difference in the flagged steps' statistics. Once proven identical on
the recorded runs, other rule settings can be measured on the same ledgers
without training: ``--replay-only`` re-reads a folder (``--recorded``: every run in it,
whatever grid trained it), ``--rules doc_outlier_floor=1.0 ...`` counts the replay
under changed settings; ``--rules notes= separation_gate=0 zscore_min_ratio=0
doc_tail_spread=false grad_novelty=0`` is the detector before the tiers (``BEFORE_TIERS``).
``--compare-tiers DUMP ...`` replays any recorded runs (clean, zoo, detection) before
and with the tiers and prints one JSON line per run.

``--quick --json``: DP 2 on each corpus (warm where the warm base is already built,
else cold) and one DP 4 run, ``--training.local_batch_size 2 --training.seq_len 128``
(a quarter of debug_cpu's tokens per rank, so that >= 1,000 fresh clean steps fit in
15 minutes on 2 cores), then one JSON line: ``clean_steps``, ``acting_flags``,
``flags_by_rule``, ``per_1e4``, ``steps``, ``replay_identical``, ``seconds``, ``runs``.
The full measurement (default): 3 corpora x DP 2, 4 x cold, warm x seeds 0, 1 at 850
steps = 20,400 clean steps at debug_cpu's 4 x 256 tokens per rank; runs already
recorded under ``--folder`` are reused (their ledgers are the record).

Measured here (2 shared cores, load average 3-4): ``--quick --json`` 1,050 fresh
steps in 430 s (DP 2 at 2 x 128: 0.33 s/step, DP 4: 0.8 s/step, ~20 s start per
run); 33 flags, all from the document rules (doc_low 29, doc_high 4), 31 of them in
the heterogeneous-corpus runs; the replay matched the online flags on all 1,050
steps. At 2 rows per rank most ranks hold two ranked segments, and torch's median
of two is the lower one, so doc_low's statistic (median over lowest) is 0 on most
steps, its history's MAD is 0, and only ``doc_outlier_floor`` (0.7) guards it --
the warm model's source-code and prose documents differ by more than 2x. The
full grid at 4 x 256 costs about 0.6-1.3 s/step at DP 2 and 1.5 s/step at DP 4
here: 6.5-7.5 hours.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import corpora, warm_base  # noqa: E402
from bench.warm_base import read_rows  # noqa: E402
from bench.zoo import read_proofs  # noqa: E402

# the launch prefix: $TITAN_LEDGER_TORCHRUN (a site wrapper; the test suite's warm launcher) or torchrun
from titan_ledger.tools.runs import torchrun_prefix  # noqa: E402

RULES = ("zscore_loss", "zscore_grad_norm", "ratio", "non_finite", "rank_separation", "doc_high",
         "doc_low", "grad_jump", "grad_move", "rank_loss")  # titan_ledger.components.detection.spike_rules.RULES (checked in the tests)
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
OUT = ROOT / "outputs" / "false_alarms"
# replayed vs online statistics of an event (the ledger rounds the doc summary: median to
# 1e-6, loss sums to 1e-4; rank separation's bound, median + 3 x (q90 - median) over its
# history, amplifies that: 4e-5 measured on copy_dp4_cold, every decision identical)
STAT_TOL = 1e-4


@dataclass(frozen=True)
class Run:
    corpus: str
    dp: int
    start: str  # cold | warm
    seed: int
    steps: int
    local_batch_size: int = 4
    seq_len: int = 256

    @property
    def name(self) -> str:
        return (f"{self.corpus}_dp{self.dp}_{self.start}_s{self.seed}_{self.steps}st_"
                f"{self.local_batch_size}x{self.seq_len}")


def recorded_runs(folder: Path) -> list[Run]:
    """Every run recorded under ``folder`` whatever grid trained it (by ``Run.name``)."""
    import re

    out = []
    for d in sorted(folder.iterdir()) if folder.is_dir() else []:
        m = re.fullmatch(r"([a-z]+)_dp(\d+)_(cold|warm)_s(\d+)_(\d+)st_(\d+)x(\d+)", d.name)
        if m and d.is_dir():
            c, dp, start, seed, steps, lbs, seq = m.groups()
            out.append(Run(c, int(dp), start, int(seed), int(steps), int(lbs), int(seq)))
    return out


def grid(corpus, dps, starts, seeds, steps, lbs=4, seq=256) -> list[Run]:
    return [Run(c, d, s, seed, steps, lbs, seq) for c in corpus for d in dps for s in starts for seed in seeds]


def quick_plan(warm: bool) -> list[Run]:
    """1,000 clean steps: DP 2 on each corpus, one short DP 4 run (2 x 128 tokens per rank;
    4 ranks on 2 cores train a step at about 1.5 s, DP 2 at 0.7 s: measured 913 s with 150
    DP 4 steps, over the 15-minute budget, so 100)."""
    start = "warm" if warm else "cold"
    return [Run("text", 2, "cold", 0, 300, 2, 128), Run("hetero", 2, start, 0, 300, 2, 128),
            Run("copy", 2, start, 0, 300, 2, 128), Run("hetero", 4, "cold", 1, 100, 2, 128)]


# --------------------------------------------------------------------------- training
def train_cmd(run: Run, prefix: Path, dump: Path, base: dict | None, prove: str | None = None) -> list[str]:
    """``prove``: ``--ledger.proof.scope`` (off, acting, all); None leaves the config's default."""
    cmd = [*torchrun_prefix(), "--standalone", "--nproc_per_node", str(run.dp),
           "-m", "titan_ledger.train", "--job.config_file", str(CONFIG), "--training.steps", str(run.steps),
           "--training.local_batch_size", str(run.local_batch_size), "--training.seq_len", str(run.seq_len),
           "--parallelism.data_parallel_shard_degree", str(run.dp),
           "--dataloader.source", "indexed", "--dataloader.paths", str(prefix),
           "--dataloader.seed", str(run.seed), "--debug.seed", str(run.seed),
           "--metrics.log_freq", "50", "--ledger.response.action", "none", "--dump_folder", str(dump)]
    if run.start == "warm":
        if base is None:
            raise ValueError(f"{run.name}: a warm start needs the warm base (bench/warm_base.py)")
        cmd += warm_base.start_flags(base)
    if prove is not None:
        cmd += ["--ledger.proof.scope", prove]
    return cmd


def recorded(dump: Path, steps: int) -> bool:
    sig = dump / "ledger" / "signals.jsonl"
    if not sig.is_file():
        return False
    rows = read_rows(sig)
    return bool(rows) and rows[-1]["step"] >= steps


def train(run: Run, folder: Path, base: dict | None, fresh: bool, log,
          corpora_dir: Path = corpora.OUT, prove: str | None = None) -> tuple[Path, float, bool]:
    """Trains ``run`` into ``folder/run.name`` (reused when complete and not ``fresh``);
    returns (dump, seconds, trained now)."""
    dump = folder / run.name
    if not fresh and recorded(dump, run.steps):
        return dump, 0.0, False
    shutil.rmtree(dump, ignore_errors=True)
    prefix = corpora.prepare(run.corpus, corpora_dir)
    logf = folder / f"{run.name}.log"
    t0 = time.monotonic()
    with open(logf, "w") as f:
        rc = subprocess.run(train_cmd(run, prefix, dump, base, prove), cwd=ROOT, env=corpora.env(), stdout=f,
                            stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - t0
    if rc != 0 or not recorded(dump, run.steps):
        raise SystemExit(f"{run.name}: training failed (exit {rc}); log: {logf}")
    log(f"{run.name}: {run.steps} steps in {seconds:.0f} s")
    return dump, seconds, True


# --------------------------------------------------------------------------- reading a run
def _f(x) -> float:
    return float("nan") if x is None else float(x)  # "nan" / "inf" strings too


def spike_events(dump: Path) -> list[dict]:
    """spikes.jsonl's rule events, both tiers (not the ladder's or a rewind's records):
    ``rules`` (acting, [] on a note-only step) and ``notes`` ([] in ledgers from before
    the tiers)."""
    path = dump / "ledger" / "spikes.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if "schema" not in r and ("rules" in r or "notes" in r) and not r.get("ladder"):
                # a note its proof found harmful (scope = "all") acts: its notes became its rules;
                # the detector's decision was a note (``promoted``)
                promoted = bool(r.get("promoted_by_proof"))
                out.append({**r, "rules": [] if promoted else r.get("rules", []), "notes": r.get("notes", []),
                            "promoted": promoted})
    return out


def spike_header(dump: Path) -> dict:
    for line in (dump / "ledger" / "spikes.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "schema" in r:
            return r
    raise ValueError(f"{dump}: spikes.jsonl has no header")


#: the rule settings that reproduce the detector before the tiers (every rule acts, rank
#: separation on its constant alone): a ledger recorded then has neither field
BEFORE_TIERS = {"notes": "", "separation_gate": 0.0, "zscore_min_ratio": 0.0, "doc_tail_spread": False,
                "grad_novelty": 0.0, "one_doc_spread": False}
#: fields of ledgers recorded before grad_novelty replaced them, and the value that was "off"
RETIRED = {"grad_gate": 0.0, "grad_gate_warmup": None}


def recorded_rules(dump: Path) -> dict:
    """The rule config the run was trained with (spikes.jsonl's header)."""
    rules = {**BEFORE_TIERS, **spike_header(dump)["rules"]}
    for key, off in RETIRED.items():
        value = rules.pop(key, off)
        if off is not None and value != off:
            raise SystemExit(f"{dump}: recorded with {key}={value}, a rule this detector no longer has")
    return rules


def trained_rows(dump: Path) -> list[dict]:
    return [r for r in read_rows(dump / "ledger" / "signals.jsonl") if not r.get("skipped") and r.get("loss") is not None]


def dp_size(dump: Path) -> int:
    return len(list((dump / "ledger").glob("data_dp*.jsonl")))


#: the per-document loss's default ``min_tokens`` (``--ledger.doc_loss.min_tokens``): what
#: ``--infer-docs`` counts documents with on ledgers recorded before the count was
DOC_MIN_TOKENS = 16


def doc_matrix(data_rows: list[dict | None], infer_docs: bool = False):
    """The detector's ``doc`` input ``[dp, 5]`` (median segment loss, highest and lowest
    segment mean loss, ranked segments, distinct documents) from the step's data-ledger
    rows, NaN where absent. The document count is the one the trainer recorded
    (``doc_loss.docs``); ledgers from before it have none (NaN: the detector as it was
    then), unless ``infer_docs`` counts them from the rows' sample ids."""
    import torch

    from titan_ledger.data.layout import distinct_documents

    nan = float("nan")
    out = []
    for r in data_rows:
        d = (r or {}).get("doc_loss")
        if not d:
            out.append([nan] * 5)
            continue
        top, bot = d.get("top") or [], d.get("bottom") or []
        docs = d.get("docs")
        if docs is None and infer_docs and r.get("rows"):
            docs = distinct_documents(r["rows"], DOC_MIN_TOKENS)
        out.append([_f(d.get("median")), top[0][2] / top[0][3] if top else nan,
                    bot[0][2] / bot[0][3] if bot else nan, float(d.get("n_valid", nan)), _f(docs)])
    return torch.tensor(out, dtype=torch.float64)


def replay(dump: Path, rules: dict | None = None, infer_docs: bool = False) -> list[dict]:
    """The spike rules over the recorded ledger, as the trainer ran them; returns the
    flag events (``step``, ``rules`` and the statistics ``describe`` names).
    ``infer_docs``: see ``doc_matrix``."""
    import torch

    from titan_ledger.rehearsal import backend

    backend.ensure_installed()  # before torchtitan's modules (spikes imports torchtitan.config)
    from titan_ledger.components.detection.spikes import SpikeDetector, describe

    cfg = SpikeDetector.Config(**(rules if rules is not None else recorded_rules(dump)))
    dp = dp_size(dump)
    data = [{r["step"]: r for r in read_rows(dump / "ledger" / f"data_dp{k}.jsonl")} for k in range(dp)]
    tracked = any("doc_loss" in r for d in data for r in d.values())
    # each DP rank's loss (rank_loss): rank<r>.jsonl, global rank r = DP rank r on these FSDP-only
    # runs (ledgers recorded before the rank rows have none: the rule abstains, as it did online)
    ranks = [{r["step"]: r for r in read_rows(dump / "ledger" / f"rank{k}.jsonl")}
             if (dump / "ledger" / f"rank{k}.jsonl").exists() else {} for k in range(dp)]
    det = SpikeDetector(cfg)
    events = []
    for row in trained_rows(dump):
        doc = doc_matrix([d.get(row["step"]) for d in data], infer_docs) if tracked else None
        losses = [rk.get(row["step"], {}).get("loss") for rk in ranks]
        dp_loss = torch.tensor([_f(x) for x in losses], dtype=torch.float64) \
            if dp > 1 and all(x is not None for x in losses) else None
        stats = det.step(torch.tensor(_f(row["loss"]), dtype=torch.float64),
                         torch.tensor(_f(row["grad_norm"]), dtype=torch.float64), dp_loss, doc).tolist()
        ev = describe(stats)
        if ev["rules"] or ev["notes"]:
            events.append({"step": row["step"], **ev})
    return events


def check_replay(dump: Path) -> dict:
    """Offline replay vs the online decision, step by step: the flag of every trained step
    (signals ``spike``), the acting rules and the notes of every event (spikes.jsonl),
    and the largest difference in the events' statistics."""
    online_flag = {r["step"]: bool(r.get("spike")) for r in trained_rows(dump)}
    online = {e["step"]: e for e in spike_events(dump)}
    offline = {e["step"]: e for e in replay(dump)}
    mismatches = []
    for step, flag in online_flag.items():
        a, b = online.get(step), offline.get(step)
        if flag != bool(a and a["rules"]):
            mismatches.append({"step": step, "why": "signals spike field vs spikes.jsonl"})
        tiers = lambda e: e and (e["rules"], e["notes"])  # noqa: E731
        if tiers(a) != tiers(b):
            mismatches.append({"step": step, "online": tiers(a), "offline": tiers(b)})
    worst = 0.0
    for step, a in online.items():
        b = offline.get(step)
        if b is None:
            continue
        for k, v in a.items():
            if k in b and isinstance(v, float) and isinstance(b[k], float) and math.isfinite(v):
                worst = max(worst, abs(v - b[k]) / max(1.0, abs(v)))
    return {"identical": not mismatches and worst <= STAT_TOL, "steps": len(online_flag),
            "mismatches": mismatches, "max_stat_diff": worst}


# --------------------------------------------------------------------------- counting
def per_1e4(flags: int, steps: int) -> float:
    return round(1e4 * flags / steps, 2) if steps else float("nan")


def count(runs: list[dict]) -> dict:
    """``runs``: ``{"name", "clean_steps", "events": [{"step", "rules", "notes"}]}`` each
    (``rules``: the acting rules that fired; ``notes``: those that fired as notes), and
    optionally ``proofs`` (``zoo.proof_rows``). Per rule and tier the firings, per 10^4
    clean steps and ``run@step`` of each; ``acting_flags``: steps with an acting rule
    (each an alert, and with ``[ledger.response] policy = "act"`` an action); ``note_steps``: steps with notes
    only. With proofs (``--prove``): :func:`count_proofs`."""
    steps = sum(r["clean_steps"] for r in runs)
    by_rule = {rule: [] for rule in RULES}
    noted = {rule: [] for rule in RULES}
    flagged, notes_only = [], []
    for r in runs:
        for e in r["events"]:
            acting, notes = list(e.get("rules", [])), list(e.get("notes", []))
            where = f"{r['name']}@{e['step']}"
            if acting:
                flagged.append({"run": r["name"], "step": e["step"], "rules": acting, "notes": notes})
            elif notes:
                notes_only.append(where)
            for rule in acting:
                by_rule.setdefault(rule, []).append(where)
            for rule in notes:
                noted.setdefault(rule, []).append(where)
    return {"clean_steps": steps, "acting_flags": len(flagged), "per_1e4": per_1e4(len(flagged), steps),
            "note_steps": len(notes_only), "notes_per_1e4": per_1e4(len(notes_only), steps),
            "flags_by_rule": {k: len(v) for k, v in by_rule.items()},
            "per_1e4_by_rule": {k: per_1e4(len(v), steps) for k, v in by_rule.items()},
            "flagged_by_rule": {k: v for k, v in by_rule.items() if v},
            "notes_by_rule": {k: len(v) for k, v in noted.items()},
            "noted_by_rule": {k: v for k, v in noted.items() if v},
            "steps": flagged, **count_proofs(runs)}


def count_proofs(runs: list[dict]) -> dict:
    """The proofs at the alarm over clean runs (pure; ``runs[i]["proofs"]``: ``zoo.proof_rows``).
    ``proofs``: how many; ``proofs_by_verdict``: per tier (``acting``/``note``) and verdict;
    ``proofs_found_cause``: ``run@step: verdict`` of each proof that found a harmful cause
    (``format.proofs.HARMFUL``: on a clean run every one is wrong); ``promoted_notes``:
    notes such a proof turned into an alarm."""
    from titan_ledger.format.proofs import HARMFUL

    by: dict[str, dict[str, int]] = {}
    found, promoted, n = [], [], 0
    for r in runs:
        for p in r.get("proofs", []):
            n += 1
            tier = by.setdefault(p["tier"], {})
            tier[p["verdict"]] = tier.get(p["verdict"], 0) + 1
            if p["verdict"] in HARMFUL:
                found.append(f"{r['name']}@{p['step']}: {p['verdict']}")
            if p.get("promoted"):
                promoted.append(f"{r['name']}@{p['step']}")
    return {"proofs": n, "proofs_by_verdict": by, "proofs_found_cause": found, "promoted_notes": promoted}


def table(res: dict) -> list[str]:
    out = [f"{res['clean_steps']:,} clean steps: {res['acting_flags']} acting flags ({res['per_1e4']} per 10^4 "
           f"steps), {res.get('note_steps', 0)} note-only steps ({res.get('notes_per_1e4', 0.0)} per 10^4)",
           f"{'rule':<18}{'acts':>6}{'per 1e4':>9}{'notes':>7}  acting steps"]
    for rule, n in res["flags_by_rule"].items():
        steps = res["flagged_by_rule"].get(rule, [])
        out.append(f"{rule:<18}{n:>6}{res['per_1e4_by_rule'][rule]:>9}{res.get('notes_by_rule', {}).get(rule, 0):>7}"
                   f"  {', '.join(steps[:12])}" + (f" (+{len(steps) - 12})" if len(steps) > 12 else ""))
    if res.get("proofs"):
        out.append(f"proofs at the alarm: {res['proofs']} ({res['proofs_by_verdict']}); found a cause: "
                   f"{', '.join(res['proofs_found_cause']) or 'none'}; notes promoted to alarms: "
                   f"{', '.join(res['promoted_notes']) or 'none'}")
    return out


def parse_rules(items: list[str]) -> dict:
    """``["doc_outlier_floor=1.0", ...]`` -> ``{"doc_outlier_floor": 1.0}`` (SpikeDetector.Config fields)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in (*_int_fields(), "notes", *_BOOLS) and key not in _float_fields():
            raise SystemExit(f"--rules {item}: not a SpikeDetector.Config field")
        out[key] = value if key == "notes" else value.lower() in ("1", "true") if key in _BOOLS \
            else int(value) if key in _int_fields() else float(value)
    return out


def _fields_of(kind: type) -> tuple[str, ...]:
    """SpikeDetector.Config's fields of one type (from their defaults: a new one needs no edit here)."""
    import dataclasses

    from titan_ledger.rehearsal import backend

    backend.ensure_installed()  # before torchtitan's modules (spikes imports torchtitan.config)
    from titan_ledger.components.detection.spikes import SpikeDetector

    return tuple(f.name for f in dataclasses.fields(SpikeDetector.Config) if type(f.default) is kind)


def _int_fields() -> tuple[str, ...]:
    return _fields_of(int)


_BOOLS = ("doc_tail_spread", "one_doc_spread", "dip_note")


def _float_fields() -> tuple[str, ...]:
    return _fields_of(float)


def summarize_run(run: Run, dump: Path, seconds: float, fresh: bool, check: bool = True,
                  rules: dict | None = None, infer_docs: bool = False) -> dict:
    """One run's counts; with ``rules`` (overrides of the recorded rule config) the flags are
    the offline replay's under those settings instead of the recorded ones."""
    rows = trained_rows(dump)
    ev = replay(dump, {**recorded_rules(dump), **rules}, infer_docs) if rules else spike_events(dump)
    out = {"name": run.name, **asdict(run), "clean_steps": len(rows), "trained_now": fresh,
           "seconds": round(seconds, 1),
           "events": [{"step": e["step"], "rules": e["rules"], "notes": e["notes"]} for e in ev],
           "proofs": read_proofs(dump),
           "first_loss": round(_f(rows[0]["loss"]), 3) if rows else None,
           "last_loss": round(sum(_f(r["loss"]) for r in rows[-20:]) / len(rows[-20:]), 3) if rows else None}
    if check:
        out["replay"] = check_replay(dump)
    return out


def compare_tiers(dumps: list[Path], rules: dict | None = None, infer_docs: bool = False) -> list[dict]:
    """Each run's flags under the detector before the tiers (:data:`BEFORE_TIERS`: every
    rule acts) and with the tiers (the defaults, or ``rules``), replayed offline over
    the same ledger: acting steps and note-only steps, with their rules."""
    import dataclasses

    from titan_ledger.rehearsal import backend

    backend.ensure_installed()
    from titan_ledger.components.detection.spikes import SpikeDetector

    defaults = {f.name: getattr(SpikeDetector.Config(), f.name) for f in dataclasses.fields(SpikeDetector.Config)}
    out = []
    for dump in dumps:
        base = {**recorded_rules(dump)}
        after_rules = {**base, **{k: defaults[k] for k in BEFORE_TIERS}, **(rules or {})}
        before = replay(dump, {**base, **BEFORE_TIERS})
        after = replay(dump, after_rules, infer_docs)
        out.append({"run": dump.name,
                    "before": [[e["step"], e["rules"]] for e in before if e["rules"]],
                    "after": [[e["step"], e["rules"]] for e in after if e["rules"]],
                    "after_notes": [[e["step"], e["notes"]] for e in after if not e["rules"]]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=">= 1,000 fresh clean steps (799 s measured on 2 cores)")
    ap.add_argument("--json", action="store_true", help="one JSON line at the end (progress on stderr)")
    ap.add_argument("--folder", type=Path, help=f"runs go here (default {OUT}/<full|quick>)")
    ap.add_argument("--corpus", nargs="+", choices=corpora.CORPORA, default=list(corpora.CORPORA))
    ap.add_argument("--dp", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--start", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=850)
    ap.add_argument("--local-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--fresh", action="store_true", help="retrain runs already recorded (quick always does)")
    ap.add_argument("--replay-only", action="store_true", help="train nothing: count and replay the recorded runs")
    ap.add_argument("--no-replay-check", action="store_true")
    ap.add_argument("--recorded", action="store_true",
                    help="with --replay-only: every run recorded under --folder, whatever grid trained it")
    ap.add_argument("--rules", nargs="+", default=[], metavar="KEY=VALUE",
                    help="with --replay-only: count the offline replay under these rule settings, e.g. "
                         "doc_outlier_floor=1.0 min_docs=4 (SpikeDetector.Config fields)")
    ap.add_argument("--corpora-dir", type=Path, default=corpora.OUT,
                    help="prepared corpora (cold starts; the warm base keeps its own under outputs/)")
    ap.add_argument("--warm-steps", type=int, default=warm_base.STEPS,
                    help="the warm base trained this many steps (bench/warm_base.py --steps)")
    ap.add_argument("--compare-tiers", nargs="+", type=Path, metavar="DUMP",
                    help="replay these recorded runs (any: zoo, detection, clean) before and with the tiers "
                         "(--rules adjusts the tiers' side) and print one JSON line per run")
    ap.add_argument("--infer-docs", action="store_true",
                    help="with --rules or --compare-tiers: count each rank's distinct documents from the "
                         "rows' sample ids where a ledger recorded none (before one_doc_spread)")
    ap.add_argument("--prove", choices=("off", "acting", "all"),
                    help="--ledger.proof.scope for every run (default: the config's, acting)")
    a = ap.parse_args(argv)
    rules = parse_rules(a.rules)
    if a.compare_tiers:
        for r in compare_tiers(a.compare_tiers, rules, a.infer_docs):
            print(json.dumps(r))
        return 0
    if (rules or a.recorded) and not a.replay_only:
        ap.error("--rules and --recorded replay recorded runs: add --replay-only")
    t0 = time.monotonic()
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if a.json else (lambda m: print(m, flush=True))
    folder = a.folder or OUT / ("quick" if a.quick else "full")
    folder.mkdir(parents=True, exist_ok=True)
    if a.quick:
        base = warm_base.cached(a.warm_steps)
        plan = quick_plan(base is not None)
        fresh = True
    else:
        plan = recorded_runs(folder) if a.recorded else \
            grid(a.corpus, a.dp, a.start, a.seeds, a.steps, a.local_batch_size, a.seq_len)
        base = None
        if "warm" in a.start and not a.replay_only:
            base = warm_base.ensure(a.warm_steps, log=log)
        fresh = a.fresh
    runs = []
    for run in plan:
        if a.replay_only:
            dump, seconds, now = folder / run.name, 0.0, False
            if not recorded(dump, run.steps):
                log(f"{run.name}: not recorded, left out")
                continue
        else:
            dump, seconds, now = train(run, folder, base, fresh, log, a.corpora_dir, a.prove)
        r = summarize_run(run, dump, seconds, now, check=not a.no_replay_check, rules=rules,
                          infer_docs=a.infer_docs)
        runs.append(r)
        log(f"{run.name}: {r['clean_steps']} steps, loss {r['first_loss']} -> {r['last_loss']}, "
            f"acting {[(e['step'], e['rules']) for e in r['events'] if e['rules']]}, "
            f"{sum(1 for e in r['events'] if not e['rules'])} note-only steps"
            + (f", replay identical {r['replay']['identical']}" if "replay" in r else ""))
    res = count(runs)
    res.update({
        "fresh_steps": sum(r["clean_steps"] for r in runs if r["trained_now"]),
        "rules_override": rules or None,
        "replay_identical": all(r["replay"]["identical"] for r in runs) if runs and "replay" in runs[0] else None,
        "warm_base": base and {k: base[k] for k in ("hash", "final_loss", "unigram_entropy", "checkpoint")},
        "batch": sorted({f"{r.local_batch_size}x{r.seq_len}" for r in plan}),
        "seconds": round(time.monotonic() - t0, 1),
        "runs": [{k: v for k, v in r.items() if k not in ("events",)} for r in runs]})
    if not a.replay_only:  # a replay does not replace the record of the runs
        (folder / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    if a.json:
        print(json.dumps(res))
    else:
        print("\n".join(table(res)))
        print(f"offline replay identical to the online decision on every run: {res['replay_identical']}; "
              f"{res['fresh_steps']:,} steps trained now in {res['seconds']:.0f} s; runs: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
