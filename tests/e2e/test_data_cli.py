"""The data ledger end to end: replay check, lookup, skip windows, fingerprints, resume
with another DP size, the indexed TOML preparing its corpus.

Reads the session's shared runs (conftest.py): the FSDP2 straight run (text, 2
workers), a skip-window run of the same config, and ``debug_cpu_indexed.toml``.
"""

from __future__ import annotations

import json

import pytest
from conftest import STEPS
from helpers import cli, data_rows, error_lines, explain, py, signals_rows, torchrun

from titan_ledger.tools import lookup, replay

pytestmark = pytest.mark.slow


def lookup_json(dump, *args) -> dict:
    rc, out, err = cli(lookup.main, ["--dump-folder", dump, *args, "--json"])
    assert rc == 0, err
    return json.loads(out)


def span(seg: dict) -> tuple:
    return seg["doc"], seg["start"], seg["end"]


def provenance(out: dict) -> dict:
    """What ``lookup --json`` says a step trained on: per DP rank the sample ids, sources
    and document spans (not the per-document losses, which depend on the weights)."""
    return {"skipped": out["skipped"],
            "ranks": {r: [(row["sample_id"], row["source"], [span(g) for g in row["segments"]]) for row in rows]
                      for r, rows in out["ranks"].items()}}


def test_check_reports_first_divergence_and_errors(runs, tmp_path):
    a, skipped = runs.straight("FSDP2"), runs.skip_freeze()
    # the CLI as a user runs it (its subprocess smoke test): exit 1, the first divergence
    c = py("-m", "titan_ledger.replay", "check", a, skipped)
    assert c.returncode == 1, c.stdout + c.stderr
    assert "FIRST DIVERGENCE  step 3, rank 0" in c.stdout and "'skipped'" in c.stdout
    # a missing ledger and a run of another config are errors (exit 2), not "different"
    rc, out, err = cli(replay.main, ["check", a, tmp_path / "nope"])
    assert rc == 2 and len(error_lines(err)) == 1 and str(tmp_path / "nope") in err, out + err
    rc, out, err = cli(replay.main, ["check", a, runs.indexed_toml()])
    assert rc == 2 and "differ in fingerprint" in err, out + err


def test_skip_window_lookup_lr_freeze(runs):
    """``skip_steps = 3-4`` with ``skip_lr = freeze`` against the straight run (2 workers;
    this run has 0, which give the same sequence). ``skip_lr = advance``:
    ``test_spike_cli.py`` (the auto-skip run)."""
    straight, freeze = runs.straight("FSDP2"), runs.skip_freeze()
    st, fr = signals_rows(straight), signals_rows(freeze)
    row = fr[3]
    assert row["skipped"] and row["last_step"] == 4 and 4 not in fr and row["loss"] is None
    assert row["skip_lr"] == "freeze"
    assert row["consumed_samples"] == 32 and row["skipped_samples"] == 16
    assert fr[5]["consumed_samples"] == 40 and fr[5]["skipped_samples"] == 16
    # freeze: step 5 runs the schedule's 3rd step
    assert fr[5]["lr"] == st[3]["lr"] and st[3]["lr"] != st[5]["lr"]
    # the skipped window is one provenance row per DP rank, marked skipped
    assert data_rows(freeze, 1)[3]["skipped"] and not data_rows(straight, 1)[3]["skipped"]
    # lookup: the skipped step's rows are the straight run's rows of that step
    for step in (3, 4):
        lf, ls = (provenance(lookup_json(d, "--step", step)) for d in (freeze, straight))
        assert lf["skipped"] and not ls["skipped"] and lf["ranks"] == ls["ranks"]
        assert sorted(lf["ranks"]) == ["0", "1"] and len(lf["ranks"]["1"]) == 4
    # step 5 trains what the straight run trained at step 5 (data is consumed, not shifted)
    assert provenance(lookup_json(freeze, "--step", 5)) == provenance(lookup_json(straight, "--step", 5))
    # lookup's subprocess smoke test: decoded text of a skipped step
    text = py("-m", "titan_ledger.lookup", "--dump-folder", freeze, "--step", "3", "--rank", "1", "--text")
    assert text.returncode == 0 and "SKIPPED (window 3-4)" in text.stdout and "doc " in text.stdout


def test_resume_with_other_data_is_refused_unless_allowed(runs):
    """Resuming the straight run's step-6 checkpoint with another seq_len (a copy of it)."""
    dump = runs.copy_checkpoint(runs.straight("FSDP2"), 6, "data-change", with_ledger=True)
    more = runs.args("FSDP2") + ["--training.steps", "7", "--job.dump_folder", str(dump),
                                 "--training.seq_len", "128"]
    p = torchrun(more)
    assert p.returncode != 0, explain(p)  # torchrun reports the ranks' exit 2 as 1
    err = p.stdout + p.stderr
    assert any(e.startswith("the data changed since the checkpoint") for e in error_lines(err)), err[-3000:]
    assert "--ledger.allow_data_change" in err
    p = torchrun(more + ["--ledger.allow_data_change"])
    assert p.returncode == 0, explain(p)
    assert "Training starts at step 7" in p.stdout + p.stderr
    assert signals_rows(dump)[7]["consumed_samples"] == 56


def test_indexed_resume_with_another_dp_size(runs):
    a = runs.indexed_toml()
    args = runs.indexed_args()
    solo = ["--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "8"]

    def check(x, y) -> dict:
        rc, out, err = cli(replay.main, ["check", x, y, "--json"])
        assert rc == 0, out + err
        return json.loads(out)

    # 2 -> 1 rank: same global batch (8 rows) from one rank
    b = runs.factory.mktemp("dp-2-to-1")
    p = torchrun(args + ["--job.dump_folder", str(b), "--training.steps", "3"])
    assert p.returncode == 0, explain(p)
    p = torchrun(args + ["--job.dump_folder", str(b)] + solo, nproc=1)
    assert p.returncode == 0, explain(p)
    assert "Training starts at step 4" in p.stdout + p.stderr
    res = check(a, b)
    assert res["equal"] and res["steps_compared"] == STEPS, res
    # 1 -> 2 ranks: start alone (8 rows), continue on two (4 + 4)
    one = runs.factory.mktemp("dp-1-to-2")
    p = torchrun(args + ["--job.dump_folder", str(one), "--training.steps", "3"] + solo, nproc=1)
    assert p.returncode == 0, explain(p)
    p = torchrun(args + ["--job.dump_folder", str(one)])
    assert p.returncode == 0 and "Training starts at step 4" in p.stdout + p.stderr, explain(p)
    res = check(a, one)
    assert res["equal"] and res["steps_compared"] == STEPS, res


def test_text_stream_refuses_another_dp_size(runs):
    """A text stream's position is per DP rank: the straight run's step-3 checkpoint
    (2 DP ranks) cannot continue on one, and the error names the fix."""
    t = runs.copy_checkpoint(runs.straight("FSDP2"), 3, "text-dp-change")
    p = torchrun(runs.args("FSDP2") + ["--job.dump_folder", str(t), "--parallelism.data_parallel_shard_degree",
                                       "1", "--training.local_batch_size", "8"], nproc=1)
    assert p.returncode != 0 and "--dataloader.source indexed" in p.stdout + p.stderr, explain(p)


def test_indexed_toml_prepares_its_corpus_on_first_use(runs):
    run = runs.indexed_toml()
    prefix = run.parent / "corpora" / "bundled"
    assert prefix.with_suffix(".bin").exists() and prefix.with_suffix(".idx").exists()
    meta = json.loads(prefix.with_suffix(".json").read_text())
    assert meta["documents"] == 457
    out = lookup_json(run, "--step", 2)
    ids = [row["sample_id"] for r in ("0", "1") for row in out["ranks"][r]]
    assert ids == list(range(8, 16))
    one = lookup_json(run, "--sample", 9, "--text")
    assert one["sample_id"] == 9 and one["source"] == out["ranks"]["0"][1]["source"]
    assert [span(g) for g in one["segments"]] == [span(g) for g in out["ranks"]["0"][1]["segments"]]
    assert all(seg["text"] for seg in one["segments"])
