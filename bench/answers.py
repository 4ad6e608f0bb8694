"""Do the answers' printed fixes work? (issue 67)

    python bench/answers.py [--seeds 0 1] [--only NAME ...] [--folder DIR] [--parallel 2] [--json]
                            [--skip-train | --judge-only | --resume] [--measured-only]

Design decision: an answer's fix is judged the way a user applies it, not the way the
proof measured it. Each scenario of the real set (``bench/zoo.py``'s ``real`` scenarios
without their prevention twins) and the memorisation plateau of issue 67 is trained once
per seed with every proof on (``--ledger.proof.scope all``, host snapshots every 20
steps, 4 kept: the window proof), checkpoints every 20 steps. For every incident the run
answered (``spikes.jsonl``'s ``answer``) its printed ``command`` is run as printed (in a
shell, from ``/``; the launcher honours ``$TITAN_LEDGER_TORCHRUN``) -- it relaunches the run
with the fix from the checkpoint the answer names (or from scratch) into a new dump folder,
over the run's own horizon. Two answers whose commands differ only in their new dump folder
share one relaunch (an LR run's incidents twenty steps apart start from one checkpoint).

Per incident: ``removed`` when the fixed run has no acting flag within ``WINDOW`` (10)
steps of the incident's step, ``lowered`` when it has, but fewer acting flags from the
relaunch's start to the end than the original over the same steps or a last-100-step loss
lower by 1% (a stall: only the loss), ``not`` otherwise; ``no fix`` when the answer printed
no command (the cause not established -- its candidates carry none -- or no change to this
run makes the fix). A fix is ``measured`` (the window proof's) or the fix of a cause proven
in step (``in_step``: its effect not measured). Goals
(issue 67): >= 90% of the incidents with a printed fix removed or lowered, 0 fixes that
repeat the run's own settings (each fix's flag values against the run's recorded
``knobs``), 0 quarantine offers after a verdict other than bad data.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import zoo  # noqa: E402

from titan_ledger.format.answers import Answer, Knobs, of_run  # noqa: E402
from titan_ledger.format.reader import RunLedger  # noqa: E402

#: the real set of issue 61 (zoo's scenarios, trained without their prevention twins)
REAL = ("lr_warmup_real", "lr_divergence_real", "optimizer_state_plateau", "optimizer_state_plateau_lr3e3",
        "logit_stall_real", "logit_stall_lr02")
#: the memorisation plateau of issue 67 (as the issue ran it)
PLATEAU = ("--job.config_file", str(ROOT / "train_configs" / "tiny_cpu.toml"), "--optimizer.lr", "1e-2",
           "--lr_scheduler.warmup_steps", "20", "--lr_scheduler.min_lr_factor", "1.0", "--optimizer.weight_decay",
           "0", "--model.qk_norm", "--dataloader.no_shuffle", "--dataloader.source", "indexed",
           "--training.steps", "800")
PROVE = ("--ledger.proof.scope", "all", "--ledger.snapshots.every", "20", "--ledger.snapshots.keep", "4")
# a flag within WINDOW steps of the incident's step is the incident again; a loss GAIN lower:
# lowered -- the horizon proof's own rules (titan_ledger/tools/episode_proof.py: one owner)
from titan_ledger.tools.episode_proof import GAIN, WINDOW  # noqa: E402

#: runs the bench does not tune on (issue 77): the README's first command at an LR that breaks
#: it (DP 2), a peak LR that leaves the model broken (an adversarial clean corpus), a change of
#: data (docstrings, then multilingual text, in order) at DP 2 under ``act``
HELD_OUT = ("readme_lr005", "broken_lr", "shift_language")


def _args_of(name: str, seed: int, folder: Path) -> tuple[list[str], int]:
    """The training flags of a scenario (its corpus prepared in ``folder``) and its world size."""
    if name == "readme_lr005":
        return ["--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml"), "--optimizer.lr", "0.05",
                "--training.steps", "60", "--debug.seed", str(seed)], 2
    if name in ("broken_lr", "shift_language"):
        import adversarial

        prefix, _ = adversarial.prepare(name, 800, folder / "corpora")
        run = adversarial.Run(name, seed, "act" if name == "shift_language" else "observe", 800)
        return [*adversarial.train_args(run, prefix), "--checkpoint.enable", "--checkpoint.interval", "100",
                "--checkpoint.keep_latest_k", "0"], 2 if name == "shift_language" else 1
    if name == "plateau":
        prefix = zoo.prepare_documents(folder / "corpus_plateau", [{"text": " the end." * 400}] * 1500, "easy")
        return [*PLATEAU, "--dataloader.paths", str(prefix), "--checkpoint.enable", "--checkpoint.interval", "20",
                "--checkpoint.keep_latest_k", "0", "--debug.seed", str(seed), *PROVE], 1
    sc = zoo.BY_NAME[name]
    prefix, _ = zoo.build_corpus(folder / f"corpus_{name}", sc.plant, sc.plant_step, 0, sc.corpus)
    zoo.SEED_ARGS = ("--debug.seed", str(seed))
    return [*zoo.base_args(sc, prefix, sc.steps), "--checkpoint.keep_latest_k", "0", *PROVE], sc.nproc


def train(name: str, seed: int, folder: Path) -> dict:
    dump = folder / f"{name}_s{seed}"
    shutil.rmtree(dump, ignore_errors=True)
    for old in folder.glob(f"{dump.name}-fix*"):
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    args, nproc = _args_of(name, seed, folder)
    t0 = time.perf_counter()
    rc = zoo.train(args, dump, folder / f"{dump.name}.log", nproc)
    return {"scenario": name, "seed": seed, "dump": str(dump), "rc": rc, "seconds": round(time.perf_counter() - t0)}


def flags_of(dump: Path) -> list[int]:
    """The acting flags a run recorded (every launch's: an event log is never superseded)."""
    try:
        return sorted({int(e["step"]) for e in RunLedger(dump).spike_events()})
    except Exception:
        return []


def last_losses(dump: Path, n: int = 100) -> float | None:
    try:
        rows = [r for r in RunLedger(dump).trained_rows() if isinstance(r.get("loss"), float)]
    except Exception:
        return None
    xs = [r["loss"] for r in rows[-n:] if math.isfinite(r["loss"])]
    return statistics.fmean(xs) if xs else None


def repeats_setting(a: Answer, knobs: Knobs) -> bool:
    """Whether the answer's fix (or its first candidate) sets a value the run already had."""
    fix = a.fix or (a.candidates[0] if a.candidates else None)
    if fix is None:
        return False
    f = list(fix.flags)
    have = {"--optimizer.lr": knobs.lr, "--optimizer.eps": knobs.eps, "--loss.z_loss_weight": knobs.z_loss,
            "--qk_clip.threshold": knobs.qk_clip}
    for k, now in have.items():
        if k in f and now is not None and float(f[f.index(k) + 1]) == float(now):
            return True
    if "--optimizer.betas" in f and knobs.betas is not None:
        i = f.index("--optimizer.betas")
        if (float(f[i + 1]), float(f[i + 2])) == tuple(knobs.betas):
            return True
    return "--model.qk_norm" in f and bool(knobs.qk_norm)


def judge(a: Answer, original: Path, fixed: Path, start: int, stall: bool) -> dict:
    """The incident against the fixed run over the same horizon (the module docstring)."""
    orig_flags = [s for s in flags_of(original) if s > start]
    new_flags = [s for s in flags_of(fixed) if s > start]
    near = [s for s in new_flags if abs(s - a.step) <= WINDOW]
    lo, ln = last_losses(original), last_losses(fixed)
    loss_lower = lo is not None and ln is not None and ln < (1 - GAIN) * lo
    if stall:
        verdict = "lowered" if loss_lower else "not"
    elif not near:
        verdict = "removed"
    elif len(new_flags) < len(orig_flags) or loss_lower:
        verdict = "lowered"
    else:
        verdict = "not"
    return {"verdict": verdict, "flags_original": len(orig_flags), "flags_fixed": len(new_flags), "near": near,
            "last100_original": lo, "last100_fixed": ln}


def _steps_to_train(command: str) -> int:
    """The steps a relaunch trains: its last ``--training.steps`` less the step it starts from
    (an answer's command loads ``--checkpoint.initial_load_path .../step-N``; none: from scratch)."""
    argv = shlex.split(command)

    def last(flag: str) -> str | None:
        at = [i for i, x in enumerate(argv) if x == flag and i + 1 < len(argv)]
        return argv[at[-1] + 1] if at else None

    path = last("--checkpoint.initial_load_path") or ""
    start = int(path.rsplit("step-", 1)[1]) if "step-" in path and path.rsplit("step-", 1)[1].isdigit() else 0
    return int(last("--training.steps") or 0) - start


def run_fix(command: str, extra_env: dict, log: Path) -> int:
    with open(log, "w") as f:
        return subprocess.run(command, shell=True, cwd="/", env=extra_env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=4 * 3600).returncode


def answers_of(dump: Path) -> list[Answer]:
    return [Answer.of(a) for _, a in sorted(of_run.recorded(RunLedger(dump)).items())]


def prove_episodes(dump: Path, parallel: int, env: dict, log: Path) -> dict:
    """``diagnose DUMP --rerun``: every episode's fix proven over its horizon (recorded in the
    run's ledger); its wall time and the training steps it spent."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "titan_ledger.diagnose", str(dump), "--rerun", "--parallel",
                             str(parallel), "--rerun-max-steps", "100000"], env=env, cwd="/", stdout=f,
                            stderr=subprocess.STDOUT, timeout=8 * 3600).returncode
    from titan_ledger.format.answers.of_run import RunAnswers

    proofs = RunAnswers(RunLedger(dump)).proofs()
    return {"rc": rc, "seconds": round(time.perf_counter() - t0), "proofs": len(proofs),
            "steps": sum(p.steps for p in proofs.values())}


def episodes_main(a, runs: list[dict], env: dict) -> int:
    """Issue 77: every run's episodes, each proven over its horizon (``diagnose --rerun``), each
    episode's printed command run as printed over the run's horizon, and every incident judged
    against its episode's command (an incident whose episode prints none: ``no fix``)."""
    from titan_ledger.format.answers.of_run import RunAnswers

    rows, eps_rows, launches = [], [], {}
    for r in runs:
        dump = Path(r["dump"])
        cost = prove_episodes(dump, a.parallel, env, dump.with_name(dump.name + "-prove.log")) if not a.judge_only \
            else {"rc": 0, "seconds": None, "proofs": None, "steps": None}
        ra = RunAnswers(RunLedger(dump))
        eps = ra.episodes()
        _, end = ra.health()
        answers = {s: ra.answer(s) for s in ra.steps()}
        for i, ep in enumerate(eps):
            er = {"scenario": r["scenario"], "seed": r["seed"], "onset": ep.onset, "last": ep.last, "kind": ep.kind,
                  "cause": ep.cause or None, "established": ep.established, "incidents": list(ep.incidents),
                  "fix": ep.fix.change if ep.fix else None, "command": bool(ep.command),
                  "blames_data": ep.cause == "bad_data",  # (no scenario here plants data: every one is wrong)
                  "proof_steps": ep.proof.steps if ep.proof else 0, "run_steps": end, "dump": str(dump)}
            if ep.command:
                key = ep.command.replace(shlex.quote(ep.new_dump), "NEW").replace(ep.new_dump, "NEW")
                launches.setdefault(key, (ep.command, Path(ep.new_dump)))
                er["launch"] = key
            eps_rows.append(er)
            for s in ep.incidents:
                rows.append({"scenario": r["scenario"], "seed": r["seed"], "step": s, "episode": i,
                             "kind": answers[s].kind if answers.get(s) else "spike", "launch": er.get("launch"),
                             "dump": str(dump), "onset": ep.onset})
        r["prove"] = cost

    def one(item):
        key, (command, folder) = item
        if a.judge_only:
            return key, {"rc": 0 if folder.exists() else None, "folder": folder}
        rc = run_fix(command, env, folder.with_suffix(".log"))
        return key, {"rc": rc, "folder": folder}

    with ThreadPoolExecutor(a.parallel) as pool:
        done = dict(pool.map(one, launches.items()))
    for inc in rows:
        key = inc.pop("launch")
        if key is None:
            inc["verdict"] = "no fix"
            continue
        res = done[key]
        ep = next(e for e in eps_rows if e.get("launch") == key)
        if res["rc"] != 0:
            inc["verdict"] = "not run" if res["rc"] is None else f"failed (rc {res['rc']})"
            continue
        start = 0
        command = launches[key][0]
        if "/step-" in command:
            start = int(command.split("/step-", 1)[1].split()[0].strip("'\""))
        fake = SimpleNamespace(step=inc["step"])
        inc.update(judge(fake, Path(inc["dump"]), res["folder"], start, inc["kind"] == "stall"))
        inc["fix"] = ep["fix"]
    # an episode with no incident (a model broken without a spike): judged by its loss
    for er in eps_rows:
        if not er["incidents"] and er.get("launch") and done[er["launch"]]["rc"] == 0:
            lo, ln = last_losses(Path(er["dump"])), last_losses(done[er["launch"]]["folder"])
            er["loss_original"], er["loss_fixed"] = lo, ln
            er["verdict"] = "lowered" if lo is not None and ln is not None and ln < (1 - GAIN) * lo else "not"
        er.pop("launch", None)
    by_run = {}
    for er in eps_rows:
        by_run.setdefault((er["scenario"], er["seed"]), []).append(er)
    good = [x for x in rows if x.get("verdict") in ("removed", "lowered")]
    summary = {
        "runs": len(runs), "runs_with_an_incident_or_episode": len(by_run),
        "runs_with_an_established_episode_and_command": sum(any(e["command"] for e in v) for v in by_run.values()),
        "episodes": len(eps_rows), "episodes_with_a_command": sum(e["command"] for e in eps_rows),
        "incidents": len(rows), "removed": sum(x.get("verdict") == "removed" for x in rows),
        "lowered": sum(x.get("verdict") == "lowered" for x in rows),
        "removed_or_lowered": f"{len(good)}/{len(rows)}" + (f" ({len(good) / len(rows):.0%})" if rows else ""),
        "no_fix": sum(x.get("verdict") == "no fix" for x in rows),
        "episodes_blaming_data_not_data": sum(e["blames_data"] for e in eps_rows),
        "broken_without_incident_lowered": sum(e.get("verdict") == "lowered" for e in eps_rows if not e["incidents"]),
        "proof_steps_share": {f"{e['scenario']}_s{e['seed']}@{e['onset']}": round(e["proof_steps"] / e["run_steps"], 2)
                              for e in eps_rows if e["proof_steps"]},
        "prove_seconds": {f"{r['scenario']}_s{r['seed']}": r["prove"]["seconds"] for r in runs}}
    for er in eps_rows:
        print(json.dumps({"episode": er}) if a.json else
              f"{er['scenario']:<30} s{er['seed']} episode {er['onset']}-{er['last']} {er['kind']:<7} "
              f"{str(er['cause']):<16} {er['established']:<15} incidents {len(er['incidents']):>3} "
              f"{(er['fix'] or '-')[:44]:<44} {er.get('verdict', '')}", flush=True)
    for x in rows:
        if a.json:
            print(json.dumps({"incident": x}), flush=True)
    print(json.dumps({"summary": summary}) if a.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    (a.folder / "episodes.json").write_text(json.dumps({"episodes": eps_rows, "incidents": rows, "summary": summary},
                                                       default=str, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--only", action="append", choices=[*REAL, "plateau", *HELD_OUT])
    ap.add_argument("--episodes", action="store_true",
                    help="issue 77: prove each run's episodes (diagnose --rerun), run each episode's command as "
                         "printed, judge every incident by its episode's command")
    ap.add_argument("--folder", type=Path, default=Path("/tmp/titan_ledger_answers"))
    ap.add_argument("--parallel", type=int, default=2, help="launches side by side (one process each)")
    ap.add_argument("--skip-train", action="store_true", help="reuse the trained runs in --folder")
    ap.add_argument("--judge-only", action="store_true",
                    help="reuse the trained runs and judge only the relaunches already in --folder that reached "
                         "their run's last step (the others: 'not run'); nothing is launched")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the trained runs and the relaunches already in --folder that reached their run's "
                         "last step; launch only the others (an interrupted measurement goes on where it stopped)")
    ap.add_argument("--measured-only", action="store_true",
                    help="relaunch only the answers whose fix was measured (a candidate's command: 'candidate, not run')")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.folder.mkdir(parents=True, exist_ok=True)
    names = a.only or [*REAL, "plateau"]
    jobs = [(n, s) for s in a.seeds for n in names]
    with ThreadPoolExecutor(a.parallel) as pool:
        runs = list(pool.map(lambda j: train(*j, a.folder) if not (a.skip_train or a.judge_only or a.resume) else
                             {"scenario": j[0], "seed": j[1], "dump": str(a.folder / f"{j[0]}_s{j[1]}"), "rc": 0},
                             jobs))
    env = zoo.env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    if a.episodes:
        return episodes_main(a, runs, env)
    # every incident's printed command; the same relaunch (all but the new folder) runs once
    incidents, launches = [], {}
    for r in runs:
        dump = Path(r["dump"])
        led = RunLedger(dump)
        ctx = of_run.context(led)
        for ans in answers_of(dump):
            inc = {"scenario": r["scenario"], "seed": r["seed"], "step": ans.step, "kind": ans.kind,
                   "title": ans.title, "cause": ans.cause or None, "cause_text": ans.cause_text,
                   "established": ans.established, "fix": (ans.fix or (ans.candidates[0] if ans.candidates else None)),
                   "measured": ans.fix is not None and ans.fix.effect != "not measured",
                   "fix_kind": ("measured" if ans.fix.effect != "not measured" else "in_step") if ans.fix else
                   ("candidate" if ans.candidates else None), "start": ans.start, "quarantine": ans.quarantine,
                   "repeats_setting": repeats_setting(ans, ctx.knobs), "dump": str(dump)}
            inc["fix"] = inc["fix"].change if inc["fix"] is not None else None
            if ans.command and (ans.fix is not None or not a.measured_only):
                key = ans.command.replace(shlex.quote(ans.new_dump), "NEW").replace(ans.new_dump, "NEW")
                launches.setdefault(key, (ans.command, Path(ans.new_dump)))
                inc["launch"] = key
            incidents.append((inc, ans))

    def one(item):
        key, (command, folder) = item
        t0 = time.perf_counter()
        rc = run_fix(command, env, folder.with_suffix(".log"))
        return key, {"rc": rc, "folder": folder, "seconds": round(time.perf_counter() - t0)}

    def found(item):  # --judge-only: a relaunch already there, complete when it reached its run's last step
        key, (command, folder) = item
        def last(d):
            return max((int(r["step"]) for r in RunLedger(d).trained_rows()), default=0)

        try:
            complete = last(folder) >= last(Path(inc_dump[key])) > 0
        except Exception:
            complete = False
        return key, {"rc": 0 if complete else None, "folder": folder, "seconds": None}

    inc_dump = {inc["launch"]: inc["dump"] for inc, _ in incidents if "launch" in inc}
    with ThreadPoolExecutor(a.parallel) as pool:
        done = dict(map(found, launches.items())) if (a.judge_only or a.resume) else {}
        todo = {} if a.judge_only else {k: v for k, v in launches.items() if done.get(k, {}).get("rc") != 0}
        todo = dict(sorted(todo.items(), key=lambda kv: _steps_to_train(kv[1][0])))  # the most judged soonest
        print(f"relaunches: {len(launches)}, complete in the folder {len(launches) - len(todo)}, "
              f"to launch {len(todo)}", file=sys.stderr, flush=True)
        done.update(pool.map(one, todo.items()))
    rows = []
    for inc, ans in incidents:
        if "launch" in inc:
            res = done[inc["launch"]]
            start = int(ans.start.split("step-")[1]) if ans.start and "step-" in ans.start else 0
            inc.update(rc=res["rc"], fixed_dump=str(res["folder"]),
                       **(judge(ans, Path(inc["dump"]), res["folder"], start, ans.kind == "stall")
                          if res["rc"] == 0 else {"verdict": "not run" if res["rc"] is None
                                                  else f"failed (rc {res['rc']})"}))
        else:
            inc["verdict"] = "candidate, not run" if ans.command else "no fix"
        inc.pop("launch", None)
        rows.append(inc)
        if a.json:
            print(json.dumps(inc), flush=True)
        else:
            print(f"{inc['scenario']:<30} s{inc['seed']} step {inc['step']:>5} {inc['title'][:30]:<30} "
                  f"{inc['cause_text'][:40]:<40} {inc['established']:<15} {inc['verdict']:<10} "
                  f"{(inc['fix'] or '')[:50]}", flush=True)
    fixed = [r for r in rows if r["verdict"] not in ("no fix", "candidate, not run", "not run")]
    good = [r for r in fixed if r["verdict"] in ("removed", "lowered")]
    measured = [r for r in fixed if r["measured"]]
    good_measured = [r for r in measured if r["verdict"] in ("removed", "lowered")]
    own = [r for r in fixed if r["fix_kind"] == "in_step"]
    good_own = [r for r in own if r["verdict"] in ("removed", "lowered")]
    summary = {"runs": len(runs), "runs_failed": [r["scenario"] for r in runs if r["rc"]], "incidents": len(rows),
               "with_a_printed_command": sum(r["verdict"] != "no fix" for r in rows),
               "not_run": sum(r["verdict"] in ("candidate, not run", "not run") for r in rows),
               "with_a_printed_fix": len(fixed), "measured_fix": len(measured),
               "measured_removed_or_lowered": f"{len(good_measured)}/{len(measured)}"
                                              + (f" ({len(good_measured) / len(measured):.0%})" if measured else ""),
               "in_step_cause_fix": len(own),
               "in_step_removed_or_lowered": f"{len(good_own)}/{len(own)}",
               "candidates_only": sum(r["fix_kind"] == "candidate" and r["verdict"] == "no fix" for r in rows),
               "removed": sum(r["verdict"] == "removed" for r in fixed),
               "lowered": sum(r["verdict"] == "lowered" for r in fixed),
               "removed_or_lowered": f"{len(good)}/{len(fixed)}" + (f" ({len(good) / len(fixed):.0%})" if fixed else ""),
               "relaunches": len(launches), "relaunch_failures": sum(1 for d in done.values() if d["rc"]),
               "relaunches_judged": sum(1 for d in done.values() if d["rc"] == 0),
               "repeat_the_runs_setting": sum(r["repeats_setting"] for r in rows),
               "quarantine_after_a_non_data_verdict": sum(r["quarantine"] and r["cause"] != "bad_data" for r in rows)}
    print(json.dumps({"summary": summary}) if a.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    (a.folder / "answers.json").write_text(json.dumps({"incidents": rows, "summary": summary}, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
