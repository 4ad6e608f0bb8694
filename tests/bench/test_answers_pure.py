"""bench/answers.py's pure parts: how many steps a printed command trains (the order of an
interrupted measurement's relaunches) and whether a fix repeats the run's own setting (a goal
of issue 67). The relaunches themselves are the bench's, hours long: not run here."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import load_bench

from titan_ledger.format.answers import Knobs

answers = load_bench("answers")

HEAD = "cd /r && /r/.venv/bin/python -m titan_ledger.launch --nproc 1 -- --training.steps 800"


def test_a_relaunch_from_a_checkpoint_trains_the_steps_after_it_and_the_last_training_steps_counts():
    assert answers._steps_to_train(f"{HEAD} --optimizer.eps 1e-6") == 800  # from scratch
    assert answers._steps_to_train(f"{HEAD} --checkpoint.initial_load_path '/d/checkpoint/step-280' "
                                   "--checkpoint.no_initial_load_model_only --optimizer.eps 1e-6") == 520
    assert answers._steps_to_train(f"{HEAD} --training.steps 135") == 135  # a shortened horizon


def _answer(*flags: str):
    return SimpleNamespace(fix=SimpleNamespace(flags=flags), candidates=())


def test_a_fix_that_sets_the_runs_own_value_repeats_it_and_a_change_does_not():
    knobs = Knobs(lr=1e-2, eps=1e-8, betas=(0.9, 0.95), qk_norm=False, z_loss=0.0)
    assert answers.repeats_setting(_answer("--optimizer.eps", "1e-8"), knobs)
    assert answers.repeats_setting(_answer("--optimizer.betas", "0.9", "0.95"), knobs)
    assert not answers.repeats_setting(_answer("--optimizer.eps", "1e-6"), knobs)
    assert not answers.repeats_setting(_answer("--optimizer.lr", "0.001"), knobs)
    assert not answers.repeats_setting(_answer("--model.qk_norm"), knobs)
    assert answers.repeats_setting(_answer("--model.qk_norm"), Knobs(qk_norm=True))
    assert not answers.repeats_setting(SimpleNamespace(fix=None, candidates=()), knobs)
