"""titan_ledger.components.response.optimizer_state: Adam's second-moment level from the
rows (fast and slow averages of the clipped gradient's squared norm), and the update
recomputed with v restored -- checked against torch's own AdamW step."""

from __future__ import annotations

import math

import pytest
import torch

from titan_ledger.components.response.optimizer_state import AdamEntry, amplification, update_norms
from titan_ledger.components.signals.adam_level import AdamLevel


def test_the_levels_follow_the_applied_updates_and_their_ratio_shows_a_decayed_v():
    lvl = AdamLevel(beta2=0.95, horizon=1000)
    assert lvl.ratio() is None
    for _ in range(60):  # early: gradients at the clip
        lvl.observe({"grad_norm_clipped": 1.0})
    assert lvl.ratio() == pytest.approx(1.0)
    lvl.observe({"grad_norm_clipped": 5.0, "update_skipped": True})  # withheld: v did not move
    lvl.observe({"skipped": True, "grad_norm_clipped": None})
    assert lvl.n == 60
    for _ in range(300):  # a memorisation plateau: the gradient ~1e-3
        lvl.observe({"grad_norm_clipped": 1e-3})
    assert lvl.ratio() > 1e4  # v fell four orders below its long-run level
    again = AdamLevel(0.95, 1000)
    again.load_state_dict(lvl.state_dict())
    assert again.ratio() == lvl.ratio()


def _adam_step(p, g, opt):
    p.grad = g.clone()
    before = p.detach().clone()
    opt.step()
    return (p.detach() - before) / opt.param_groups[0]["lr"]


def test_the_recomputed_update_is_torchs_adamw_and_restoring_v_shrinks_it():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(5):
        last = _adam_step(p, torch.randn(50) * 1e-3, opt)
    g = torch.randn(50) * 0.1  # a gradient far above v
    st = opt.state[p]
    entry = AdamEntry(g, st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"]), 0.9, 0.95, 1e-8)
    actual, restored, before, before_restored = update_norms([entry], 1.0, "cpu").tolist()
    assert actual == pytest.approx(restored) and before == pytest.approx(before_restored)  # nothing restored
    # the update the state stands for before this gradient: the last one torch applied
    assert math.sqrt(before) == pytest.approx(float(last.norm()), rel=1e-4)
    step = _adam_step(p, g, opt)  # torch's own update per unit LR
    assert math.sqrt(actual) == pytest.approx(float(step.norm()), rel=1e-4)
    n = update_norms([entry], 1e4, "cpu").tolist()
    assert amplification(n[:2]) > 2  # v restored 10^4x: the same gradient moves the weights far less
    assert amplification(n[2:]) == pytest.approx(100.0, rel=1e-3)  # sqrt(10^4): the quiet updates were 100x
    assert amplification([0.0, 0.0]) == 1.0


def test_a_healthy_state_is_not_amplified_even_by_a_large_gradient():
    """A bad document in a healthy run: its own g^2 dominates v' whether or not v is
    restored a few x, so the amplification stays near 1 (the proof then masks data)."""
    torch.manual_seed(1)
    g0 = torch.randn(200) * 0.01
    v = (g0 * g0) * 0.9  # v tracks the gradient
    m = g0 * 0.5
    entry = AdamEntry(g0 * 30, m, v, 500.0, 0.9, 0.95, 1e-8)
    assert amplification(update_norms([entry], 3.0, "cpu").tolist()[:2]) < 1.3
