"""What reading a ledger costs as a run grows: the relaunch, point queries, whole-run readers.

    python bench/bench_ledger_scale.py --quick                  # DP 8 x 1000 and DP 64 x 1000, a few minutes
    python bench/bench_ledger_scale.py --sizes 64x2000,64x20000 [--json FILE] [--repeats 3]
    python bench/bench_ledger_scale.py                          # the default set (below)
    python bench/bench_ledger_scale.py --full                   # + DP 512 x 137000, DP 64 x 137000 (~30 GB of ledger)

Each size is a dump folder grown once by ``bench/ledger_grow.py`` from a real 6-step
DP-2 indexed-corpus run (trained on first use, ~20 s) and cached under ``--work``
(default ``/tmp/ledger_scale``) by (DP, steps, ``--segments``). The bench measures
whatever ``titan_ledger`` is checked out (the working tree): the same command before
and after a reader change is the comparison. ``--snapshot [REV]`` measures a committed
revision instead (default HEAD; a ``git archive`` copy in a temporary folder, first on
every child's path and its working directory), e.g. the committed readers while the
working tree holds someone's unfinished rewrite.

Every command is a **fresh Python subprocess** (``sys.executable``, cwd the repository),
timed from spawn to exit (wall s) with its peak RSS from ``os.wait4``'s ``ru_maxrss``
(peak MB). A command that runs past ``--timeout`` (default 600 s) is killed and reported
as ``timeout``; one whose resident memory passes ``--mem-limit-gb`` (default 85% of the
machine's memory) is killed and reported as ``oom``; a non-zero exit is ``rc=N`` (its log
is kept under ``<work>/out/<size>/``). Before a size is measured its ledger files are
read once (a warm page cache, as for a tool run right after training wrote them).

Commands per size (``D`` the dump folder, ``T`` the last spike step, ``mid``/``end`` the
middle and last steps; the steps are :func:`ledger_grow.spike_steps` / ``probe_steps``,
where the grown rows carry a correct ``digest``, so the queries verify it as on a real
ledger):

* relaunch -- what a launch does with the ledger before training, each as ``python -c``:
  ``claim`` = ``run_folder.claim_dump_folder(D, "ledger", layout, read_only=True)`` with
  the recorded run's layout (seq_len, global batch, fingerprint); ``load_config`` =
  ``train.load_config(argv)`` (its ``check_files`` -> ``check_dump_folder_run`` ->
  ``claim_dump_folder`` -> ``RunLedger(D).data.header()``), argv the recorded run's
  (DP ``dp``, ``--checkpoint.enable``: a relaunch that resumes), ``WORLD_SIZE=dp RANK=0
  LOCAL_RANK=0``; ``rejected`` = ``RunLedger(D).rejected_steps()`` (the trainer's
  ``auto_skip`` read at setup). Baselines, printed too: ``baseline: import`` (the same
  imports, nothing read) and ``baseline: load_config empty`` (``load_config`` of the same
  argv on an empty dump folder). ``net s`` = wall - its baseline's wall (claim, rejected:
  the import; load_config: load_config on the empty folder); ``in-proc s`` = the call
  alone, timed inside the child.
* point queries: ``lookup --step mid``, ``lookup --step end``, ``diagnose D --step T``,
  the run's episodes (``RunAnswers(RunLedger(D)).episodes()``: the signals' columns and the
  event log, whatever the DP size),
  ``report D --step T -o ...``, ``rollback D --step T --skip-from T --back 100`` (the
  default window right after the checkpoint need not contain T; ``--back`` T/2 on tiny runs), and the postmortem of T
  (no CLI: ``python -c`` of ``tools.postmortem.actions_at(RunLedger(D), T)``).
* whole-run readers (MB/s = ledger MB / wall s): ``replay check D D``, ``diagnose D``
  (every flagged step), ``report D -o ...`` (every spike), ``plot D -o x.png``; skipped
  for ledgers over ``--whole-max-mb`` (default 1000 MB) unless ``--all-readers``.

``--repeats N`` runs each command N times: wall min / median / max, peak MB the largest.
``cpu s`` (the child's user + system time) is less sensitive than wall time to other work
on the machine; each run records the load average too.
``--json FILE`` saves every run (rewritten after each command).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import ledger_grow  # noqa: E402

CODE_ROOT = ROOT  # the titan_ledger the children import (--snapshot: a git archive copy)

DEFAULT_SIZES = [(8, 1000), (8, 10000), (8, 137000), (64, 1000), (64, 10000), (512, 1000), (512, 20000)]
FULL_EXTRA = [(512, 137000), (64, 137000)]
QUICK_SIZES = [(8, 1000), (64, 1000)]
GROUPS = ("relaunch", "point", "whole")
INPROC = "BENCH_INPROC"  # a child's own timing of the call, one stdout line

IMPORTS = ("import time, warnings; warnings.simplefilter('ignore'); t0 = time.perf_counter(); "
           "from titan_ledger import train; from titan_ledger.components.run.run_folder import claim_dump_folder; "
           "from titan_ledger.format.reader import RunLedger; train.quiet_imports(); ")


#: ``sitecustomize.py`` of a snapshot: drop the editable install's import hooks, so a module
#: the snapshot lacks is missing, not imported from the working tree
NO_EDITABLE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
"""


def _timed(call: str) -> str:
    return IMPORTS + f"t = time.perf_counter(); {call}; print({INPROC!r}, time.perf_counter() - t)"


# --------------------------------------------------------------------------- one child
def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_child(argv: list[str], *, log: Path, timeout: float, mem_limit_mb: float,
              env: dict[str, str] | None = None) -> dict:
    """Run ``argv`` (its own session), wait with ``os.wait4``: wall s, CPU s (user + system,
    from the same rusage), peak MB (ru_maxrss), exit code, status (ok, rc=N, timeout, oom),
    the 1-minute load average at its end and the child's ``BENCH_INPROC`` line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join([str(CODE_ROOT), os.environ.get("PYTHONPATH", "")])
        proc = subprocess.Popen(argv, cwd=CODE_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        done: dict = {}

        def waiter():
            _, status, ru = os.wait4(proc.pid, 0)
            done.update(t=time.perf_counter(), status=status, ru=ru)

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        killed = None
        while th.is_alive():
            th.join(0.05)
            if not th.is_alive():
                break
            if time.perf_counter() - t0 > timeout:
                killed = "timeout"
            elif _rss_mb(proc.pid) > mem_limit_mb:
                killed = "oom"
            if killed:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                th.join()
        proc.returncode = os.waitstatus_to_exitcode(done["status"])
    wall = done["t"] - t0
    rc = proc.returncode
    text = log.read_text(errors="replace")
    inproc = None
    for line in text.splitlines():
        if line.startswith(INPROC):
            inproc = float(line.split()[1])
    status = killed or ("ok" if rc == 0 else f"rc={rc}")
    ru = done["ru"]
    res = {"wall_s": round(wall, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
           "peak_mb": round(ru.ru_maxrss / 1024, 1), "rc": rc, "status": status,
           "loadavg": round(os.getloadavg()[0], 2)}
    if inproc is not None:
        res["inproc_s"] = round(inproc, 4)
    if status not in ("ok", "timeout", "oom"):
        res["error"] = (text.strip().splitlines() or [""])[-1][:300]
    return res


# --------------------------------------------------------------------------- the commands of a size
def _first_header(path: Path) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.readline())


def commands(dump: Path, info: dict, out: Path, empty: Path) -> list[dict]:
    """``{group, name, argv, env, baseline}`` of every command measured on ``dump``."""
    py = sys.executable
    dp, steps = info["dp"], info["steps"]
    mid, end = info["probes"]["mid"], info["probes"]["end"]
    spike = info["spikes"][-1]
    led = dump / "ledger"
    hdr = _first_header(led / "data_dp0.jsonl")
    layout = {"seq_len": hdr["seq_len"], "global_batch": hdr["global_batch"], "fingerprint": hdr.get("fingerprint")}
    corpus = hdr["spec"]["paths"][0]
    per_rank = hdr["global_batch"] // dp

    def train_argv(folder: Path) -> list[str]:
        return ["--job.config_file", str(CODE_ROOT / "train_configs" / "debug_cpu_indexed.toml"),
                "--job.dump_folder", str(folder), "--training.steps", str(steps),
                "--training.local_batch_size", str(per_rank), "--dataloader.paths", corpus,
                "--parallelism.data_parallel_shard_degree", str(dp), "--checkpoint.enable"]

    rank_env = {**os.environ, "WORLD_SIZE": str(dp), "RANK": "0", "LOCAL_RANK": "0"}
    load = "train.load_config({!r})"
    c = []

    def add(group, name, argv, env=None, baseline=None):
        c.append({"group": group, "name": name, "argv": argv, "env": env, "baseline": baseline})

    add("relaunch", "baseline: import", [py, "-c", _timed("pass")])
    add("relaunch", "baseline: load_config empty", [py, "-c", _timed(load.format(train_argv(empty)))], rank_env)
    add("relaunch", "claim_dump_folder",
        [py, "-c", _timed(f"claim_dump_folder({str(dump)!r}, 'ledger', {layout!r}, read_only=True)")],
        baseline="baseline: import")
    add("relaunch", "load_config", [py, "-c", _timed(load.format(train_argv(dump)))], rank_env,
        baseline="baseline: load_config empty")
    add("relaunch", "rejected_steps", [py, "-c", _timed(f"RunLedger({str(dump)!r}).rejected_steps()")],
        baseline="baseline: import")
    m = [py, "-m"]
    add("point", f"lookup --step {mid}", [*m, "titan_ledger.lookup", "--dump-folder", str(dump), "--step", str(mid)])
    add("point", f"lookup --step {end}", [*m, "titan_ledger.lookup", "--dump-folder", str(dump), "--step", str(end)])
    add("point", f"diagnose --step {spike}", [*m, "titan_ledger.diagnose", str(dump), "--step", str(spike)])
    add("point", f"report --step {spike}",
        [*m, "titan_ledger.report", str(dump), "--step", str(spike), "-o", str(out / "report-step.html")])
    add("point", f"rollback --step {spike}",  # a window from the spike: valid whatever the checkpoint spacing
        [*m, "titan_ledger.rollback", str(dump), "--step", str(spike), "--skip-from", str(spike),
         "--back", str(min(100, spike // 2))])
    add("point", f"postmortem {spike} (actions_at)",
        [py, "-c", "from titan_ledger.format.reader import RunLedger; "
                   "from titan_ledger.tools.postmortem import actions_at; "
                   f"print(actions_at(RunLedger({str(dump)!r}), {spike}))"])
    # the run's answer, as a view without torch reads it (diagnose, report): the event log, the
    # recorded health spans, a few rows by the offset index; the data ledger unread
    add("point", "episodes (the run's answer)",
        [py, "-c", "import time; t = time.perf_counter(); from titan_ledger.format.reader import RunLedger; "
                   "from titan_ledger.format.answers.of_run import RunAnswers; "
                   f"eps = RunAnswers(RunLedger({str(dump)!r})).episodes(); "
                   f"print({INPROC!r}, time.perf_counter() - t); print(len(eps), 'episodes')"])
    add("whole", "replay check D D", [*m, "titan_ledger.replay", "check", str(dump), str(dump)])
    add("whole", "diagnose (all)", [*m, "titan_ledger.diagnose", str(dump)])
    add("whole", "report (every spike)", [*m, "titan_ledger.report", str(dump), "-o", str(out / "report.html")])
    add("whole", "plot", [*m, "titan_ledger.plot", str(dump), "-o", str(out / "plot.png")])
    return c


def ledger_mb(dump: Path) -> float:
    return sum(p.stat().st_size for p in (dump / "ledger").iterdir() if p.is_file()) / 1e6


def warm(dump: Path) -> None:
    """Read every ledger file once (the page cache holds what a tool right after training finds)."""
    for p in (dump / "ledger").iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 23):
                    pass


def summarize(runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs if r["status"] == "ok"]
    s = {"status": runs[-1]["status"] if not walls else ("ok" if len(walls) == len(runs) else "mixed"),
         "peak_mb": max(r["peak_mb"] for r in runs)}
    if walls:
        s.update(wall_min=min(walls), wall_med=round(statistics.median(walls), 3), wall_max=max(walls),
                 cpu_med=round(statistics.median(r["cpu_s"] for r in runs if r["status"] == "ok"), 3))
    inproc = [r["inproc_s"] for r in runs if "inproc_s" in r]
    if inproc:
        s["inproc_med"] = round(statistics.median(inproc), 4)
    for key in ("error",):
        if any(key in r for r in runs):
            s[key] = next(r[key] for r in runs if key in r)
    return s


# --------------------------------------------------------------------------- the table
def fmt_wall(r: dict) -> str:
    if "wall_med" not in r:
        return r["status"]
    if r["wall_min"] == r["wall_max"]:
        return f"{r['wall_med']:.2f}"
    return f"{r['wall_med']:.2f} [{r['wall_min']:.2f}-{r['wall_max']:.2f}]"


def table(results: list[dict]) -> str:
    head = ["size", "ledger MB", "command", "wall s", "cpu s", "peak MB", "net s", "in-proc s", "MB/s", "status"]
    rows = []
    for r in results:
        size = f"DP {r['dp']} x {r['steps']}" + (f" ({r['segments']} seg)" if r["segments"] > 1 else "")
        net = f"{r['net_s']:.2f}" if r.get("net_s") is not None else ""
        inproc = f"{r['inproc_med']:.3f}" if r.get("inproc_med") is not None else ""
        mbs = f"{r['mb_per_s']:.1f}" if r.get("mb_per_s") else ""
        cpu = f"{r['cpu_med']:.2f}" if r.get("cpu_med") is not None else ""
        rows.append([size, f"{r['ledger_mb']:.0f}", r["name"], fmt_wall(r), cpu, f"{r['peak_mb']:.0f}", net, inproc, mbs,
                     r["status"] + (f": {r['error']}" if r.get("error") else "")])
    widths = [max(len(h), *(len(x[i]) for x in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            dp, steps = part.split("x")
            out.append((int(dp), int(steps.replace("_", ""))))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sizes: {part!r} is not DPxSTEPS (e.g. 64x2000)") from None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=parse_sizes, help="DPxSTEPS,... (e.g. 8x1000,64x2000)")
    ap.add_argument("--quick", action="store_true", help="DP 8 x 1000 and DP 64 x 1000 only")
    ap.add_argument("--full", action="store_true", help="add DP 512 x 137000 and DP 64 x 137000")
    ap.add_argument("--segments", type=int, default=1, help="launch segments of each grown run (resumes)")
    ap.add_argument("--spikes", type=int, default=5, help="flagged steps in each grown run")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ledger_scale"), help="source run, grown ledgers, logs")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per command")
    ap.add_argument("--mem-limit-gb", type=float, default=None, help="kill a command past this RSS (default 85%% of RAM)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"which of {', '.join(GROUPS)}")
    ap.add_argument("--only", default="", help="comma-separated substrings: only commands whose name holds one")
    ap.add_argument("--all-readers", action="store_true", help="whole-run readers at every size")
    ap.add_argument("--whole-max-mb", type=float, default=1000, help="largest ledger the whole-run readers read")
    ap.add_argument("--json", type=Path, help="save every run here")
    ap.add_argument("--snapshot", nargs="?", const="HEAD", metavar="REV",
                    help="measure the committed REV (default HEAD), not the working tree")
    args = ap.parse_args(argv)
    global CODE_ROOT
    snapshot = None
    if args.snapshot:
        snapshot = tempfile.TemporaryDirectory(prefix="bench_ledger_scale_")
        archive = subprocess.run(["git", "archive", "--format=tar", args.snapshot], cwd=ROOT, capture_output=True)
        if archive.returncode:
            ap.error(f"--snapshot {args.snapshot}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", snapshot.name], input=archive.stdout, check=True)
        CODE_ROOT = Path(snapshot.name)
        # the editable install's finder would serve modules the snapshot lacks from the working tree
        (CODE_ROOT / "sitecustomize.py").write_text(NO_EDITABLE)
    try:
        return _main(args, ap)
    finally:
        if snapshot is not None:
            snapshot.cleanup()


def _main(args, ap) -> int:

    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES + (FULL_EXTRA if args.full else []))
    groups = [g for g in args.groups.split(",") if g]
    only = [o for o in args.only.split(",") if o]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        ap.error(f"--groups: unknown {bad}; choose from {GROUPS}")
    mem_limit = (args.mem_limit_gb * 1024 if args.mem_limit_gb else
                 0.85 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    rev = args.snapshot or "HEAD"
    head = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = not args.snapshot and bool(subprocess.run(["git", "status", "--porcelain", "titan_ledger"], cwd=ROOT,
                                                      capture_output=True, text=True).stdout.strip())
    code = f"{head} (snapshot of {rev})" if args.snapshot else f"{head}{' + uncommitted changes' if dirty else ''}"
    meta = {"code": code, "titan_ledger_dirty": dirty, "python": sys.executable, "work": str(args.work),
            "timeout_s": args.timeout, "mem_limit_mb": round(mem_limit), "repeats": args.repeats,
            "segments": args.segments, "cpus": os.cpu_count()}
    say(f"bench_ledger_scale: titan_ledger at {code}; sizes "
        + ", ".join(f"{d}x{s}" for d, s in sizes))
    results: list[dict] = []
    grows: list[dict] = []
    empty = args.work / "empty-dump"
    empty.mkdir(parents=True, exist_ok=True)

    def save():
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "grow": grows, "results": results}, indent=1) + "\n")

    # one discarded child first: the imports' files in the page cache before the first baseline
    run_child([sys.executable, "-c", _timed("pass")], log=args.work / "out" / "warmup.log", timeout=args.timeout,
              mem_limit_mb=mem_limit)
    for dp, steps in sizes:
        try:
            dump, info = ledger_grow.grown(args.work, dp, steps, args.segments, args.spikes, log=say,
                                           code_root=CODE_ROOT)
        except ledger_grow.NoSpace as e:
            say(f"skipped DP {dp} x {steps}: {e}")
            results.append({"dp": dp, "steps": steps, "segments": args.segments, "ledger_mb": 0, "name": "(grow)",
                            "group": "grow", "status": "no disk", "peak_mb": 0, "error": str(e)})
            continue
        grows.append({k: v for k, v in info.items() if k not in ("segments_plan", "headers")})
        mb = ledger_mb(dump)
        out = args.work / "out" / f"dp{dp}-steps{steps}-seg{args.segments}"
        warm(dump)
        done: dict[str, dict] = {}
        for c in commands(dump, info, out, empty):
            if c["group"] not in groups or (only and not any(o in c["name"] for o in only)):
                continue
            base = {"dp": dp, "steps": steps, "segments": args.segments, "ledger_mb": round(mb, 1),
                    "group": c["group"], "name": c["name"], "argv": shlex.join(c["argv"])}
            if c["group"] == "whole" and mb > args.whole_max_mb and not args.all_readers:
                results.append({**base, "status": "skipped", "peak_mb": 0})
                say(f"  DP {dp} x {steps}  {c['name']}: skipped ({mb:.0f} MB > --whole-max-mb {args.whole_max_mb:.0f})")
                continue
            runs = []
            for k in range(args.repeats):
                log = out / f"{c['name'].replace(' ', '_').replace('/', '_')}.{k}.log"
                runs.append(run_child(c["argv"], log=log, timeout=args.timeout, mem_limit_mb=mem_limit, env=c["env"]))
            r = {**base, **summarize(runs), "runs": runs}
            if c["baseline"] and "wall_med" in r and "wall_med" in done.get(c["baseline"], {}):
                r["net_s"] = round(r["wall_med"] - done[c["baseline"]]["wall_med"], 3)
            if c["group"] == "whole" and "wall_med" in r:
                r["mb_per_s"] = round(mb / r["wall_med"], 2)
            done[c["name"]] = r
            results.append(r)
            save()
            say(f"  DP {dp} x {steps} ({mb:.0f} MB)  {c['name']}: {fmt_wall(r)} s, {r['peak_mb']:.0f} MB"
                + (f", net {r['net_s']:.2f} s" if r.get("net_s") is not None else "")
                + ("" if r["status"] == "ok" else f"  [{r['status']}{': ' + r['error'] if r.get('error') else ''}]"))
    save()
    for g in grows:
        print(f"grown DP {g['dp']} x {g['steps']} ({g['segments']} seg): {g['bytes'] / 1e6:.0f} MB in "
              f"{g['seconds']:.1f} s ({g['mb_per_s']} MB/s; index: {g['index']})")
    print(f"titan_ledger: {code}")
    print(table([r for r in results if r.get("group") != "grow"] + [r for r in results if r.get("group") == "grow"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
