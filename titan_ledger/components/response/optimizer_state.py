"""Adam's state at a flagged step: did the data make the update abnormal, or the optimizer?

Design decision: a proof that masks data and sees the update come back to normal has
shown that *removing* data helps, not that the data is bad. On a memorisation plateau
(one text repeated: the gradient ~1e-3 for hundreds of steps) Adam's second moment v
decays with the gradient, every update stays full-size (m / sqrt(v) is scale-free),
the weights drift until the loss spikes (Wortsman et al. 2023b, Bai et al. 2025) --
and masking whichever tokens the drift hurt most "brings the update back". So before
any data is masked the proof asks Adam first, from what is already in memory (no extra
forward/backward): the flagged step's update recomputed from the same gradients with
the second moment restored to its long-run level. v's total over the parameters is an
exponential average of the (clipped) gradient's squared norm -- exactly, for the
updates applied -- so both levels come from the signals rows the run writes anyway
(:class:`~titan_ledger.components.signals.adam_level.AdamLevel`, host floats,
checkpointed): the fast average with Adam's own beta2
is where v stands, a slow one over ``--ledger.adam_check.horizon`` steps where it
stood. v restored is ``v x max(1, slow / fast)`` per element (its shape kept, so a
healthy run, where the two levels agree, recomputes the very same update), and
:func:`update_norms` returns the updates' squared norms, actual and restored: the
step's own update (its gradient included) and the update the state stood for before
it. Their ratios are the amplification the state added. The second decides: at the
spike itself the large gradient refreshes v, so the step's own update is little
amplified (1.7x at the plateau's step 420), while the updates that moved the weights
into the spike -- the quiet steps' -- were inflated by the decayed v (21x there). At or
past ``--ledger.adam_check.ratio`` the verdict is ``optimizer_state`` and no data
is convicted. Epsilon enters both (a large one caps the updates a small v inflates).

Numbers (docs/spike-response.md, "Adam first"): on the plateau (seed 0) v's level stood
53-1,300x below its long-run one at the flags (the updates before them 7-36x
inflated); on the clean runs of ``bench/false_alarms.py --quick`` (1,000 steps) the
ratio never passed 1.15 (1.07x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamEntry:
    """One parameter's local piece as Adam holds it: its gradient (post-clip), both
    moments, the update count so far and its group's settings."""

    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: float
    beta1: float
    beta2: float
    eps: float


def update_norms(entries: list[AdamEntry], restore: float, device) -> torch.Tensor:
    """``[|U|^2, |U_restored|^2, |B|^2, |B_restored|^2]`` (float64, on ``device``) over
    ``entries``, per unit LR. ``U`` is Adam's next update, ``m_hat' / (sqrt(v_hat') + eps)``
    with ``m' = b1 m + (1-b1) g`` and ``v' = b2 v + (1-b2) g^2``; ``B`` the update the state
    stood for before this gradient, ``m_hat / (sqrt(v_hat) + eps)`` -- the direction and
    size the steps before it moved the weights with. ``_restored``: the same with ``v``
    scaled by ``restore`` (>= 1) first. Weight decay is left out (the same in both). Pure:
    the state is read, never written."""
    out = torch.zeros(4, dtype=torch.float64, device=device)
    for e in entries:
        g = e.grad.float()
        k = e.step + 1.0
        bc1, bc2 = 1.0 - e.beta1 ** k, 1.0 - e.beta2 ** k
        m = (e.beta1 * e.exp_avg.float() + (1.0 - e.beta1) * g) / bc1
        g2 = (1.0 - e.beta2) * g * g
        v = e.exp_avg_sq.float() * e.beta2
        u = m / ((v + g2).div(bc2).sqrt() + e.eps)
        u_h = m / ((v * restore + g2).div(bc2).sqrt() + e.eps)
        out[0] += u.double().square().sum()
        out[1] += u_h.double().square().sum()
        if e.step >= 1:
            b1, b2 = 1.0 - e.beta1 ** e.step, 1.0 - e.beta2 ** e.step
            m0, v0 = e.exp_avg.float() / b1, e.exp_avg_sq.float() / b2
            out[2] += (m0 / (v0.sqrt() + e.eps)).double().square().sum()
            out[3] += (m0 / ((v0 * restore).sqrt() + e.eps)).double().square().sum()
    return out


def amplification(norms: list[float]) -> float:
    """The actual update's norm over the restored one's (1.0 when both are 0): ``norms``
    one pair of :func:`update_norms`."""
    a, h = norms
    if h <= 0.0:
        return 1.0 if a <= 0.0 else math.inf
    return math.sqrt(a / h)
