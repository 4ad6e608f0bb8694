"""bench/ledger_grow.py: ledgers grown from a tiny source ledger written through
``records.RecordWriter`` (no training) are read by the readers, with the sample ids of a
real DP-``dp`` run; one slow smoke test of bench/bench_ledger_scale.py (it trains the
source run)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, load_bench

from titan_ledger.data.indexed import Blend, IndexedCorpus, IndexedWriter
from titan_ledger.data.layout import round_size, row_digest, sample_id, step_digest
from titan_ledger.format import records
from titan_ledger.format.data_reader import step_ids
from titan_ledger.format.reader import RunLedger

lg = load_bench("ledger_grow")

SRC_DP, MBS, ROUNDS, SEQ_LEN, SRC_STEPS, SPIKE = 2, 2, 2, 16, 6, 5
SRC_GB = MBS * SRC_DP * ROUNDS


def _corpus(tmp: Path) -> Path:
    rng = np.random.default_rng(0)
    prefix = tmp / "corpus" / "tiny"
    prefix.parent.mkdir(parents=True)
    w = IndexedWriter(prefix, np.uint16)
    for _ in range(60):
        w.add(rng.integers(1, 500, size=int(rng.integers(5, 80))).astype(np.uint16))
    w.finish()
    return prefix


def _ids(step: int, r: int, dp: int, gb: int) -> list[int]:
    base = (step - 1) * gb
    return [sample_id(base + m * round_size(MBS, dp), r, MBS, j)
            for m in range(gb // round_size(MBS, dp)) for j in range(MBS)]


def make_source(dump: Path, corpus: Path) -> Path:
    """A finished 6-step DP-2 run with derived data rows (samples + a correct digest),
    per-rank losses, a spike at step 5 and its events, the launch log: what the trainer
    writes, through ``RecordWriter``."""
    led = dump / "ledger"
    spec = {"dataset": "tiny", "dataset_path": None, "paths": [str(corpus)], "weights": [1.0], "seed": 7,
            "shuffle": True, "cache_dir": "", "hf": None, "blend_rule": 2}
    blend = Blend([IndexedCorpus(corpus, SEQ_LEN, 7)], [1.0], rule=2)
    common = {"run_id": "src00000001", "seq": 1, "resumed_from": 0, "time": 1.0, "config_digest": "d1",
              "world_size": SRC_DP, "dp_size": SRC_DP, "param_dtype": "float32",
              "argv": ["--job.dump_folder", str(dump), "--training.steps", str(SRC_STEPS)], "cwd": str(ROOT)}
    records.append_segment(led, records.Header(schema="", **{k: common[k] for k in ("run_id", "seq", "resumed_from",
                                                                                     "time")},
                                               extra={k: v for k, v in common.items()
                                                      if k not in ("run_id", "seq", "resumed_from", "time")}))
    sig = records.RecordWriter(led / records.SIGNALS_FILE, {"schema": records.SIGNALS.id, **common,
                                                            "keys": list(records.SIGNAL_KEYS)})
    for s in range(1, SRC_STEPS + 1):
        spike = s == SPIKE
        loss = 8.0 - 0.01 * s + 0.003 * math.sin(s)
        gn = 10.0 if spike else 0.5 + 0.01 * s
        sig.write({"step": s, "consumed_samples": s * SRC_GB, "consumed_tokens": s * SRC_GB * SEQ_LEN,
                   "loss": loss, "loss_max": loss + 0.02, "loss_max_rank": s % SRC_DP, "grad_norm": gn,
                   "grad_norm_clipped": min(gn, 1.0), "num_zeros": 0, "masked_tokens": 0, "param_norm": 700.0,
                   "update_norm": None, "max_logit": 0.7, "z_loss": 65.0, "logz_mean": 8.0, "logz_max": 8.2,
                   "qk_clip_heads": None, "qk_clip_eta_min": None, "lr": 4e-4, "skipped": False,
                   "skipped_samples": 0, "spike": spike, "spike_note": False, "update_skipped": False,
                   "step_time_s": 0.6, "data_loading_s": 0.001})
    sig.close()
    ev = {k: v for k, v in common.items() if k != "resumed_from"}
    sp = records.RecordWriter(led / records.SPIKES_FILE, {"schema": records.SPIKES.id, **ev, "started_after_step": 0})
    sp.write({"step": SPIKE, "loss": 7.95, "grad_norm": 10.0, "loss_max_rank": 0, "rules": ["zscore_grad_norm"],
              "notes": [], "action": "none"})
    sp.close()
    rj = records.RecordWriter(led / records.REJECTED_FILE, {"schema": records.REJECTED.id, **ev,
                                                            "started_after_step": 0})
    rj.write({"step": SPIKE, "rules": ["zscore_grad_norm"]})
    rj.close()
    for r in range(SRC_DP):
        rk = records.RecordWriter(led / records.rank_file(r), {"schema": records.RANK.id, **common, "rank": r,
                                                               "dp_rank": r})
        dw = records.RecordWriter(led / records.data_file(r), {
            "schema": records.DATA.id, **common, "source_kind": "indexed", "source": "indexed:tiny",
            "fingerprint": "fp-tiny", "mbs": MBS, "seq_len": SEQ_LEN, "dp_rank": r, "spec": spec,
            "global_batch": SRC_GB, "skip_lr": "freeze", "tokenizer": "", "skip_steps": []})
        for s in range(1, SRC_STEPS + 1):
            rk.write({"step": s, "loss": 8.0 - 0.01 * s + 0.001 * r, "tokens": SRC_GB // SRC_DP * SEQ_LEN})
            digest = step_digest([row_digest(*blend.row(i)[:2]) for i in _ids(s, r, SRC_DP, SRC_GB)])
            dw.write({"step": s, "skipped": False, "samples": [(s - 1) * SRC_GB, s * SRC_GB], "digest": digest,
                      "doc_loss": {"n": 4, "n_valid": 4, "median": 8.0, "top": [[0, 0, 80.0, 10], [1, 0, 79.0, 10]],
                                   "bottom": [[3, 0, 70.0, 10], [2, 0, 75.0, 10]], "docs": 4}})
        rk.close()
        dw.close()
    return dump


@pytest.fixture
def source(tmp_path) -> Path:
    return make_source(tmp_path / "src", _corpus(tmp_path))


def _check_ids(led: RunLedger, dp: int, steps: int, gb: int) -> None:
    """Every step's sample ids per rank are the layout's; none repeats across ranks or steps."""
    ids = step_ids(led.data)
    assert sorted(ids) == list(range(1, steps + 1))
    flat = [i for per_rank in ids.values() for got in per_rank.values() for i in got]
    assert len(flat) == len(set(flat)) == steps * gb
    assert sorted(flat) == list(range(steps * gb))
    for s in (1, steps // 2, steps):
        for r in (0, dp - 1):
            assert tuple(ids[s][r]) == tuple(_ids(s, r, dp, gb)) == led.data.ids_at(s, r)


@pytest.mark.parametrize("segments", [1, 3])
def test_grown_ledger_reads_like_a_real_one(source, tmp_path, segments):
    dp, steps = 6, 60
    dst = tmp_path / f"grown{segments}"
    info = lg.grow(source, dst, dp, steps, segments=segments, spikes=3)
    gb = SRC_GB // SRC_DP * dp
    assert info["global_batch"] == gb and info["spikes"] == lg.spike_steps(steps, 3)
    assert info["verified_digest_steps"] == sorted({*info["spikes"], steps // 2, steps})
    led = RunLedger(dst)

    rows = led.signal_rows()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["consumed_samples"] for r in rows] == [s * gb for s in range(1, steps + 1)]
    assert [r["step"] for r in rows if r["spike"]] == info["spikes"]
    assert led.spike_steps() == led.rejected_steps() == info["spikes"]
    launches = led.launches()
    assert [x["seq"] for x in launches] == list(range(1, segments + 1))
    if segments > 1:  # the overlap past each resume point is history, not current
        assert len(led.signals.superseded) > 0
        assert [x["resumed_from"] for x in launches][1:] == [s["resumed_from"] for s in info["segments_plan"]][1:]
        assert set(info["checkpoints"]) >= {s["resumed_from"] for s in info["segments_plan"][1:]}
    assert led.checkpoints() == info["checkpoints"]

    ranks = led.rank_rows()
    assert sorted(ranks) == list(range(dp))
    assert all([x["step"] for x in ranks[r]] == list(range(1, steps + 1)) for r in ranks)

    data = led.data
    hdr = data.header()
    assert (hdr["dp_size"], hdr["global_batch"], hdr["mbs"]) == (dp, gb, MBS)
    assert data.ranks() == list(range(dp))
    for s in (1, 2, *info["verified_digest_steps"]):  # verified steps: the digest is checked against the corpus
        for r in range(dp):
            got = data.at(s, r)
            assert [t.sample_id for t in got.tags] == _ids(s, r, dp, gb) == list(data.ids_at(s, r))
            assert not got.skipped
    row = data.row(0, steps // 2)
    assert "digest" in row and "digest" not in data.row(0, 3)
    _check_ids(led, dp, steps, gb)


def test_grown_headers_and_launch_log(source, tmp_path):
    dst = tmp_path / "g"
    info = lg.grow(source, dst, 4, 40, segments=2, spikes=2)
    led = dst / "ledger"
    files = sorted(p.name for p in led.glob("*.jsonl"))
    assert files == sorted(["signals.jsonl", "spikes.jsonl", "rejected_steps.jsonl", "segments.jsonl",
                            *(f"data_dp{r}.jsonl" for r in range(4)), *(f"rank{r}.jsonl" for r in range(4))])
    plan = info["segments_plan"]
    for name in files:
        if name == "segments.jsonl":
            continue
        hdrs = [json.loads(x) for x in (led / name).read_text().splitlines() if '"schema"' in x]
        assert [h["seq"] for h in hdrs] == [1, 2], name
        assert [h["run_id"] for h in hdrs] == [s["run_id"] for s in plan], name
        assert all(h["world_size"] == 4 and h["dp_size"] == 4 for h in hdrs), name
        assert all(list(h)[0] == "schema" for h in hdrs), name
        if name.startswith("data_dp"):
            assert {h["dp_rank"] for h in hdrs} == {int(name[7:-6])}
        assert all(str(dst) in " ".join(h["argv"]) and str(source) not in " ".join(h["argv"])
                   for h in hdrs if "argv" in h), name
    # the offset index as the checked-out writer keeps one (or none)
    assert info["index"] in ("build_index", "note_segment", "none")
    if info["index"] != "none":
        assert (led / "signals.jsonl.idx").exists()


def test_explicit_rows_source_moves_ids(tmp_path):
    """A text-source ledger (rows written out, no rank files) grows as rows with moved ids."""
    from unit.bad_input_ledgers import make_run

    src = make_run(tmp_path / "src", steps=30, dp=2, mbs=2, spike_at=25)
    info = lg.grow(src, tmp_path / "g", 3, 24, spikes=2)
    assert info["digest"] == "rows written out" and info["verified_digest_steps"] == []
    led = RunLedger(tmp_path / "g")
    assert not list((tmp_path / "g" / "ledger").glob("rank*.jsonl"))
    assert [t.sample_id for t in led.data.at(24, 2).tags] == _ids(24, 2, 3, 6)
    _check_ids(led, 3, 24, 6)


def test_refuses_when_the_disk_is_too_small(source, tmp_path, monkeypatch):
    import shutil as _shutil

    real = _shutil.disk_usage
    monkeypatch.setattr(lg.shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    with pytest.raises(lg.NoSpace, match=r"needs about .* GB"):
        lg.grow(source, tmp_path / "g", 8, 100)
    assert not (tmp_path / "g" / "ledger").exists()


def test_plans():
    assert lg.spike_steps(1000, 5) == [140, 340, 540, 740, 940]
    assert lg.spike_steps(10, 0) == []
    segs = lg.plan_segments(1000, 3)
    assert [(s.first, s.resumed_from, s.current_last) for s in segs] == [(1, 0, 333), (334, 333, 667),
                                                                          (668, 667, 1000)]
    assert all(s.last > s.current_last for s in segs[:-1]) and segs[-1].last == 1000
    with pytest.raises(ValueError):
        lg.plan_segments(5, 3)


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    """The bench end to end at one tiny size (trains the 6-step source run), one or two commands
    of each group: each command is a fresh process (~5 s of imports), and the tools themselves
    have their own tests; all fifteen cost CI a minute more."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_ledger_scale.py"), "--sizes", "4x40",
                           "--only", "baseline: import,claim_dump_folder,lookup --step 20,replay check",
                           "--work", str(tmp_path / "w"), "--timeout", "300", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert {r["group"] for r in res} == {"relaunch", "point", "whole"}
    assert all(r["status"] == "ok" for r in res), [(r["name"], r["status"], r.get("error")) for r in res]
    assert "lookup --step 20" in proc.stdout
