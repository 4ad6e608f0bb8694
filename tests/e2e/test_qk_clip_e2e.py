"""QK-clip holds the attention logits in a run whose logits grow without it.

Two one-process runs of ``debug_cpu`` at LR 0.1 (2 x 128 tokens a step, seed 0), the
same data and initial weights: without the clip the max attention logit passes
4 x 20 within a few steps and ends in the thousands; with ``--qk_clip.threshold 20``
every step that passes it is clipped (the rows say how many heads and the smallest
eta) and the logits stay within a few times the threshold -- at this LR one update
regrows them from the clipped level, so "near" is the order of magnitude, not equality.
"""

import statistics

import pytest
from helpers import CONFIGS, explain, signals_ledger, torchrun

pytestmark = pytest.mark.slow

T = 20.0
ARGS = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "30",
        "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "2",
        "--training.seq_len", "128", "--optimizer.lr", "0.1", "--debug.seed", "0",
        "--ledger.response.action", "none"]


def _rows(dump, extra):
    proc = torchrun(ARGS + extra + ["--dump_folder", str(dump)], nproc=1)
    assert proc.returncode == 0, explain(proc)
    return signals_ledger(dump).history


def test_qk_clip_holds_the_max_logit_that_grows_without_it(tmp_path):
    base = _rows(tmp_path / "base", [])
    clip = _rows(tmp_path / "clip", ["--qk_clip.enable", "--qk_clip.threshold", str(T)])
    assert all(r["qk_clip_heads"] is None for r in base)
    assert max(r["max_logit"] for r in base) > 4 * T
    late_base = statistics.median(r["max_logit"] for r in base[-10:])
    late_clip = statistics.median(r["max_logit"] for r in clip[-10:])
    assert late_base > 20 * T and late_clip < 3 * T and late_clip < late_base / 20, (late_base, late_clip)
    # the rows record every clip: steps over the threshold clip heads with eta < 1, the others none
    for r in clip:
        if r["max_logit"] > T:
            assert r["qk_clip_heads"] > 0 and r["qk_clip_eta_min"] == pytest.approx(T / r["max_logit"], rel=1e-5)
        else:
            assert r["qk_clip_heads"] == 0 and r["qk_clip_eta_min"] == 1.0
    # identical until the first clip acts (steps 1-3 saw the same weights)
    assert [r["loss"] for r in clip[:3]] == [r["loss"] for r in base[:3]]
