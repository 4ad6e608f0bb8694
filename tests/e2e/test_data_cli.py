"""End to end through the real CLIs: torchrun training, kill -9 resume, replay check,
lookup, skip windows, fingerprints, resume with another DP size.

Matrix of resume checks (each kills every process with SIGKILL at a step that is
not a checkpoint step, resumes from the previous checkpoint, then compares the
data ledgers with an uninterrupted run; losses and grad norms must match too):

    parallelism  source   num_workers
    FSDP2        text     2
    FSDP2        indexed  0
    TP 2         text     0
    PP 2         indexed  2
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import CONFIGS, ROOT, child_env, explain, torchrun
from titan_ledger.data.provenance import DataLedger
from titan_ledger.records import read_ledger

pytestmark = pytest.mark.slow

STEPS = ["--training.steps", "8", "--checkpoint.interval", "3"]


def py(*args, timeout=900):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=timeout)


def data_args(source: str, workers: int, corpus) -> list[str]:
    args = ["--dataloader.num_workers", str(workers)]
    if source == "indexed":
        args += ["--dataloader.source", "indexed", "--dataloader.paths", str(corpus)]
    return args


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "bundled"
    p = py("-m", "titan_ledger.prepare", "--input", str(ROOT / "titan_ledger/assets/corpus"),
           "--output-prefix", str(prefix), "--workers", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "457 documents" in p.stdout
    return prefix


def signals(dump):
    return read_ledger(dump / "ledger" / "signals.jsonl").by_step()


@pytest.mark.parametrize("toml,source,workers", [
    ("debug_cpu.toml", "text", 2),
    ("debug_cpu.toml", "indexed", 0),
    ("debug_cpu_tp.toml", "text", 0),
    ("debug_cpu_pp.toml", "indexed", 2),
])
def test_kill9_resume_trains_exactly_the_same_samples(tmp_path, corpus, toml, source, workers):
    args = ["--job.config_file", str(CONFIGS / toml), *STEPS, *data_args(source, workers, corpus)]
    a, b = tmp_path / "a", tmp_path / "b"
    straight = torchrun(args + ["--job.dump_folder", str(a)])
    assert straight.returncode == 0, explain(straight)
    r = py("-m", "titan_ledger.replay", "resume", "--nproc", "2", "--kill-at", "5",
           "--dump-folder", str(b), "--json", "--", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["resumed_from_checkpoint"] == 3 and out["checkpoints_before_kill"] == [3]
    c = py("-m", "titan_ledger.replay", "check", str(a), str(b), "--json")
    assert c.returncode == 0, c.stdout + c.stderr
    res = json.loads(c.stdout)
    assert res["equal"] and res["steps_compared"] == 8 and not res["overlaps"]
    # the killed run had logged step 4 (and maybe 5) before dying: superseded, not mixed in
    sa, sb = signals(a), signals(b)
    for s in range(1, 9):
        assert (sa[s]["loss"], sa[s]["grad_norm"]) == (sb[s]["loss"], sb[s]["grad_norm"]), s
        gb = 8 if toml == "debug_cpu.toml" else 4  # TP and PP over 2 ranks: one DP rank
        assert sa[s]["consumed_samples"] == sb[s]["consumed_samples"] == gb * s
    # no document token trained twice (workers included), across ranks and steps
    led = DataLedger(b / "ledger")
    seen = set()
    for step in range(1, 9):
        for r in led.ranks_at(step):
            for tag in led.at(step, r).tags:
                for seg in tag.segments:
                    span = (tag.source, seg.doc, seg.start, seg.end)
                    assert span not in seen, (step, r, span)
                    seen.add(span)


def test_check_reports_first_divergence_and_errors(tmp_path):
    args = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "4"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert torchrun(args + ["--job.dump_folder", str(a)]).returncode == 0
    p = torchrun(args + ["--job.dump_folder", str(b), "--ledger.skip_steps", "2"])
    assert p.returncode == 0, explain(p)
    c = py("-m", "titan_ledger.replay", "check", str(a), str(b))
    assert c.returncode == 1
    assert "FIRST DIVERGENCE  step 2, rank 0" in c.stdout and "'skipped'" in c.stdout
    # a missing ledger and a run of another config are errors (exit 2), not "different"
    c = py("-m", "titan_ledger.replay", "check", str(a), str(tmp_path / "nope"))
    assert c.returncode == 2 and "no data ledger" in c.stderr
    d = tmp_path / "d"
    assert torchrun(args + ["--job.dump_folder", str(d), "--training.seq_len", "128"]).returncode == 0
    c = py("-m", "titan_ledger.replay", "check", str(a), str(d))
    assert c.returncode == 2 and "differ in fingerprint" in c.stderr


def test_skip_window_lookup_lr_policy_and_fingerprint(tmp_path):
    base = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "6",
            "--checkpoint.enable", "--checkpoint.interval", "6"]
    runs = {}
    for name, extra in (("straight", []),
                        ("freeze", ["--ledger.skip_steps", "3-4"]),
                        ("advance", ["--ledger.skip_steps", "3-4", "--ledger.skip_lr", "advance"])):
        runs[name] = tmp_path / name
        p = torchrun(base + extra + ["--job.dump_folder", str(runs[name])])
        assert p.returncode == 0, explain(p)
    st, fr, ad = (signals(runs[n]) for n in ("straight", "freeze", "advance"))
    row = fr[3]
    assert row["skipped"] and row["last_step"] == 4 and 4 not in fr and row["loss"] is None
    assert row["consumed_samples"] == 32 and row["skipped_samples"] == 16
    assert fr[5]["consumed_samples"] == 40 and fr[5]["skipped_samples"] == 16
    # freeze: step 5 runs the schedule's 3rd step; advance: its 5th
    assert fr[5]["lr"] == st[3]["lr"] and ad[5]["lr"] == st[5]["lr"] and st[3]["lr"] != st[5]["lr"]
    # lookup: the skipped step's rows are the straight run's rows of that step
    for step in (3, 4):
        lf = json.loads(py("-m", "titan_ledger.lookup", "--dump-folder", str(runs["freeze"]),
                           "--step", str(step), "--json").stdout)
        ls = json.loads(py("-m", "titan_ledger.lookup", "--dump-folder", str(runs["straight"]),
                           "--step", str(step), "--json").stdout)
        assert lf["skipped"] and not ls["skipped"] and lf["ranks"] == ls["ranks"]
        assert sorted(lf["ranks"]) == ["0", "1"] and len(lf["ranks"]["1"]) == 4
    # step 5 trains what the straight run trained at step 5 (data is consumed, not shifted)
    assert py("-m", "titan_ledger.lookup", "--dump-folder", str(runs["freeze"]), "--step", "5",
              "--json").stdout == py("-m", "titan_ledger.lookup", "--dump-folder",
                                     str(runs["straight"]), "--step", "5", "--json").stdout
    text = py("-m", "titan_ledger.lookup", "--dump-folder", str(runs["freeze"]), "--step", "3",
              "--rank", "1", "--text")
    assert text.returncode == 0 and "SKIPPED (window 3-4)" in text.stdout and "doc " in text.stdout
    # resuming with other data (seq_len) is refused with the flag to override it
    more = base + ["--training.steps", "7", "--job.dump_folder", str(runs["straight"])]
    p = torchrun(more + ["--training.seq_len", "128"])
    assert p.returncode != 0, explain(p)  # torchrun reports the ranks' exit 2 as 1
    err = p.stdout + p.stderr
    assert "titan_ledger: error: the data changed since the checkpoint" in err
    assert "--ledger.allow_data_change" in err
    p = torchrun(more + ["--training.seq_len", "128", "--ledger.allow_data_change"])
    assert p.returncode == 0, explain(p)
    assert signals(runs["straight"])[7]["consumed_samples"] == 56


def test_indexed_resume_with_another_dp_size(tmp_path, corpus):
    args = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "6",
            "--checkpoint.enable", "--checkpoint.interval", "3", *data_args("indexed", 0, corpus)]
    a, b = tmp_path / "a", tmp_path / "b"
    assert torchrun(args + ["--job.dump_folder", str(a)]).returncode == 0
    p = torchrun(args + ["--job.dump_folder", str(b), "--training.steps", "3"])
    assert p.returncode == 0, explain(p)
    # 2 -> 1 rank: same global batch (8 rows) from one rank
    p = torchrun(args + ["--job.dump_folder", str(b), "--parallelism.data_parallel_shard_degree", "1",
                         "--training.local_batch_size", "8"], nproc=1)
    assert p.returncode == 0, explain(p)
    assert "Training starts at step 4" in p.stdout + p.stderr
    c = py("-m", "titan_ledger.replay", "check", str(a), str(b), "--json")
    res = json.loads(c.stdout)
    assert c.returncode == 0 and res["equal"] and res["steps_compared"] == 6, c.stdout + c.stderr
    # 1 -> 2 ranks: start alone (8 rows), continue on two (4 + 4)
    one = tmp_path / "one"
    solo = ["--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "8"]
    p = torchrun(args + ["--job.dump_folder", str(one), "--training.steps", "3"] + solo, nproc=1)
    assert p.returncode == 0, explain(p)
    p = torchrun(args + ["--job.dump_folder", str(one)])
    assert p.returncode == 0 and "Training starts at step 4" in p.stdout + p.stderr, explain(p)
    c = py("-m", "titan_ledger.replay", "check", str(a), str(one), "--json")
    assert c.returncode == 0 and json.loads(c.stdout)["steps_compared"] == 6, c.stdout + c.stderr
    # a text stream refuses the same change, naming the fix
    t = tmp_path / "t"
    text = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--checkpoint.enable",
            "--checkpoint.interval", "2", "--job.dump_folder", str(t)]
    assert torchrun(text + ["--training.steps", "2"]).returncode == 0
    p = torchrun(text + ["--training.steps", "3", "--parallelism.data_parallel_shard_degree", "1",
                         "--training.local_batch_size", "8"], nproc=1)
    assert p.returncode != 0 and "--dataloader.source indexed" in p.stdout + p.stderr, explain(p)


def test_indexed_toml_prepares_its_corpus_on_first_use(tmp_path):
    prefix = tmp_path / "corpora" / "bundled"
    p = torchrun(["--job.config_file", str(CONFIGS / "debug_cpu_indexed.toml"), "--training.steps", "2",
                  "--dataloader.paths", str(prefix), "--job.dump_folder", str(tmp_path / "run")])
    assert p.returncode == 0, explain(p)
    assert prefix.with_suffix(".bin").exists() and prefix.with_suffix(".idx").exists()
    meta = json.loads(prefix.with_suffix(".json").read_text())
    assert meta["documents"] == 457
    out = json.loads(py("-m", "titan_ledger.lookup", "--dump-folder", str(tmp_path / "run"), "--step", "2",
                        "--json").stdout)
    ids = [row["sample_id"] for r in ("0", "1") for row in out["ranks"][r]]
    assert ids == list(range(8, 16))
    one = json.loads(py("-m", "titan_ledger.lookup", "--dump-folder", str(tmp_path / "run"), "--sample",
                        "9", "--text", "--json").stdout)
    assert one["sample_id"] == 9 and one["source"] == out["ranks"]["0"][1]["source"]
    assert [{k: v for k, v in seg.items() if k != "text"} for seg in one["segments"]] == \
        out["ranks"]["0"][1]["segments"]
    assert all(seg["text"] for seg in one["segments"])
