"""Ledger equality across source trees: the same real training runs, every ledger file,
normalized, dumped; two dumps compared.

    python bench/ledger_equal.py --tree DIR --out OUT        # run the set on DIR's code
    python bench/ledger_equal.py --compare A B               # equal per run/file? exit 1 if not
    python bench/ledger_equal.py --compare A B --spellings --mask python
                                                             # across a flag rename (issue 69), trees
                                                             # run with different interpreters

Each run is a real ``torchrun --nproc_per_node 2 -m titan_ledger.train`` (gloo, CPU, as
``tests/helpers.torchrun`` launches it, cold: no warm launcher) with ``DIR`` as the working
directory and first on ``PYTHONPATH`` (checked: ``titan_ledger`` must import from ``DIR``).
The flags are the e2e tests' own (tests/e2e/test_deferred_e2e.py, test_proof_e2e.py):

    clean            debug_cpu, DP 2, 10 steps, default features
    ladder_deferred  the deferred ladder (none, skip_update, rollback*3; 3 bitflips, 1 repeat,
                     checkpoints every 4, the data ending at 16), decisions deferred (default)
    ladder_in_step   the same with --ledger.response.no_defer
    proof_faults     bitflip at 6 on DP 0 (proven hardware), repeat at 10 on DP 1 (proven
                     bad_data, quarantined), forced proofs 11-12, action rollback, deferred
    proof_all_in_step   12 steps, scope = all, every step from 2 forced through a proof, no_defer
    proof_all_deferred  the same, deferred (the default)

All share debug_cpu.toml with --training.local_batch_size 2 --training.seq_len 128 (the e2e
BASE). About 3-4 minutes in all on 2 CPU cores, one run at a time.

Every run trains into the same fixed dump folder (``--scratch``, default
/tmp/ledger_equal_scratch/<run>; fixed so that the recorded argv and the config digest,
which include the dump folder, are the same for every tree and every output folder; a lock
keeps two invocations from sharing it). Written under OUT:

    OUT/<run>/meta.json          exit code, wall seconds (not compared), the dump folder's layout
    OUT/<run>/ledger/<file>      every file under <dump>/ledger (recursively), normalized:
                                 JSON lines re-serialized in their own key order, with the
                                 varying fields' values replaced by "<varies>" (key kept)
    OUT/<run>/train.log          the launch's output (not compared)

Normalization (found by running the baseline twice and diffing; only what differs between
two identical runs):
    time            wall-clock seconds of a segment header (every ledger file's header)
    run_id          random per launch (headers, segments.jsonl, spike events' own header)
    step_time_s     per-step wall time (signals rows)
    data_loading_s  per-step data-loading wall time (signals rows)
    seconds         a proof's wall time and each of its executions' (spike events' proof)
    and, in every string, the tree's path -> <TREE>, the scratch dump path -> <DUMP>
    (the header's cwd; argv paths), so that trees at other paths compare.
``*.idx`` offset indexes are byte offsets into the raw files (which shift with the length of
a float's repr of a time): compared as the set of keys per line with offsets masked.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

VARIES = "<varies>"
# fields whose values differ between two launches of the same run (see the module doc)
VARYING = {"time", "run_id", "step_time_s", "data_loading_s", "seconds",
           # a hash of the resolved config, whose paths (the bundled tokenizer) lie under the
           # tree: it differs with the tree's path and cannot be substituted; the argv that
           # made the config is compared
           "config_digest"}
IDX_VARYING = {"offset"}

BASE = ["--job.config_file", "train_configs/debug_cpu.toml", "--training.local_batch_size", "2",
        "--training.seq_len", "128"]
# tests/e2e/test_deferred_e2e.py: BASE + PAIRS["ladder"] (+ --ledger.response.no_defer)
LADDER = ["--ledger.proof.scope", "off",
          "--training.steps", "18", "--ledger.spike.window", "5",
          "--ledger.response.policy", "act", "--ledger.response.action", "none,skip_update,rollback*3",
          "--ledger.rehearsal.inject", "6:0:bitflip,10:1:bitflip,13:0:bitflip,15:1:repeat",
          "--checkpoint.enable", "--checkpoint.interval", "4", "--ledger.rollback.back", "0",
          "--ledger.rollback.skip", "1", "--ledger.rehearsal.data_end", "16"]
# tests/e2e/test_proof_e2e.py: BASE + RUNS["faults"]
PROOF = ["--training.steps", "12", "--ledger.spike.window", "8",
         "--ledger.rehearsal.inject", "6:0:bitflip,10:1:repeat",
         "--ledger.response.policy", "act", "--ledger.response.action", "rollback", "--checkpoint.enable", "--checkpoint.interval", "4",
         "--ledger.rehearsal.prove_at", "11-12"]
PROOF_ALL = ["--training.steps", "12", "--ledger.spike.window", "8",
             "--ledger.proof.scope", "all", "--ledger.rehearsal.prove_at", "2-12"]
RUNS: dict[str, list[str]] = {
    "clean": [*BASE, "--training.steps", "10"],
    "ladder_deferred": [*BASE, *LADDER],
    "ladder_in_step": [*BASE, *LADDER, "--ledger.response.no_defer"],
    "proof_faults": [*BASE, *PROOF],
    # test_proof_e2e.py RUNS["clean"] / ["clean_deferred"]: every step from 2 on forced through a proof
    "proof_all_in_step": [*BASE, *PROOF_ALL, "--ledger.response.no_defer"],
    "proof_all_deferred": [*BASE, *PROOF_ALL],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "PYTHONPATH")}
    env.update(TITAN_LEDGER_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(tree))
    env.pop("TITAN_LEDGER_TORCHRUN", None)  # no warm launcher
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _check_import(python: str, tree: Path) -> None:
    p = subprocess.run([python, "-c", "import titan_ledger, torchtitan; print(titan_ledger.__file__); "
                        "print(torchtitan.__file__)"], cwd=tree, env=_env(tree), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"cannot import titan_ledger from {tree}:\n{p.stderr}")
    where = Path(p.stdout.splitlines()[0]).resolve()
    if tree.resolve() not in where.parents:
        sys.exit(f"titan_ledger imports from {where}, not from {tree}")
    print(f"titan_ledger: {where}\ntorchtitan:   {p.stdout.splitlines()[1]}", flush=True)


# ---- normalization

def _subst(x, subs):
    if isinstance(x, str):
        for old, new in subs:
            x = x.replace(old, new)
        return x
    if isinstance(x, list):
        return [_subst(v, subs) for v in x]
    if isinstance(x, dict):
        return {k: _subst(v, subs) for k, v in x.items()}
    return x


def _mask(x, keys):
    """Mask the varying fields' values wherever they are (nested records included)."""
    if isinstance(x, list):
        return [_mask(v, keys) for v in x]
    if isinstance(x, dict):
        out = {k: (VARIES if k in keys and v is not None else _mask(v, keys)) for k, v in x.items()}
        src = out.get("source")
        if isinstance(src, str) and src.startswith("text:") and src.count(":") == 2:
            # a text source's identity ends in the HF dataset's fingerprint, which hashes the
            # data files' paths -- under the tree for the bundled corpus -- and the data
            # fingerprint hashes that: the source's name and every row compare
            out["source"] = src.rsplit(":", 1)[0] + ":" + VARIES
            if "fingerprint" in out:
                out["fingerprint"] = VARIES
        return out
    return x


def normalize_text(text: str, subs, keys) -> list[str]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            out.append(line)
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            out.append("<not json> " + _subst(line, subs))  # a torn line is content too
            continue
        out.append(json.dumps(_mask(_subst(rec, subs), keys), ensure_ascii=False))
    return out


def normalize_file(path: Path, subs) -> list[str]:
    name = path.name
    raw = path.read_bytes()
    if name.endswith(".idx"):
        return normalize_text(raw.decode(errors="replace"), subs, IDX_VARYING)
    if name.endswith((".jsonl", ".json")):
        return normalize_text(raw.decode(), subs, VARYING)
    return [f"<binary sha256 {hashlib.sha256(raw).hexdigest()} {len(raw)} bytes>"]


def _layout(dump: Path) -> list[str]:
    """The dump folder's folders and non-log files (the ledger's listed file by file below)."""
    out = []
    for p in sorted(dump.rglob("*")):
        rel = p.relative_to(dump).as_posix()
        if rel.startswith(("structured_logs", "ledger/")) or "/step-" in rel and p.is_file():
            continue
        out.append(rel + ("/" if p.is_dir() else ""))
    return out


def run_set(tree: Path, out: Path, scratch: Path, python: str, only: list[str] | None) -> int:
    tree = tree.resolve()
    _check_import(python, tree)
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    lock = open(scratch / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    t_all = time.monotonic()
    bad = 0
    for name, args in RUNS.items():
        if only and name not in only:
            continue
        dump = scratch / name
        shutil.rmtree(dump, ignore_errors=True)
        cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{_free_port()}", "-m", "titan_ledger.train",
               *args, "--job.dump_folder", str(dump)]
        t0 = time.monotonic()
        p = subprocess.run(cmd, cwd=tree, env=_env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=900)
        wall = time.monotonic() - t0
        rdir = out / name
        shutil.rmtree(rdir, ignore_errors=True)
        (rdir / "ledger").mkdir(parents=True)
        (rdir / "train.log").write_text(" ".join(cmd) + "\n\n" + p.stdout)
        subs = [(str(dump), "<DUMP>"), (str(tree), "<TREE>")]
        files = sorted(f for f in (dump / "ledger").rglob("*") if f.is_file()) if (dump / "ledger").is_dir() else []
        for f in files:
            rel = f.relative_to(dump / "ledger")
            dst = rdir / "ledger" / (rel.as_posix() + ".norm")
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text("\n".join(normalize_file(f, subs)) + "\n")
        meta = {"run": name, "argv": [_subst(a, subs) for a in args], "returncode": p.returncode,
                "layout": _layout(dump), "ledger_files": [f.relative_to(dump / "ledger").as_posix() for f in files],
                "wall_s": round(wall, 1)}
        (rdir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{name:16s} rc={p.returncode} {wall:6.1f} s  {len(files)} ledger files", flush=True)
        bad += p.returncode != 0 and name not in EXPECTED_FAIL
    print(f"total {time.monotonic() - t_all:.1f} s -> {out}")
    return 1 if bad else 0


EXPECTED_FAIL: set[str] = set()
NOT_COMPARED = {"wall_s"}  # meta.json


# ---- comparison

def _first_diff(a, b, path="") -> str | None:
    if type(a) is not type(b):
        return f"{path or '<record>'}: {json.dumps(a)[:200]} != {json.dumps(b)[:200]}"
    if isinstance(a, dict):
        if list(a) != list(b):
            missing, extra = [k for k in a if k not in b], [k for k in b if k not in a]
            if missing or extra:
                return f"{path or '<record>'}: keys only in A {missing}, only in B {extra}"
            return f"{path or '<record>'}: key order {list(a)} != {list(b)}"
        for k in a:
            d = _first_diff(a[k], b[k], f"{path}.{k}" if path else k)
            if d:
                return d
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        return None
    if a != b:
        return f"{path or '<value>'}: {json.dumps(a)[:200]} != {json.dumps(b)[:200]}"
    return None


def _line_diff(la: list[str], lb: list[str]) -> str | None:
    for n, (x, y) in enumerate(zip(la, lb), 1):
        if x == y:
            continue
        try:
            d = _first_diff(json.loads(x), json.loads(y))
        except ValueError:
            d = None
        return f"line {n}: {d or (x[:200] + ' != ' + y[:200])}"
    if len(la) != len(lb):
        return f"{len(la)} lines != {len(lb)} lines (first extra: line {min(len(la), len(lb)) + 1})"
    return None


def compare(a: Path, b: Path, spellings: bool = False, mask: tuple[str, ...] = ()) -> int:
    """Equal per run and file? ``spellings``: old flag spellings read in today's on both sides
    (two trees across a rename: ``format.spellings``); ``mask``: more keys masked (a value two
    trees record differently by setup, not behaviour, e.g. ``python``, the interpreter's path)."""
    keys = VARYING | set(mask)

    def today(text: str) -> str:
        if not spellings:
            return text
        from titan_ledger.format.spellings import renamed_text

        return renamed_text(text)

    def norm(text: str) -> list[str]:
        return normalize_text(today(text), [], keys)

    runs = sorted({p.name for p in a.iterdir() if p.is_dir()} | {p.name for p in b.iterdir() if p.is_dir()})
    differ = 0
    for run in runs:
        ra, rb = a / run, b / run
        if not ra.is_dir() or not rb.is_dir():
            print(f"{run}: only in {'A' if ra.is_dir() else 'B'}")
            differ += 1
            continue
        ma, mb = (json.loads(today((r / "meta.json").read_text())) for r in (ra, rb))
        for k in sorted((set(ma) | set(mb)) - NOT_COMPARED):
            if ma.get(k) != mb.get(k):
                d = _first_diff(ma.get(k), mb.get(k), k)
                print(f"{run}/meta.json: DIFFERENT {d}")
                differ += 1
        files = sorted({p.relative_to(ra).as_posix() for p in (ra / "ledger").rglob("*.norm")} |
                       {p.relative_to(rb).as_posix() for p in (rb / "ledger").rglob("*.norm")})
        for f in files:
            fa, fb = ra / f, rb / f
            shown = f"{run}/{f[:-5]}"
            if not fa.exists() or not fb.exists():
                print(f"{shown}: DIFFERENT (only in {'A' if fa.exists() else 'B'})")
                differ += 1
                continue
            # masked again here, so that dumps made before a key joined VARYING compare
            d = _line_diff(*(norm(f.read_text()) for f in (fa, fb)))
            if d:
                print(f"{shown}: DIFFERENT {d}")
                differ += 1
            else:
                print(f"{shown}: equal ({len(fa.read_text().splitlines())} lines)")
    print("ALL EQUAL" if not differ else f"{differ} difference(s)")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, help="source tree: PYTHONPATH and working directory of the runs")
    ap.add_argument("--out", type=Path, help="output folder for the normalized dump")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    ap.add_argument("--spellings", action="store_true",
                    help="--compare: read old flag spellings in today's on both sides (trees across a rename)")
    ap.add_argument("--mask", action="append", default=[], metavar="KEY",
                    help="--compare: mask this key too (e.g. python: the interpreter's path)")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/ledger_equal_scratch"),
                    help="fixed dump-folder root for the runs (keep it the same across dumps: the config "
                         "digest in every header includes the dump folder)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for torchrun (default: this one)")
    ap.add_argument("--no-mask", action="store_true",
                    help="mask nothing (paths are still substituted): to find which fields vary")
    ap.add_argument("--only", nargs="*", choices=list(RUNS), help="a subset of the runs")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare, spellings=args.spellings, mask=tuple(args.mask))
    if args.no_mask:
        VARYING.clear()
        IDX_VARYING.clear()
    if not args.tree or not args.out:
        ap.error("--tree DIR --out OUT, or --compare A B")
    return run_set(args.tree, args.out, args.scratch, args.python, args.only)


if __name__ == "__main__":
    sys.exit(main())
