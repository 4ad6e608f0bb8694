"""Weight-decay exceptions (design article §3.4) as named presets on torchtitan's
parameter groups.

Design decision: torchtitan 0.3.0 groups parameters by FQN regex
(``ParamGroupConfig.pattern``), which cannot say "one-dimensional". So each configured
group is split after torchtitan matched it, on the live parameters: the exceptions get
a copy of the group's optimizer kwargs with ``weight_decay = 0``. Everything else --
the patterns, first-match-wins, one optimizer per type, the FQN-keyed checkpoint state
-- stays torchtitan's (the state is keyed per parameter, so a split group resumes a
checkpoint written without the split, and the reverse).

Presets (``[optimizer] no_decay``):

* ``none``: torchtitan's behaviour, one weight decay for every parameter of a group.
* ``megatron``: no decay on 1-D parameters (norm gains) and on biases
  (``get_standard_config_overrides``: ``wd_mult = 0`` for ``ndim == 1`` or ``.bias``).
* ``olmo2``: ``megatron`` and no decay on the token embedding (OLMo 2: keeps the
  embedding norm from shrinking, which would inflate the first layer's relative update).

:func:`describe_groups` is what the signals header records (``param_groups``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

from titan_ledger.errors import ConfigError

PRESETS = ("none", "megatron", "olmo2")


def no_decay_reason(name: str, param: nn.Parameter, embeddings: set[str], preset: str) -> str | None:
    """Why ``preset`` exempts the parameter ``name`` from weight decay (None: it decays)."""
    if preset == "none":
        return None
    if param.ndim <= 1:
        return "1-D"
    if name.endswith(".bias"):
        return "bias"
    if preset == "olmo2" and name in embeddings:
        return "embedding"
    return None


def embedding_params(model: nn.Module) -> set[str]:
    """FQNs of the weights of the model's ``nn.Embedding`` modules."""
    return {f"{mod_name}.{p_name}" if mod_name else p_name
            for mod_name, m in model.named_modules() if isinstance(m, nn.Embedding)
            for p_name, _ in m.named_parameters(recurse=False)}


#: a param group's hyperparameters the launch's config decides over a checkpoint's
_CONFIG_KEYS = ("weight_decay", "eps", "betas")


class LedgerOptimizers(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with the weight-decay presets."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        no_decay: str = "none"
        """Weight-decay exceptions (design article §3.4): none | megatron (no decay on 1-D
        parameters and biases) | olmo2 (megatron, and none on the token embedding). The
        groups and their decay are recorded in the signals header (param_groups)."""

        def __post_init__(self) -> None:
            if self.no_decay not in PRESETS:
                raise ConfigError(f"--optimizer.no_decay {self.no_decay!r}: use one of {', '.join(PRESETS)}")

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        # read by _build_param_groups, which torchtitan's __init__ calls per model part
        self._no_decay = config.no_decay
        super().__init__(config, model_parts=model_parts)
        # each group's hyperparameters as this launch's config and preset give them
        self._kept = [[{k: g[k] for k in _CONFIG_KEYS if k in g} for g in o.param_groups] for o in self.optimizers]

    def load_state_dict(self, state_dict) -> None:
        # ADDED: torchtitan restores every group's kwargs from the checkpoint, so a value
        # changed on resume would silently not apply -- a preset's decay, and the epsilon or
        # betas of a fix relaunched from a checkpoint (measured, issue 67: a relaunch with
        # --optimizer.eps 1e-6 from step-360 trained bit for bit as the run it was to fix).
        # The config decides the hyperparameters; the checkpoint the optimizer state
        # (moments, step) and the LR (its scheduler's position, from the config's base LR)
        super().load_state_dict(state_dict)
        for opt, kept in zip(self.optimizers, self._kept):
            for g, values in zip(opt.param_groups, kept):
                g.update(values)

    # CHANGED from torchtitan (a staticmethod there, called as self._build_param_groups):
    # each matched group is split into the parameters that decay and the exceptions
    def _build_param_groups(self, model: nn.Module, param_group_configs, impl_kwargs):
        groups, patterns = OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        if self._no_decay == "none":
            return groups, patterns
        embeddings = embedding_params(model)
        # the model's own names by object (param_names are canonical FQNs, aligned with params)
        by_id = {id(p): n for n, p in model.named_parameters()}
        out_groups: dict[str, list[dict[str, Any]]] = {}
        out_patterns: dict[str, list[str]] = {}
        for opt_name, gs in groups.items():
            og, op = out_groups.setdefault(opt_name, []), out_patterns.setdefault(opt_name, [])
            for g, pattern in zip(gs, patterns[opt_name]):
                keep, drop = ([], []), ([], [])
                for p, fqn in zip(g["params"], g["param_names"]):
                    side = drop if no_decay_reason(by_id.get(id(p), fqn), p, embeddings, self._no_decay) else keep
                    side[0].append(p)
                    side[1].append(fqn)
                if keep[0]:
                    og.append({**g, "params": keep[0], "param_names": keep[1]})
                    op.append(pattern)
                if drop[0]:
                    og.append({**g, "params": drop[0], "param_names": drop[1], "weight_decay": 0.0})
                    op.append(f"{pattern} [no_decay={self._no_decay}]")
        return out_groups, out_patterns


def describe_groups(optimizers) -> list[dict[str, Any]]:
    """Each optimizer parameter group: optimizer, weight decay, lr, parameters, their
    elements (full sizes, sharded or not) and a few names (under PP a stage's own)."""
    out = []
    for opt in getattr(optimizers, "optimizers", []):
        for g in opt.param_groups:
            names = list(g.get("param_names") or [])
            out.append({"optimizer": type(opt).__name__, "weight_decay": g.get("weight_decay"), "lr": g.get("lr"),
                        "params": len(g["params"]), "numel": int(sum(p.numel() for p in g["params"])),
                        "examples": names[:3]})
    return out


def scale_lr(lr_schedulers, factor: float) -> None:
    """The LR from now on is ``factor`` x the config's: the schedulers' base LRs
    (torchtitan rebuilds them from the config; its checkpoint load keeps them as they
    are) and the optimizer's current ones (a checkpoint restores those). ``factor`` is
    the total, not a further step: the base LRs the config gave are kept on the scheduler
    the first time, so that calling it again after every checkpoint load -- the recovery
    ladder's cumulative ``rollback_lr`` factor -- does not compound. Used by the ladder
    and by ``replay rerun``'s ``lr_scale``."""
    for sched in lr_schedulers.schedulers:
        if getattr(sched, "titan_ledger_unscaled", None) is None:
            sched.titan_ledger_unscaled = list(sched.base_lrs)  # what the config gave
        sched.base_lrs = [b * factor for b in sched.titan_ledger_unscaled]
        # the schedule's value at its position, from the scaled base (what a step computes)
        sched._last_lr = [b * lr_lambda(sched.last_epoch) for b, lr_lambda in zip(sched.base_lrs, sched.lr_lambdas)]
        for g, lr in zip(sched.optimizer.param_groups, sched._last_lr, strict=True):
            set_group_lr(g, lr)


def group_lr(group: dict):
    """A param group's learning rate as it is now: a tensor one (a scheduler fills it in
    place) is copied on the device, not read on the host."""
    lr = group["lr"]
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def set_group_lr(group: dict, lr) -> None:
    """Put ``lr`` (a :func:`group_lr`) in a param group: a tensor LR in place, so that
    whoever holds it (a compiled step) sees the value."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].copy_(lr)
    else:
        group["lr"] = lr
