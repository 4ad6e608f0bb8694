"""Grow a real run's ledger into one that looks like DP ``dp`` x ``steps`` steps.

    from bench.ledger_grow import source_run, grown, grow
    src = source_run(Path("/tmp/ledger_scale"))           # trains once (6 steps, DP 2), cached
    dst, info = grown(Path("/tmp/ledger_scale"), 64, 20000)  # grows once per (dp, steps, segments), cached
    grow(src, Path("/tmp/x"), 8, 1000, segments=3)         # the grower itself

**The source** (:func:`source_run`): a real 6-step DP-2 run of
``train_configs/debug_cpu_indexed.toml`` (the bundled corpus as an indexed corpus,
prepared into the work dir on first use), with ``--ledger.spike.window 8
--ledger.rehearsal.inject 5:1:repeat --ledger.proof.scope off`` so that the trainer
flags step 5 (``zscore_grad_norm``) and the source holds a real spike event, a real
rejected-steps event and a real spike row of ``signals.jsonl`` to repeat. Its data
rows are ``titan_ledger.data/2`` derived rows (``samples`` + ``digest`` + ``doc_loss``);
the injected batch (DP rank 1, step 5, written out as ``rows``) is not used as a template.

**Growing** (:func:`grow`) repeats the source's rows, cycling through its steps, with the
numbers moved on: ``step``; ``consumed_samples`` / ``consumed_tokens`` (global batch and
tokens per step scaled to ``dp``); a data row's ``samples: [first, end)`` moves by the
new global batch per step (``first = (step - 1) * global_batch``). The per-rank batch is
kept (``global_batch = source global_batch / source dp * dp``, same ``mbs``), so
``DataLedger.step_ids`` lays out each DP rank's ids exactly as a real DP-``dp`` run
would: unique across ranks and steps. Every DP rank r gets ``data_dp<r>.jsonl`` and
``rank<r>.jsonl`` (the source is DP only: every rank owns its loss), built from the
source rank ``r % source_dp``, with ``world_size`` / ``dp_size`` / ``dp_rank`` / ``rank``
/ ``global_batch`` set in its header. ``spikes`` steps (:func:`spike_steps`) get the
source's spike row (``spike: true``) and one event each in ``spikes.jsonl`` and
``rejected_steps.jsonl``; ``segments.jsonl`` has one launch-log row per segment;
``checkpoint/step-N/.metadata`` markers (empty; a complete checkpoint is listed by that
file) at every tenth of the run and at every resume point.

**Digests.** A derived row's ``digest`` is a hash of the tokens the corpus gives for the
row's sample ids: a moved range has other tokens, so the source's digest would be wrong
and hashing every moved step is far too slow (DP 512 x 137,000 steps: 280M rows). The
grown rows therefore carry **no** ``digest`` (the reader derives their rows without the
check) -- except at the steps a tool is asked about: every spike step and the
:func:`probe_steps` (middle and end), where the correct digest is computed from the
corpus (``layout.row_digest`` / ``step_digest``), so ``lookup`` / ``diagnose`` / ``report``
there pay the verification a real ledger costs. A data row without a digest is about 28
bytes shorter than the run's. A source whose data rows are written out (``rows``: a text
source) is grown as ``rows`` with the sample ids moved (spans copied; a text stream's
content is not a function of the id, nothing checks it).

**Segments** (``segments > 1``): the run is cut at ``segments - 1`` resume points (each a
checkpoint step); segment k (``seq`` k, a new ``run_id``, ``resumed_from`` = the previous
segment's resume point) writes a new header in every file and a launch-log row, and the
previous segment ran ``overlap`` steps past that point (its rows there are superseded,
kept in the files as history, like a crash after the last checkpoint).

**Writing** is streamed: one template string per (file kind, source step) with the
numbers substituted by ``%`` formatting, a block of steps formatted once per source rank
and the same bytes appended to every file of that rank class; nothing holds a file in
memory (DP 64: about 300 MB/s here). Free disk is checked against an estimate first
(:class:`NoSpace`). **The offset index** (:func:`index_ledger`, in a subprocess that
imports the code being measured): if ``titan_ledger.format.index`` has
``build_index(path)``, it is called on every written ``.jsonl`` with segment headers (the
indexed reader keeps an offset index beside each file); else, if it has the writer's
``note_segment(path, offset, seq)`` (in ``index`` or ``records``), it is called for every
header in order, as ``records.RecordWriter`` does; neither: plain JSONL, as the writer of that checkout
writes. A cached grown ledger is re-indexed when ``index.py`` changed since.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The ledger's file names and schema ids (docs/ledgers.md). The grower reads and writes the
# JSONL itself, so it does not depend on the reader being measured (titan_ledger.format).
LEDGER = "ledger"
SIGNALS_FILE, SPIKES_FILE, REJECTED_FILE, SEGMENTS_FILE = (
    "signals.jsonl", "spikes.jsonl", "rejected_steps.jsonl", "segments.jsonl")
SCHEMA = {SPIKES_FILE: "titan_ledger.spikes/1", REJECTED_FILE: "titan_ledger.rejected/1",
          SEGMENTS_FILE: "titan_ledger.segments/1"}


def data_file(r: int) -> str:
    return f"data_dp{r}.jsonl"


def rank_file(r: int) -> str:
    return f"rank{r}.jsonl"

#: the source run's training flags (besides the dump folder and the corpus path)
SOURCE_STEPS = 6
SOURCE_SPIKE = 5
SOURCE_ARGS = ["--job.config_file", str(ROOT / "train_configs" / "debug_cpu_indexed.toml"),
               "--training.steps", str(SOURCE_STEPS), "--ledger.spike.window", "8",
               "--ledger.rehearsal.inject", f"{SOURCE_SPIKE}:1:repeat", "--ledger.proof.scope", "off"]
GROW_VERSION = 1  # bump when the grown layout changes: cached ledgers of another version are regrown
MARKER = "grow.json"  # written last into a grown dump folder: its parameters and stats
BLOCK = 2048  # steps formatted per block
_S = 987654321000  # sentinel numbers in the templates (replaced by %(...)d)


class NoSpace(RuntimeError):
    """The grown ledger would not fit on the disk."""


# --------------------------------------------------------------------------- the plan
def spike_steps(steps: int, spikes: int) -> list[int]:
    """The flagged steps: ``spikes`` of them, at 0.7/spikes, 1.7/spikes, ... of the run
    (the last one near the end; none at step 1)."""
    out = sorted({min(steps, max(2, int(steps * (i + 0.7) / spikes))) for i in range(spikes)})
    return out if spikes > 0 else []


def probe_steps(steps: int) -> dict[str, int]:
    """The steps the point queries ask about: the middle and the last."""
    return {"mid": max(1, steps // 2), "end": steps}


@dataclass(frozen=True)
class Seg:
    seq: int
    run_id: str
    resumed_from: int  # 0: a fresh start
    first: int
    last: int  # the last step it wrote
    current_last: int  # the last step not superseded by a later segment


def plan_segments(steps: int, segments: int) -> list[Seg]:
    """Segment k resumes from the checkpoint at round((k-1) * steps / segments); each
    but the last runs ``overlap`` steps past the next resume point (superseded rows)."""
    if segments < 1 or steps < 4 * segments:
        raise ValueError(f"{segments} segments need at least {4 * segments} steps, got {steps}")
    cuts = [round(k * steps / segments) for k in range(1, segments)]
    overlap = max(1, min(100, steps // segments // 10))
    out, start = [], 0
    for k in range(segments):
        end = cuts[k] if k < len(cuts) else steps
        last = min(steps, end + overlap) if k < len(cuts) else steps
        out.append(Seg(k + 1, uuid.uuid4().hex[:12], start, start + 1, last, end))
        start = end
    return out


def checkpoint_steps(steps: int, segs: list[Seg]) -> list[int]:
    every = max(1, steps // 10)
    return sorted({*range(every, steps + 1, every), *(s.resumed_from for s in segs if s.resumed_from)})


# --------------------------------------------------------------------------- templates
def _template(row: dict, subst: dict[str, Any]) -> str:
    """``row`` as the writer serialises it, with ``subst`` (path -> name) turned into
    ``%(name)d`` placeholders. ``subst`` keys: a top-level key, or ``key.i`` (list item)."""
    row = json.loads(json.dumps(row))
    marks = {}
    for n, (path, name) in enumerate(subst.items()):
        mark = _S + n
        key, _, idx = path.partition(".")
        if idx:
            row[key][int(idx)] = mark
        else:
            row[key] = mark
        marks[str(mark)] = name
    text = json.dumps(row, separators=(",", ":"), allow_nan=False).replace("%", "%%")
    for mark, name in marks.items():
        assert text.count(mark) == 1, (mark, text)
        text = text.replace(mark, f"%({name})d")
    return text + "\n"


def _strip(row: dict, *keys: str) -> dict:
    return {k: v for k, v in row.items() if k not in keys}


def _header(hdr: dict, src_dump: Path, dst_dump: Path, seg: Seg, steps: int, t0: float,
            **changes) -> dict:
    out = dict(hdr)
    out = {"schema": out.pop("schema"), **out}
    out.update(run_id=seg.run_id, seq=seg.seq, time=t0 + seg.seq)
    if "resumed_from" in out:
        out["resumed_from"] = seg.resumed_from
    if "started_after_step" in out:
        out["started_after_step"] = seg.resumed_from
    if isinstance(out.get("argv"), list):
        argv = [a.replace(str(src_dump), str(dst_dump)) for a in out["argv"]]
        for i, a in enumerate(argv[:-1]):
            if a == "--training.steps":
                argv[i + 1] = str(steps)
        out["argv"] = argv
    for k, v in changes.items():
        if k in out or k in ("world_size", "dp_size"):
            out[k] = v
    return out


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()


class _Out:
    """One output file: unbuffered appends (a block is one write), bytes and header offsets counted."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "ab", buffering=0)
        self.bytes = 0
        self.headers: list[list[int | None]] = []  # [offset, seq] of every segment header

    def header(self, hdr: dict) -> None:
        self.headers.append([self.f.tell(), hdr.get("seq")])
        self.write(_line(hdr))

    def write(self, data: bytes) -> None:
        self.f.write(data)
        self.bytes += len(data)

    def close(self) -> None:
        self.f.close()


#: run by :func:`index_ledger` with the measured code first on the path: the writer's index hooks
_INDEX_SCRIPT = r"""
import json, sys
from pathlib import Path
try:
    from titan_ledger.format import index
except ImportError:
    print("none"); sys.exit(0)
if not Path(index.__file__).resolve().is_relative_to(Path.cwd().resolve()):
    print("none"); sys.exit(0)  # not the measured code's (an editable install's finder found it elsewhere)
spec = json.loads(Path(sys.argv[1]).read_text())
led = Path(spec["ledger"])
from titan_ledger.format import records
build = getattr(index, "build_index", None)
note = getattr(index, "note_segment", None) or getattr(records, "note_segment", None)  # the writer's half
if callable(build):
    for name in spec["headers"]:
        build(led / name)
    print("build_index")
elif callable(note):
    for name, hs in spec["headers"].items():
        for off, seq in hs:
            note(led / name, off, seq)
    print("note_segment")
else:
    print("none")
"""


def code_version(code_root: Path = ROOT) -> str:
    """What ``titan_ledger/format/index.py`` holds at ``code_root``: a hash, or ``absent``."""
    import hashlib

    p = Path(code_root) / "titan_ledger" / "format" / "index.py"
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.exists() else "absent"


def index_ledger(dst_dump: Path, headers: dict[str, list], code_root: Path = ROOT) -> str:
    """Give the grown ledger the offset index the code at ``code_root`` keeps:
    ``titan_ledger.format.index.build_index(path)`` on every file with segment headers if
    it exists, else ``note_segment(path, offset, seq)`` (``index``'s or ``records``') for every header in order (what
    ``RecordWriter`` calls before each header), else nothing. Stale ``*.idx`` files are
    removed first. Runs in a subprocess with ``code_root`` first on the path (the code
    being measured, e.g. a ``--snapshot``). Returns the hook used. The launch log
    (``segments.jsonl``) gets none: the writer appends it without ``RecordWriter``."""
    led = Path(dst_dump) / LEDGER
    for p in led.glob("*.idx"):
        p.unlink()
    spec = led.parent / "index-spec.json"
    spec.write_text(json.dumps({"ledger": str(led), "headers": headers}))
    env = {**_run_env(), "PYTHONPATH": os.pathsep.join([str(code_root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _INDEX_SCRIPT, str(spec)], cwd=code_root, env=env,
                         capture_output=True, text=True)
    spec.unlink()
    if out.returncode != 0:
        raise RuntimeError(f"indexing {led} failed: {out.stderr.strip()[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


# --------------------------------------------------------------------------- grow
@dataclass
class _Seg:
    """The last segment of a source file: its header and rows (as stored: non-finite
    values stay the strings the writer wrote)."""

    header: dict
    rows: list


def _last_segment(path: Path) -> _Seg:
    seg = None
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue  # a torn line
            if not isinstance(obj, dict):
                continue
            if "schema" in obj:
                seg = _Seg(obj, [])
            elif seg is not None and isinstance(obj.get("step"), int):
                seg.rows.append(obj)
    if seg is None:
        raise ValueError(f"{path}: no segment header")
    return seg


def _by_rank(led: Path, prefix: str) -> dict[int, Path]:
    out = {}
    for p in led.glob(f"{prefix}*.jsonl"):
        r = p.name[len(prefix):-len(".jsonl")]
        if r.isdigit():
            out[int(r)] = p
    return dict(sorted(out.items()))


def _read_source(src: Path) -> dict:
    led = src / LEDGER
    sig = _last_segment(led / SIGNALS_FILE)
    data = {r: _last_segment(p) for r, p in _by_rank(led, "data_dp").items()}
    ranks = {r: _last_segment(p) for r, p in _by_rank(led, "rank").items()}
    if not data:
        raise ValueError(f"{led}: no data ledger")
    h0 = data[0].header
    src_dp = int(h0["dp_size"])
    if set(data) != set(range(src_dp)):
        raise ValueError(f"{led}: data ledgers of DP ranks {sorted(data)}, expected 0..{src_dp - 1}")
    if int(h0.get("world_size", src_dp)) != src_dp or (ranks and set(ranks) != set(range(src_dp))):
        raise ValueError(f"{led}: the grower takes a DP-only source (world size = DP size, a "
                         f"rank<r>.jsonl per rank or none), got world {h0.get('world_size')}, DP {src_dp}, "
                         f"rank files {sorted(ranks)}")
    events = {name: (_last_segment(led / name) if (led / name).exists() else None)
              for name in (SPIKES_FILE, REJECTED_FILE)}
    return {"signals": sig, "data": data, "ranks": ranks, "events": events}


def _digests(hdr: dict, gb: int, mbs: int, dp: int, per_rank: int, steps: list[int]) -> dict[tuple[int, int], str]:
    """The correct ``digest`` of DP rank r at each of ``steps`` (a derived row): the tokens
    the corpus recorded in the header gives for the rank's moved sample ids, hashed the
    way the loader hashes them (``layout.row_digest`` / ``step_digest``)."""
    from titan_ledger.data.indexed import Blend, IndexedCorpus
    from titan_ledger.data.layout import row_digest, step_digest

    spec = hdr["spec"]
    corpora = [IndexedCorpus(p, hdr["seq_len"], spec["seed"], spec.get("cache_dir") or None,
                             shuffle=spec.get("shuffle", True)) for p in spec["paths"]]
    blend = Blend(corpora, spec["weights"], rule=spec.get("blend_rule") or 1)
    out = {}
    for s in steps:
        for r in range(dp):
            ids = _ids(gb, mbs, dp, r, s, per_rank).values()
            out[(s, r)] = step_digest([row_digest(*blend.row(i)[:2]) for i in ids])
    return out


_DIGEST = "@@digest@@"


def _with_digest(row: dict) -> dict:
    """``row`` with a ``digest`` right after ``samples`` (where the writer puts it)."""
    out = {}
    for k, v in row.items():
        out[k] = v
        if k == "samples":
            out["digest"] = _DIGEST
    return out


def estimate_bytes(src_dump: Path, dp: int, steps: int, segments: int = 1) -> int:
    """About how many bytes :func:`grow` writes (rows from the source's mean row sizes)."""
    src = _read_source(Path(src_dump))
    segs = plan_segments(steps, segments)
    rows = sum(s.last - s.first + 1 for s in segs)

    def mean(seg: _Seg) -> float:
        return sum(len(_line(r)) for r in seg.rows) / max(1, len(seg.rows))

    sig = mean(src["signals"])
    data = sum(mean(s) for s in src["data"].values()) / len(src["data"])
    rank = sum(mean(s) for s in src["ranks"].values()) / len(src["ranks"]) if src["ranks"] else 0
    hdr = len(_line(src["signals"].header))
    return int(1.05 * rows * (sig + dp * (data + rank)) + segments * hdr * (2 * dp + 4))


def grow(src_dump: Path, dst_dump: Path, dp: int, steps: int, *, segments: int = 1,
         spikes: int = 5, check_disk: bool = True, code_root: Path = ROOT) -> dict:
    """Write ``<dst_dump>/ledger/`` (and checkpoint markers) as a DP ``dp`` x ``steps`` run
    grown from the real run in ``src_dump`` (see the module docstring). Refuses
    (:class:`NoSpace`) when the estimate does not fit the free disk; ``dst_dump`` must
    not hold a ledger yet. Returns what was written: bytes, seconds, MB/s, the spike,
    probe, digest-verified and checkpoint steps, the segments."""
    src_dump, dst_dump = Path(src_dump), Path(dst_dump)
    t_start = time.perf_counter()
    src = _read_source(src_dump)
    segs = plan_segments(steps, segments)
    led = dst_dump / LEDGER
    if led.exists() and any(led.iterdir()):
        raise FileExistsError(f"{led}: already holds a ledger; grow into an empty dump folder")
    est = estimate_bytes(src_dump, dp, steps, segments)
    if check_disk:
        probe = dst_dump
        while not probe.exists():
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if est + (1 << 30) > free:
            raise NoSpace(f"growing DP {dp} x {steps} steps needs about {est / 1e9:.1f} GB (+1 GB "
                          f"headroom) in {probe}, which has {free / 1e9:.1f} GB free; choose smaller "
                          f"sizes or another --work folder")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and 2 * dp + 16 > soft:
        raise OSError(f"DP {dp} needs {2 * dp + 16} open files, the limit is {soft} (ulimit -n)")
    led.mkdir(parents=True, exist_ok=True)

    # -------------------------------------------------------------- layout
    src_dp = len(src["data"])
    h0 = src["data"][0].header
    src_gb, mbs = int(h0["global_batch"]), int(h0["mbs"])
    per_rank = src_gb // src_dp
    gb = per_rank * dp
    sig_rows = src["signals"].rows
    last = sig_rows[-1]
    tokens_per_step = int(round(last["consumed_tokens"] / last["step"] * dp / src_dp))
    spikes_at = spike_steps(steps, spikes)
    probes = probe_steps(steps)
    # an injected batch (the source's rehearsal spike) is written out whatever the source: not a template
    plain = {r: [x for x in seg.rows if "last_step" not in x and not x.get("injected")] for r, seg in src["data"].items()}
    derived = all("rows" not in x for rows in plain.values() for x in rows)
    verified = sorted({*spikes_at, *probes.values()}) if derived and any(
        "digest" in x for x in plain[0]) else []
    digests = _digests(dict(h0), gb, mbs, dp, per_rank, verified) if verified else {}
    t0 = time.time()

    # -------------------------------------------------------------- templates
    spike_src = [r for r in sig_rows if r.get("spike")]
    normal_src = [r for r in sig_rows if not r.get("spike") and not r.get("skipped")] or sig_rows
    sig_subst = {"step": "step", "consumed_samples": "samples", "consumed_tokens": "tokens"}
    sig_normal = [_template(dict(r, skipped_samples=0), sig_subst) for r in normal_src]
    if spike_src:
        sig_spike = _template(dict(spike_src[-1], skipped_samples=0), sig_subst)
    else:  # a source without a flagged step: its row with the flag set and a 10x grad norm
        r = dict(normal_src[0], spike=True, skipped_samples=0)
        r["grad_norm"] = 10 * float(r.get("grad_norm") or 1.0)
        sig_spike = _template(r, sig_subst)
    rank_tmpl = {r: [_template(row, {"step": "step"}) for row in seg.rows] for r, seg in src["ranks"].items()}
    ev = {}
    for name in (SPIKES_FILE, REJECTED_FILE):
        seg = src["events"][name]
        flagged = [e for e in (seg.rows if seg else []) if "rules" in e]
        ev[name] = _template(flagged[-1] if flagged else {"step": 0, "rules": ["zscore_grad_norm"],
                                                          **({"action": "none"} if name == SPIKES_FILE else {})},
                             {"step": "step"})
    data_tmpl: dict[int, list[str]] = {}  # per source DP rank, per source step
    data_tmpl_d: dict[int, list[str]] = {}  # the same with a "digest" (verified steps)
    for r, rows in plain.items():
        rows = [_strip(x, "digest") for x in rows]
        if derived:
            subst = {"step": "step", "samples.0": "first", "samples.1": "end"}
            data_tmpl[r] = [_template(x, subst) for x in rows]
            data_tmpl_d[r] = [_template(_with_digest(x), subst).replace(f'"{_DIGEST}"', '"%(digest)s"')
                              for x in rows]
        else:
            data_tmpl[r] = [_rows_template(x, per_rank) for x in rows]

    # -------------------------------------------------------------- files
    sig_f = _Out(led / SIGNALS_FILE)
    ev_f = {name: _Out(led / name) for name in ev}
    data_f = {r: _Out(led / data_file(r)) for r in range(dp)}
    rank_f = {r: _Out(led / rank_file(r)) for r in range(dp)} if rank_tmpl else {}  # as the source: none
    hdrs = {"signals": src["signals"].header, "rank": src["ranks"], "data": src["data"],
            "events": {n: (s.header if s else {"schema": SCHEMA[n]}) for n, s in src["events"].items()}}
    world = {"world_size": dp, "dp_size": dp}
    launch_log = led / SEGMENTS_FILE
    rows_written = 0
    t_write = time.perf_counter()
    try:
        with open(launch_log, "wb") as f:
            f.write((json.dumps({"schema": SCHEMA[SEGMENTS_FILE]}) + "\n").encode())
        for seg in segs:
            common = dict(src_dump=src_dump, dst_dump=dst_dump, seg=seg, steps=steps, t0=t0)
            sh = _header(hdrs["signals"], **common, **world)
            sig_f.header(sh)
            for name, out in ev_f.items():
                out.header(_header(hdrs["events"][name], **common, **world))
            for r in range(dp):
                sr = r % src_dp
                data_f[r].header(_header(hdrs["data"][sr].header, **common, **world, dp_rank=r, global_batch=gb))
                if rank_f:
                    rank_f[r].header(_header(hdrs["rank"][sr].header, **common, **world, rank=r, dp_rank=r))
            row = {k: v for k, v in sh.items() if k not in ("schema", "keys")}
            row["step"] = seg.resumed_from
            with open(launch_log, "ab") as f:
                f.write(_line(row))

            for a in range(seg.first, seg.last + 1, BLOCK):
                b = min(seg.last, a + BLOCK - 1)
                # signals: one row per step, the spike row at a (current) spike step
                sig_f.write("".join(
                    (sig_spike if s in spikes_at and s <= seg.current_last else sig_normal[(s - 1) % len(sig_normal)])
                    % {"step": s, "samples": s * gb, "tokens": s * tokens_per_step}
                    for s in range(a, b + 1)).encode())
                for name, out in ev_f.items():
                    hits = [s for s in spikes_at if a <= s <= b and s <= seg.current_last]
                    if hits:
                        out.write("".join(ev[name] % {"step": s} for s in hits).encode())
                # rank files: the same bytes for every rank of a source rank class
                for sr, ts in rank_tmpl.items():
                    text = "".join(ts[(s - 1) % len(ts)] % {"step": s} for s in range(a, b + 1)).encode()
                    for r in range(sr, dp, src_dp):
                        rank_f[r].write(text)
                # data files: runs of plain steps shared per source rank, verified steps per rank
                cuts = [s for s in verified if a <= s <= b]
                lo = a
                for c in [*cuts, b + 1]:
                    if lo < c:
                        _data_run(data_f, data_tmpl, lo, c - 1, gb, mbs, dp, src_dp, derived, per_rank)
                    if c <= b:
                        _data_one(data_f, data_tmpl_d if derived else data_tmpl, c, gb, mbs, dp, src_dp,
                                  derived, per_rank, digests)
                    lo = c + 1
                rows_written += (b - a + 1) * (1 + 2 * dp)
    finally:
        for out in (sig_f, *ev_f.values(), *data_f.values(), *rank_f.values()):
            out.close()
    t_write = time.perf_counter() - t_write
    headers = {o.path.name: o.headers for o in (sig_f, *ev_f.values(), *data_f.values(), *rank_f.values())}
    t_index = time.perf_counter()
    index = index_ledger(dst_dump, headers, code_root)
    t_index = time.perf_counter() - t_index
    ckpts = checkpoint_steps(steps, segs)
    for c in ckpts:
        d = dst_dump / "checkpoint" / f"step-{c}"
        d.mkdir(parents=True, exist_ok=True)
        (d / ".metadata").touch()
    written = sum(p.stat().st_size for p in led.iterdir() if p.is_file())
    secs = time.perf_counter() - t_start
    info = {"version": GROW_VERSION, "src": str(src_dump), "dp": dp, "steps": steps, "segments": segments,
            "spikes": spike_steps(steps, spikes), "probes": probes, "verified_digest_steps": verified,
            "digest": "correct at verified steps, absent elsewhere" if derived else "rows written out",
            "global_batch": gb, "mbs": mbs, "checkpoints": ckpts, "estimate_bytes": est,
            "bytes": written, "rows": rows_written, "seconds": round(secs, 3),
            "write_s": round(t_write, 3), "mb_per_s": round(written / 1e6 / t_write, 1) if t_write > 0 else None,
            "index": index, "index_code": code_version(code_root), "index_s": round(t_index, 3),
            "segments_plan": [s.__dict__ for s in segs], "headers": headers}
    (dst_dump / MARKER).write_text(json.dumps(info, indent=1) + "\n")
    return info


def _rows_template(row: dict, per_rank: int) -> str:
    """An explicit-rows data row with its step and each row's sample id as placeholders."""
    row = json.loads(json.dumps(row))
    if len(row["rows"]) != per_rank:
        raise ValueError(f"a data row holds {len(row['rows'])} rows, the layout says {per_rank}")
    row["step"] = _S
    for i, t in enumerate(row["rows"]):
        t[0] = _S + 1 + i
    text = json.dumps(row, separators=(",", ":"), allow_nan=False).replace("%", "%%")
    text = text.replace(str(_S) + ",", "%(step)d,", 1)
    for i in range(per_rank):
        text = text.replace(f"[{_S + 1 + i},", f"[%(id{i})d,", 1)
    return text + "\n"


def _ids(gb: int, mbs: int, dp: int, r: int, s: int, per_rank: int) -> dict[str, int]:
    from titan_ledger.data.layout import round_size, sample_id

    base, out = (s - 1) * gb, {}
    for m in range(per_rank // mbs):
        pos = base + m * round_size(mbs, dp)
        for j in range(mbs):
            out[f"id{m * mbs + j}"] = sample_id(pos, r, mbs, j)
    return out


def _data_run(files, tmpl, a, b, gb, mbs, dp, src_dp, derived, per_rank) -> None:
    for sr, ts in tmpl.items():
        if derived:
            text = "".join(ts[(s - 1) % len(ts)] % {"step": s, "first": (s - 1) * gb, "end": s * gb}
                           for s in range(a, b + 1)).encode()
            for r in range(sr, dp, src_dp):
                files[r].write(text)
        else:  # explicit rows: the ids differ per rank
            for r in range(sr, dp, src_dp):
                files[r].write("".join(ts[(s - 1) % len(ts)] % {"step": s, **_ids(gb, mbs, dp, r, s, per_rank)}
                                       for s in range(a, b + 1)).encode())


def _data_one(files, tmpl, s, gb, mbs, dp, src_dp, derived, per_rank, digests) -> None:
    for r in range(dp):
        ts = tmpl[r % src_dp]
        t = ts[(s - 1) % len(ts)]
        if derived:
            line = t % {"step": s, "first": (s - 1) * gb, "end": s * gb, "digest": digests[(s, r)]}
        else:
            line = t % {"step": s, **_ids(gb, mbs, dp, r, s, per_rank)}
        files[r].write(line.encode())


# --------------------------------------------------------------------------- cached runs
def _run_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def source_run(work: Path, *, log=print, code_root: Path = ROOT) -> Path:
    """The real 6-step DP-2 run the ledgers are grown from (trained on first use, ~20 s on
    2 CPU cores; its corpus prepared into ``<work>/source/corpora``), cached in
    ``<work>/source/run``."""
    base = Path(work) / "source"
    dump = base / "run"
    marker = base / "source.json"
    if marker.exists() and (dump / LEDGER / SIGNALS_FILE).exists():
        return dump
    if dump.exists():
        shutil.rmtree(dump)
    base.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
            "-m", "titan_ledger.train", *SOURCE_ARGS, "--job.dump_folder", str(dump),
            "--dataloader.paths", str(base / "corpora" / "bundled")]
    log(f"ledger_grow: training the source run (6 steps, DP 2) into {dump}")
    t = time.perf_counter()
    env = {**_run_env(), "PYTHONPATH": os.pathsep.join([str(code_root), os.environ.get("PYTHONPATH", "")])}
    with open(base / "train.log", "w") as f:
        rc = subprocess.run(args, cwd=code_root, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = (base / "train.log").read_text()[-3000:]
        raise RuntimeError(f"the source run failed (exit {rc}); {base / 'train.log'} ends:\n{tail}")
    marker.write_text(json.dumps({"args": args, "seconds": round(time.perf_counter() - t, 1)}) + "\n")
    return dump


def grown(work: Path, dp: int, steps: int, segments: int = 1, spikes: int = 5, *, log=print,
          code_root: Path = ROOT) -> tuple[Path, dict]:
    """The grown dump folder for (dp, steps, segments) under ``<work>/grown/`` (grown on
    first use from :func:`source_run`) and its ``grow.json``; re-indexed when the offset
    index code at ``code_root`` is not the one it was indexed with."""
    work = Path(work)
    src = source_run(work, log=log, code_root=code_root)
    dst = work / "grown" / f"dp{dp}-steps{steps}-seg{segments}"
    marker = dst / MARKER
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("version") == GROW_VERSION and info.get("spikes") == spike_steps(steps, spikes) \
                and info.get("src") == str(src):
            if info.get("index_code") != code_version(code_root):
                t = time.perf_counter()
                info.update(index=index_ledger(dst, info["headers"], code_root), index_code=code_version(code_root),
                            index_s=round(time.perf_counter() - t, 3))
                marker.write_text(json.dumps(info, indent=1) + "\n")
                log(f"ledger_grow: re-indexed {dst} ({info['index']}, {info['index_s']} s)")
            return dst, info
    if dst.exists():
        shutil.rmtree(dst)
    log(f"ledger_grow: growing DP {dp} x {steps} steps ({segments} segment(s)) into {dst} "
        f"(about {estimate_bytes(src, dp, steps, segments) / 1e6:.0f} MB)")
    info = grow(src, dst, dp, steps, segments=segments, spikes=spikes, code_root=code_root)
    log(f"ledger_grow: {info['bytes'] / 1e6:.0f} MB in {info['seconds']:.1f} s ({info['mb_per_s']} MB/s)")
    return dst, info
