"""bench/lr_sensitivity.py's math (no process): Wortsman et al.'s LR sensitivity, the final
loss of a run, a diverged run, and the flags each variant trains with."""

import math

from helpers import load_bench

lrs = load_bench("lr_sensitivity")


def test_sensitivity_is_zero_when_every_lr_trains_as_well_as_the_best():
    assert lrs.sensitivity({1e-3: 2.0, 1e-2: 2.0}, {1e-3: 7.6, 1e-2: 7.6}) == 0.0


def test_a_diverged_lr_costs_its_loss_at_init_not_infinity():
    finals = {1e-3: 3.0, 1e-2: 2.0, 1e-1: math.inf}
    inits = {1e-3: 7.6, 1e-2: 7.6, 1e-1: 7.6}
    # (3 - 2) + (2 - 2) + (7.6 - 2), over 3 LRs
    assert math.isclose(lrs.sensitivity(finals, inits), (1.0 + 0.0 + 5.6) / 3)
    # a run that ends above its start counts as its start
    assert math.isclose(lrs.sensitivity({1: 2.0, 2: 9.0}, {1: 7.6, 2: 7.6}), (0 + 5.6) / 2)
    assert math.isnan(lrs.sensitivity({1: math.inf}, {1: 7.6}))  # nothing trained


def test_final_loss_is_the_tail_mean_and_inf_after_a_divergence():
    assert lrs.final_loss([5.0] * 90 + [2.0] * 10) == 2.0
    assert lrs.final_loss([3.0, 1.0]) == 1.0  # at least one step
    assert lrs.final_loss([3.0, float("nan")]) == math.inf
    s = lrs.summarize([{"step": 1, "loss": 7.6, "max_logit": 3.0, "logz_max": 8.0},
                       {"step": 2, "loss": float("nan"), "max_logit": None, "logz_max": None}], steps=5)
    assert s["init"] == 7.6 and s["final"] == math.inf and s["max_logit"] == 3.0 and s["max_logz"] == 8.0


def test_each_variant_trains_with_its_flags_and_the_lr():
    cmd = lrs.train_cmd(lrs.ROOT / "c", lrs.ROOT / "d", "qk_norm+z_loss", 3e-2, 200)
    assert cmd[cmd.index("--optimizer.lr") + 1] == "0.03" and "--model.qk_norm" in cmd
    assert cmd[cmd.index("--loss.z_loss_weight") + 1] == "1e-4"
    assert cmd[cmd.index("--lr_scheduler.warmup_steps") + 1] == "20"
    assert "--model.qk_norm" not in lrs.train_cmd(lrs.ROOT / "c", lrs.ROOT / "d", "baseline", 1e-3, 200)
    clip = lrs.train_cmd(lrs.ROOT / "c", lrs.ROOT / "d", "qk_clip", 1e-1, 200)
    assert "--qk_clip.enable" in clip and clip[clip.index("--qk_clip.threshold") + 1] == "100"
