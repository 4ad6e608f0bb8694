"""``python -m titan_ledger.replay``: prove that a resumed run saw exactly the same samples.

Design decision: the data ledger of an ordinary run *is* the record (no second id
format): ``check`` compares the per-step sample ids of two dump folders,
``resume`` produces the interrupted run to compare, with a real SIGKILL of every
process (torchrun and all ranks, so prefetched batches die with the workers)
at a step the user picks, then a plain relaunch that resumes from the latest
checkpoint. ``inject`` corrupts one rank's batch at one step (to rehearse spike
forensics), ``drill`` runs the PaLM procedure end to end, and ``rerun``
re-executes the steps before a spike from a checkpoint under counterfactual
variants and names the cause they prove (:mod:`titan_ledger.tools.rerun`).

Examples::

    # 2 ranks, checkpoint every 4 steps, kill -9 during step 6, resume, finish
    python -m titan_ledger.replay resume --nproc 2 --kill-at 6 --dump-folder /tmp/b -- \\
        --job.config_file train_configs/debug_cpu.toml --training.steps 10 --checkpoint.interval 4
    python -m titan_ledger.replay check /tmp/a /tmp/b            # exit 0: identical samples
    python -m titan_ledger.replay check /tmp/a /tmp/b --json
    python -m titan_ledger.replay inject --step 5 --rank 1 --kind repeat --nproc 2 \\
        --dump-folder /tmp/c -- --job.config_file train_configs/debug_cpu.toml --training.steps 8
    python -m titan_ledger.replay drill --nproc 2 --dump-folder /tmp/d -- \\
        --job.config_file train_configs/debug_cpu.toml
    # re-execute the steps before the spike at step 8 from the last checkpoint, as is and
    # with step 8's data skipped (titan_ledger.tools.rerun); the original run's flags after --
    python -m titan_ledger.replay rerun --dump-folder /tmp/a --step 8 --variant same --variant skip -- \\
        --job.config_file train_configs/debug_cpu.toml --training.steps 12 --checkpoint.enable \\
        --checkpoint.interval 4 --ledger.spike.window 8 --ledger.rehearsal.inject 8:1:repeat
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from titan_ledger.errors import EXIT_BAD_INPUT, EXIT_NEGATIVE, EXIT_OK, LedgerError
from titan_ledger.format import records
from titan_ledger.format.data_reader import step_ids, stream_step_ids
from titan_ledger.format.reader import RunLedger, checkpoints
from titan_ledger.tools.cli import ToolParser, run_tool
from titan_ledger.tools.runs import ReplayError, run_training

EXIT_EQUAL, EXIT_DIFFERENT, EXIT_ERROR = EXIT_OK, EXIT_NEGATIVE, EXIT_BAD_INPUT


# --------------------------------------------------------------------------- check
@dataclass
class CheckResult:
    equal: bool
    steps: int = 0
    ranks: list[int] = field(default_factory=list)
    divergence: dict | None = None
    overlaps: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"equal": self.equal, "steps_compared": self.steps, "ranks": self.ranks,
                "first_divergence": self.divergence, "overlaps": self.overlaps, "notes": self.notes}


def check(dir_a: str | Path, dir_b: str | Path, ledger_folder: str = records.LEDGER_FOLDER,
          chunk_ids: int | None = None) -> CheckResult:
    la = RunLedger(dir_a, ledger_folder).data
    lb = RunLedger(dir_b, ledger_folder).data
    for lg in (la, lb):  # a lost rank file is a missing ledger (exit 2), not a difference
        lg.require_complete()
    ha, hb = la.header(), lb.header()
    for key in ("fingerprint", "global_batch", "seq_len"):
        if ha.get(key) != hb.get(key):
            raise LedgerError(f"the runs differ in {key}: {dir_a} has {ha.get(key)!r}, {dir_b} has "
                              f"{hb.get(key)!r}; compare runs of the same config")
    res = CheckResult(True, ranks=sorted(set(la.ranks()) | set(lb.ranks())))
    # A torn last line (kill -9 mid-write) ends that run's record: its steps after the
    # last one every DP rank completed are not compared, and the other run's steps
    # past that end are not "missing" from it (README: a cut file is not a divergence).
    end = None
    for name, lg in (("A", la), ("B", lb)):
        torn = lg.torn
        if not torn:
            continue
        last = min((lg.last_step_of(r) for r in torn), default=0)  # the torn ranks lost their last step
        end = last if end is None else min(end, last)
        files = ", ".join(str(lg.files[r].name) for r in sorted(torn))
        res.notes.append(f"{name}'s record ends at step {last} (the last line of {files} is torn: "
                         f"a kill mid-write); steps after {last} are not compared")
    stop = max(la.last_step, lb.last_step) if end is None else end
    # streamed: a chunk of steps of every DP rank at a time, read through the offset index,
    # so memory is O(chunk x ranks) whatever the run's length
    chunk = max(1, (chunk_ids or CHUNK_IDS) // max(1, len(res.ranks)))
    diverged = False
    with records.no_cycle_gc():
        for (_, _, a), (_, _, b) in zip(stream_step_ids(la, chunk, stop), stream_step_ids(lb, chunk, stop)):
            # past the first divergence only the overlaps are still collected (every one is named)
            diverged = _compare(res, a, b, overlaps_only=diverged) or diverged
    if res.overlaps:
        res.equal = False
    return res


#: sample-id keys (steps x DP ranks) one chunk of ``replay check`` holds (~1 KB each with
#: their rows: ~100 MB a ledger)
CHUNK_IDS = 100_000


def _compare(res: CheckResult, a: dict, b: dict, overlaps_only: bool = False) -> bool:
    """One chunk of steps of runs A and B into ``res``; True at the first divergence."""
    for name, ids in (("A", a), ("B", b)):
        for s, per_rank in sorted(ids.items()):  # within a step, DP ranks are disjoint
            seen: dict[int, int] = {}
            for r, key in per_rank.items():
                if key and isinstance(key[0], str):
                    key = key[1:] if key[0] == "skipped" else ()
                for i in key:
                    if i in seen:
                        res.overlaps.append({"run": name, "step": s, "sample_id": i,
                                             "ranks": [seen[i], r]})
                    seen[i] = r
    if overlaps_only:
        return True
    for s in sorted(set(a) | set(b)):
        ra, rb = a.get(s), b.get(s)
        if ra is None or rb is None:
            res.equal = False
            res.divergence = {"step": s, "rank": None, "expected": _show(ra), "got": _show(rb),
                              "reason": f"step {s} is missing from {'A' if ra is None else 'B'}"}
            return True
        if set(ra) == set(rb):
            bad = next((r for r in sorted(ra) if ra[r] != rb[r]), None)
            if bad is not None:
                res.equal = False
                res.divergence = {"step": s, "rank": bad, "expected": _show(ra[bad]),
                                  "got": _show(rb[bad])}
                return True
        else:  # another DP size on resume: the step's global sample set must match
            ga = sorted(map(str, (i for k in ra.values() for i in k)))
            gb = sorted(map(str, (i for k in rb.values() for i in k)))
            if ga != gb:
                res.equal = False
                res.divergence = {"step": s, "rank": "all", "expected": ga, "got": gb}
                return True
        res.steps += 1
    return False


def _show(v):
    if v is None:
        return None
    if isinstance(v, dict):
        return {str(r): list(k) for r, k in v.items()}
    return list(v)


def print_check(res: CheckResult, a: str, b: str) -> None:
    print(f"A = {a}\nB = {b}")
    print(f"{'steps compared':<18}{res.steps}\n{'DP ranks':<18}{res.ranks}")
    for n in res.notes:
        print(f"{'note':<18}{n}")
    if res.overlaps:
        o = res.overlaps[0]
        print(f"{'OVERLAP':<18}run {o['run']} step {o['step']}: sample {o['sample_id']} on ranks "
              f"{o['ranks']} ({len(res.overlaps)} in all)")
    if res.divergence:
        d = res.divergence
        print(f"{'FIRST DIVERGENCE':<18}step {d['step']}, rank {d['rank']}"
              + (f": {d['reason']}" if "reason" in d else ""))
        print(f"{'  expected (A)':<18}{d['expected']}\n{'  got (B)':<18}{d['got']}")
    print(f"{'result':<18}{'EQUAL' if res.equal else 'DIFFERENT'}")


def resume(nproc: int, kill_at: int, dump: Path, train_args: list[str]) -> dict:
    args = ["--checkpoint.enable", *train_args]
    log = dump / "replay_resume.log"
    dump.mkdir(parents=True, exist_ok=True)
    first = run_training(nproc, dump, args, log, kill_at=kill_at)
    if not first["killed"]:
        raise ReplayError(f"the run ended (exit {first['returncode']}) before step {kill_at}; "
                           f"log: {log}")
    ckpts = checkpoints(dump)
    if not ckpts:
        raise ReplayError(f"no checkpoint was complete when step {kill_at} started, so there is "
                          f"nothing to resume from; pick --kill-at after the first checkpoint "
                          f"(--checkpoint.interval); log: {log}")
    second = run_training(nproc, dump, args, log)
    if second["returncode"] != 0:
        raise ReplayError(f"the resumed run failed (exit {second['returncode']}); log: {log}")
    return {"dump_folder": str(dump), "killed_at_step": kill_at,
            "resumed_from_checkpoint": ckpts[-1],
            "checkpoints_before_kill": ckpts, "first_run_s": first["seconds"],
            "resumed_run_s": second["seconds"], "log": str(log)}


# --------------------------------------------------------------------------- inject
def _signals(dump: Path) -> list[dict]:
    return RunLedger(dump).signal_rows()


def judge_injection(rows: list[dict], step: int, rank: int, min_ratio: float = 3.0) -> dict:
    """Did the signals show the injected batch? grad-norm jump and loss_max_rank == rank."""
    import statistics

    trained = [r for r in rows if not r.get("skipped") and r.get("grad_norm") is not None]
    at = next((r for r in trained if r["step"] == step), None)
    if at is None:
        raise ReplayError(f"step {step} is not a trained step of the run")
    pre = [r["grad_norm"] for r in trained if step - 50 <= r["step"] < step]
    med = statistics.median(pre) if pre else float("nan")
    ratio = at["grad_norm"] / med if med else float("nan")
    shown = at["loss_max_rank"] == rank and ratio >= min_ratio
    return {"step": step, "rank": rank, "shown": bool(shown), "grad_norm": at["grad_norm"],
            "pre_median_grad_norm": med, "grad_norm_ratio": ratio, "loss": at["loss"],
            "loss_max": at["loss_max"], "loss_max_rank": at["loss_max_rank"],
            "spike_flagged": at.get("spike"), "min_ratio": min_ratio}


def inject(nproc: int, dump: Path, step: int, rank: int, kind: str, train_args: list[str],
           min_ratio: float) -> dict:
    log = dump / "replay_inject.log"
    run = run_training(nproc, dump, [*train_args, "--ledger.rehearsal.inject", f"{step}:{rank}:{kind}"], log)
    if run["returncode"] != 0:
        raise ReplayError(f"training failed (exit {run['returncode']}); log: {log}")
    return {"kind": kind, **judge_injection(_signals(dump), step, rank, min_ratio), "log": str(log)}


# --------------------------------------------------------------------------- drill
def drill(nproc: int, dump: Path, step: int, rank: int, kind: str, back: int, before: int,
          after: int, train_args: list[str]) -> dict:
    """PaLM's procedure end to end on a rehearsal spike; see the module docstring."""
    ref, run = dump / "uninterrupted", dump / "drill"
    args = ["--checkpoint.enable", *train_args]
    log = dump / "replay_drill.log"
    dump.mkdir(parents=True, exist_ok=True)
    out: dict = {"injected": {"step": step, "rank": rank, "kind": kind}}
    for folder, extra in ((ref, []), (run, ["--ledger.rehearsal.inject", f"{step}:{rank}:{kind}"])):
        r = run_training(nproc, folder, args + extra, log)
        if r["returncode"] != 0:
            raise ReplayError(f"training in {folder} failed (exit {r['returncode']}); log: {log}")
    # 1. locate the spike from the ledger (what the trainer flagged)
    events = RunLedger(run).spike_events()
    if not events:
        out.update(passed=False, reason=f"the trainer flagged no spike ({records.SPIKES_FILE} is empty)")
        return out
    spike = events[0]["step"]
    out["located"] = {"step": spike, "rules": events[0]["rules"], "loss_max_rank": events[0]["loss_max_rank"]}
    # 2. roll back to the last checkpoint before it, skip the window around it
    usable = [c for c in checkpoints(run) if c <= spike - back]
    if not usable:
        raise ReplayError(f"no checkpoint at or before step {spike - back} in {run}")
    load = usable[-1]
    window = (max(load + 1, spike - before), spike + after)
    out["rollback"] = {"load_step": load, "skip_window": list(window)}
    r = run_training(nproc, run, args + ["--ledger.rehearsal.inject", f"{step}:{rank}:{kind}",
                                         "--checkpoint.load_step", str(load),
                                         "--ledger.skip.steps", f"{window[0]}-{window[1]}"], log)
    if r["returncode"] != 0:
        raise ReplayError(f"the rolled-back run failed (exit {r['returncode']}); log: {log}")
    # 3. pass: no spike after the rollback point, and the samples equal the
    #    uninterrupted run's except exactly the skipped window
    after_rows = [x for x in _signals(run) if x["step"] > load]
    late_spikes = [x["step"] for x in after_rows if x.get("spike")]
    a, b = step_ids(RunLedger(ref).data), step_ids(RunLedger(run).data)
    mismatch = None
    for s_ in sorted(set(a) | set(b)):
        ka, kb = a.get(s_), b.get(s_)
        if ka is None or kb is None:
            mismatch = {"step": s_, "reason": "missing"}
            break
        in_window = window[0] <= s_ <= window[1]
        for r_ in sorted(ka):
            want = ("skipped", *ka[r_]) if in_window else ka[r_]
            if kb.get(r_) != want:
                mismatch = {"step": s_, "rank": r_, "expected": list(want), "got": list(kb.get(r_) or [])}
                break
        if mismatch:
            break
    out.update(spikes_after_rollback=late_spikes, first_mismatch=mismatch,
               steps_compared=len(a), passed=not late_spikes and mismatch is None)
    return out


# --------------------------------------------------------------------------- CLI
def _split_train_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_args = _split_train_args(argv)
    ap = ToolParser.for_tool(__name__, __doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("check", help="compare the samples of two runs",
                       description="Per DP rank, the step-by-step sample ids of two runs must be "
                       "equal, and within each step the ranks disjoint. Exit 0 equal, 1 different, "
                       "2 error.", epilog="example: python -m titan_ledger.replay check /tmp/a /tmp/b --json")
    p.add_argument("dump_a")
    p.add_argument("dump_b")
    p.add_argument("--json", action="store_true")
    p.add_argument("--ledger-folder", default=records.LEDGER_FOLDER)
    parsers = {}
    p = sub.add_parser("resume", help="train, kill -9 every rank at a step, resume, finish",
                       description="Training arguments follow `--`. Checkpointing is switched on; "
                       "pick --kill-at between checkpoint steps.",
                       epilog="example: python -m titan_ledger.replay resume --nproc 2 --kill-at 6 "
                       "--dump-folder /tmp/b -- --job.config_file train_configs/debug_cpu.toml "
                       "--training.steps 10 --checkpoint.interval 4")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (default: the world size the folder's ledger records, else 2)")
    p.add_argument("--kill-at", type=int, required=True)
    p.add_argument("--dump-folder", "--dump_folder", "--job.dump_folder", dest="dump_folder", type=Path,
                   required=True)
    p.add_argument("--json", action="store_true")
    parsers["resume"] = p
    for name, helptext, desc in (
            ("inject", "corrupt one DP rank's batch at one step; did the signals show it?",
             "Trains with rank R's batch at step T replaced by one repeated token or uniform random "
             "tokens. Exit 0 when the signals ledger shows it (grad norm >= --min-ratio x the "
             "pre-step median and loss_max_rank == R), 1 when not, 2 on error."),
            ("drill", "rehearse PaLM's rollback + skip on an injected spike",
             "Trains an uninterrupted reference and a run with an injected bad batch, locates the "
             f"spike from the trainer's {records.SPIKES_FILE}, rolls back to the last checkpoint at or before "
             "spike - --back, skips [spike - --skip-before, spike + --skip-after], runs on. Exit 0 "
             "when no spike remains and the samples equal the reference's except the skipped window.")):
        p = sub.add_parser(name, help=helptext, description=desc,
                           epilog=f"example: python -m titan_ledger.replay {name} --step 24 --rank 1 "
                           f"--nproc 2 --dump-folder /tmp/{name} -- --job.config_file "
                           f"train_configs/debug_cpu.toml --training.steps 26 --checkpoint.interval 8 "
                           f"--ledger.spike.window 16")
        p.add_argument("--step", type=int, required=True, help="step T of the injected batch")
        p.add_argument("--rank", type=int, default=0, help="DP rank R whose batch is replaced")
        p.add_argument("--kind", choices=["repeat", "random"], default="repeat")
        p.add_argument("--nproc", type=int, default=2)
        p.add_argument("--dump-folder", "--dump_folder", "--job.dump_folder", dest="dump_folder",
                       type=Path, required=True)
        p.add_argument("--json", action="store_true")
        parsers[name] = p
        if name == "inject":
            p.add_argument("--min-ratio", type=float, default=3.0, help="grad-norm jump that counts")
        else:
            p.add_argument("--back", type=int, default=1, help="checkpoint at or before spike - back")
            p.add_argument("--skip-before", type=int, default=1)
            p.add_argument("--skip-after", type=int, default=1)
    from titan_ledger.tools import rerun as rerun_mod

    p = sub.add_parser("rerun", help="re-execute the steps before a spike from a checkpoint, under "
                       "counterfactual variants", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=rerun_mod.__doc__.split("Examples::")[0],
                       epilog="Examples:" + rerun_mod.__doc__.split("Examples::", 1)[1]
                       .split("\nDesign decision:")[0])  # the module layout is not the user's
    p.add_argument("--dump-folder", "--dump_folder", "--job.dump_folder", dest="dump_folder", type=Path,
                   required=True, help=f"the original run's dump folder (reruns go to DUMP/{records.RERUN_FOLDER}/<variant>/)")
    p.add_argument("--step", type=int, required=True, help="the spike step T")
    p.add_argument("--from", dest="from_step", type=int, default=None,
                   help="checkpoint step C to load (default: the last complete one <= T-1)")
    p.add_argument("--after", type=int, default=1, help="steps after T to train too (default 1)")
    p.add_argument("--variant", action="append", default=None,
                   help="same | skip | quarantine[=SOURCE:DOC,...] | swap | lr=X | eps=X | clip=X | fp32 | "
                        "beta2=X | logit_cap=X | qk_clip=X | zloss=X (repeatable; default same)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes per rerun (default: the world size the ledger records)")
    p.add_argument("--fresh", action="store_true",
                   help="train again even where an identical earlier rerun exists")
    p.add_argument("--ledger-folder", default=records.LEDGER_FOLDER)
    p.add_argument("--json", action="store_true")
    parsers["rerun"] = p
    # training flags follow `--`, or are simply the flags replay does not know
    a, unknown = ap.parse_known_args(own)
    if unknown:
        if a.cmd == "check":
            ap.error(f"unrecognized arguments: {' '.join(unknown)}")
        train_args = unknown + train_args
    if a.cmd != "check":
        if a.nproc is not None and a.nproc < 1:
            parsers[a.cmd].error(f"--nproc {a.nproc}: give at least 1 process")
        # rerun and resume may reuse the launch the ledger records (titan_ledger.tools.recorded)
        if (train_args or a.cmd not in ("rerun", "resume")) and \
                not any(x.split("=")[0] in ("--job.config_file", "--config", "--module") for x in train_args):
            parsers[a.cmd].error("give the training flags, at least --job.config_file X.toml "
                                 "(after `--` or mixed with replay's own)")
    return run_tool("titan_ledger.replay", lambda: _run(a, train_args))


def _validate(a, train_args: list[str]) -> None:
    """Bad training flags fail here, as one line, before anything is trained."""
    from titan_ledger.tools.launch import validate

    extra = ["--checkpoint.enable"] if a.cmd in ("resume", "drill") else []
    if a.cmd in ("inject", "drill"):
        if a.step < 1:
            raise ReplayError(f"--step {a.step}: steps start at 1")
        extra += ["--ledger.rehearsal.inject", f"{a.step}:{a.rank}:{a.kind}"]
    config = validate([*extra, *train_args, "--job.dump_folder", str(a.dump_folder)], a.nproc)
    if a.cmd == "resume" and not 1 < a.kill_at <= config.training.steps:
        raise ReplayError(f"--kill-at {a.kill_at}: pick a step after the first checkpoint and at most "
                          f"--training.steps {config.training.steps}")


def _run(a, train_args: list[str]) -> int:
    if a.cmd in ("rerun", "resume"):  # the recorded launch when no flags are given; flags given checked
        from titan_ledger.tools.recorded import launch_args

        train_args, a.nproc = launch_args(a.dump_folder, train_args, a.nproc,
                                          ledger_folder=getattr(a, "ledger_folder", records.LEDGER_FOLDER),
                                          what=f"replay {a.cmd}")
    elif a.cmd != "check" and a.nproc is None:
        a.nproc = 2
    if a.cmd == "rerun":
        return _rerun(a, train_args)
    if a.cmd != "check":
        _validate(a, train_args)
    if a.cmd == "check":
        res = check(a.dump_a, a.dump_b, a.ledger_folder)
        if a.json:
            print(json.dumps(res.to_json()))
        else:
            print_check(res, a.dump_a, a.dump_b)
        return EXIT_EQUAL if res.equal else EXIT_DIFFERENT
    if a.cmd in ("inject", "drill"):
        if a.cmd == "inject":
            out = inject(a.nproc, a.dump_folder, a.step, a.rank, a.kind, train_args, a.min_ratio)
            ok = out["shown"]
        else:
            out = drill(a.nproc, a.dump_folder, a.step, a.rank, a.kind, a.back, a.skip_before,
                        a.skip_after, train_args)
            ok = out["passed"]
        if a.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                print(f"{k:<24}{v}")
            print(f"{'result':<24}{'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    if a.cmd == "resume":
        out = resume(a.nproc, a.kill_at, a.dump_folder, train_args)
        if a.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                print(f"{k:<26}{v}")
        return 0
    return EXIT_ERROR


def _rerun(a, train_args: list[str]) -> int:
    from titan_ledger.tools import rerun

    variants = [rerun.parse_variant(v) for v in (a.variant or ["same"])]
    log = (lambda m: print(m, file=sys.stderr)) if a.json else print
    rep = rerun.rerun(a.dump_folder, a.step, variants, train_args, load_step=a.from_step, after=a.after,
                      nproc=a.nproc, ledger_folder=a.ledger_folder, fresh=a.fresh, log=log)
    if a.json:
        print(json.dumps(rep))
    else:
        rerun.print_report(rep)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
