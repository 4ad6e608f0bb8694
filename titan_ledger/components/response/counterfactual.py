"""The trainer side of ``replay rerun``: ``--ledger.rehearsal.rerun stop=N,lr_scale=X,eps=X,logit_cap=X,beta2=X``.

Design decision: a counterfactual rerun is an ordinary training run with a handful of
overrides applied right after its checkpoint load (the checkpoint restores the LR, eps
and betas, so flags alone would act one step late) and a stop step. This module is the
only code the trainer runs for it; planning, running and judging reruns are the tool's
(:mod:`titan_ledger.tools.rerun`), which the runtime never imports.
"""

from __future__ import annotations

import math

from titan_ledger.errors import ConfigError


def parse_overrides(spec: str) -> dict[str, float]:
    """``--ledger.rehearsal.rerun "stop=9,lr_scale=0.5,eps=1e-6"`` -> {"stop": 9, ...}."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in (spec or "").split(",") if p.strip()):
        key, _, val = part.partition("=")
        try:
            v = float(val)
        except ValueError:
            v = math.nan
        if key not in ("stop", "lr_scale", "eps", "logit_cap", "beta2") or not math.isfinite(v) or v <= 0 \
                or (key == "stop" and v != int(v)) or (key == "beta2" and v >= 1):
            raise ConfigError(f"--ledger.rehearsal.rerun {spec!r}: entries are stop=STEP (>= 1), lr_scale=X, "
                              f"eps=X, logit_cap=X (X > 0), beta2=X (0 < X < 1), comma-separated; set by "
                              f"python -m titan_ledger.replay rerun")
        out[key] = int(v) if key == "stop" else v
    return out


def before_stop(overrides: dict[str, float], step: int) -> bool:
    """``should_continue_training``: False once ``stop`` has trained (``overrides``: the
    parsed ``--ledger.rehearsal.rerun``)."""
    stop = overrides.get("stop")
    return stop is None or step < stop


def apply_overrides(overrides: dict[str, float], optimizers, lr_schedulers, model_parts: list) -> None:
    """After the checkpoint load (first step of the process): scale the LR (the
    optimizer's param groups, which the checkpoint restored, and the schedulers'
    base LRs, which torchtitan rebuilt from the config) and set Adam's eps."""
    o = overrides
    scale, eps, cap, beta2 = o.get("lr_scale"), o.get("eps"), o.get("logit_cap"), o.get("beta2")
    if beta2 is not None:
        for opt in optimizers.optimizers:
            set_beta2(opt, beta2)
    if cap is not None:
        from titan_ledger.components.signals.attention import MaxLogitRecorder

        for part in model_parts:
            for m in part.modules():
                if isinstance(m, MaxLogitRecorder):
                    m.softcap = cap
    if scale is not None:
        from titan_ledger.components.prevention.optimizer import scale_lr

        scale_lr(lr_schedulers, scale)
    if eps is not None:
        for sched in lr_schedulers.schedulers:
            for g in sched.optimizer.param_groups:
                g["eps"] = eps


def set_beta2(opt, beta2: float) -> None:
    """Adam's beta2 -> ``beta2`` for the steps after a checkpoint load, keeping each
    parameter's bias-corrected second moment v / (1 - beta2^t) what it was (the rerun
    changes how fast v follows the gradients from here on, not v itself)."""
    import torch

    for g in opt.param_groups:
        b1, old = g["betas"]
        g["betas"] = (b1, beta2)
        for p in g["params"]:
            st = opt.state.get(p, {})
            v, t = st.get("exp_avg_sq"), st.get("step")
            if v is None or t is None:
                continue
            t = float(t) if not isinstance(t, torch.Tensor) else float(t.item())
            if t > 0:
                v.mul_((1 - beta2 ** t) / (1 - old ** t))
