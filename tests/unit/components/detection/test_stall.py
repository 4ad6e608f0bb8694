"""titan_ledger.components.detection.stall: the loss's trend against its own past, window
by window -- a stall with the attention logits past 10^4 flags, a plateau of small logits
(convergence) and a falling loss do not, a loss climbing back does; on rows shaped like the
measured runs (the tiny model at LR 0.1 without and with QK-norm, the memorisation plateau)."""

from __future__ import annotations

import pytest

from titan_ledger.components.detection.stall import StallConfig, StallWatch, describe_stall
from titan_ledger.errors import ConfigError

#: 50-step medians of the tiny model at LR 0.1, no weight decay (measured, steps 1-500), and
#: each window's median max attention logit
STALL = [(6.668, 235), (6.515, 668), (6.277, 2.08e3), (6.351, 5.66e3), (6.466, 1.12e4), (6.411, 1.46e4),
         (6.341, 2.29e4), (6.343, 3.18e4), (6.35, 4.33e4), (6.40, 5.06e4)]


def _rows(windows, window=50, jitter=0.01):
    step = 0
    for med, logit in windows:
        for i in range(window):
            step += 1
            yield {"step": step, "loss": med + (jitter if i % 2 else -jitter), "max_logit": logit}


def _events(windows, **kw):
    w = StallWatch(StallConfig(**kw))
    return [e for e in (w.observe(r) for r in _rows(windows)) if e], w


def test_the_loss_stopping_while_the_logits_grow_past_1e4_is_a_stall():
    ev, w = _events(STALL)
    assert [(e["step"], e["stall"]["kind"]) for e in ev] == [(350, "stalled")]  # once, not repeated
    st = ev[0]["stall"]
    assert st["best"] == pytest.approx(6.277) and st["since"] == 150 and st["max_logit"] == 2.29e4
    # the onset a stall's window proof re-runs from (the ring's anchor), checkpointed with the rule
    assert w.best_step == 150
    again = StallWatch(StallConfig())
    again.load_state_dict(w.state_dict())
    assert again.best_step == 150
    line = describe_stall(ev[0])
    assert line.startswith("STALL at step 350 (stalled): the loss stopped improving at 6.277") and "QK-norm" in line


def test_a_falling_loss_a_converged_plateau_and_noise_do_not_flag():
    falling = [(6.6 - 0.15 * k, 30.0) for k in range(20)]  # QK-norm: logits ~36, the loss going on down
    plateau = [(0.0067, 12.0)] * 16  # the memorised text: flat, small logits
    assert _events(falling)[0] == [] and _events(plateau)[0] == []


def test_a_loss_climbing_back_is_a_slow_divergence():
    climbing = [(5.0, 20.0), (4.8, 20.0), (5.1, 20.0), (5.3, 20.0), (5.6, 20.0)]
    ev, _ = _events(climbing)
    assert [(e["step"], e["stall"]["kind"]) for e in ev] == [(200, "diverging")]  # 5.1 is 6% above 4.8: then 5.3
    assert "climbing back" in describe_stall(ev[0])


def test_a_flag_stands_until_the_loss_improves_and_the_state_is_checkpointed():
    w = StallWatch(StallConfig())
    rows = list(_rows(STALL[:7]))
    for r in rows[:175]:
        w.observe(r)
    again = StallWatch(StallConfig())
    again.load_state_dict(w.state_dict())
    got = [e for e in (again.observe(r) for r in rows[175:]) if e]
    assert [e["step"] for e in got] == [350]
    better = [e for e in (again.observe(r) for r in _rows([(5.0 - 0.2 * k, 3e4) for k in range(6)])) if e]
    assert better == []  # improving again: the flag is lifted, nothing new


def test_skipped_and_non_finite_rows_are_not_the_loss():
    w = StallWatch(StallConfig(window=2))
    assert w.observe({"step": 1, "skipped": True, "loss": None}) is None
    assert w.observe({"step": 2, "loss": float("nan")}) is None and w.losses == []


def test_bad_values_name_the_flag():
    with pytest.raises(ConfigError, match="--ledger.stall"):
        StallConfig(window=1)
