"""Signal math: what each rank contributes so one SUM and one MAX give exact globals.

Design decision: every signal is reduced from *local* tensors with an ownership
rule instead of materialising DTensors (``full_tensor`` costs a collective per
parameter). A parameter's local shard is *owned* by this rank iff its coordinate
is 0 on every mesh dimension where the parameter is replicated (TP-replicated
norms, HSDP's replicate dimension). Sharded dimensions (FSDP, TP) and PP stages
hold disjoint pieces, so summing owned contributions over the world counts each
logical element exactly once -- Megatron's ``param_is_not_tensor_parallel_duplicate``
rule, derived from DTensor placements. The loss is owned by the last PP stage's
TP-rank-0 ranks. Everything here is pure tensor code (no process group calls) so
it is unit-testable; :mod:`titan_ledger.components.signals.recorder` packs it into the collectives.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

_LAYER = re.compile(r"^(?:.*\.)?(layers\.\d+)\.")


def layer_group(fqn: str) -> str:
    """``layers.3.attention.wo.weight`` -> ``layers.3``; ``norm.weight`` -> ``norm``."""
    fqn = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
    m = _LAYER.match(fqn)
    return m.group(1) if m else fqn.split(".")[0]


def owns_local_shard(param: torch.Tensor, world_size: int, pp_degree: int) -> bool:
    """True if this rank's local piece of ``param`` is counted in global sums."""
    if not isinstance(param, DTensor):
        if world_size != pp_degree:
            raise ValueError(
                "a plain (non-DTensor) parameter in a data/tensor-parallel job: its "
                "replicas cannot be told apart; titan_ledger expects torchtitan's FSDP2/TP"
            )
        return True
    mesh = param.device_mesh
    if mesh.size() * pp_degree != world_size:
        raise ValueError(
            f"parameter mesh {mesh.mesh_dim_names} of size {mesh.size()} x PP {pp_degree} "
            f"does not cover the world ({world_size}); replicas outside the mesh would be "
            "counted twice"
        )
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, param.placements) if isinstance(p, Replicate))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class ParamPlan:
    """The parameters this rank owns, grouped by layer (computed once)."""

    params: list[torch.Tensor]
    group_index: torch.Tensor  # [len(params)] index into groups
    groups: list[str]

    @classmethod
    def build(cls, named_params: Iterable[tuple[str, torch.Tensor]], world_size: int,
              pp_degree: int, groups: list[str] | None = None) -> ParamPlan:
        owned, names = [], []
        seen: set[int] = set()
        for fqn, p in named_params:
            if id(p) in seen:  # tied weights: one logical parameter
                continue
            seen.add(id(p))
            if owns_local_shard(p, world_size, pp_degree):
                owned.append(p)
                names.append(layer_group(fqn))
        groups = groups if groups is not None else sorted(set(names), key=natural_key)
        index = {g: i for i, g in enumerate(groups)}
        gi = torch.tensor([index[n] for n in names], dtype=torch.long)
        return cls(owned, gi, groups)


def natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def local_sums(plan: ParamPlan, per_layer: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's owned contributions: zero counts, param and grad sums of squares.

    Returns fp32/int64 tensors on ``device``: ``num_zeros`` (scalar, exactly-zero
    gradient elements), ``param_sq`` (scalar), and with ``per_layer`` the
    ``grad_sq`` vector over ``plan.groups``. A parameter without a gradient
    contributes nothing (and no zeros).
    """
    params = [local(p) for p in plan.params]
    grads = [local(p.grad) if p.grad is not None else None for p in plan.params]
    out: dict[str, torch.Tensor] = {}
    if params:
        pn = torch._foreach_norm([p.detach().float() for p in params])
        out["param_sq"] = torch.stack(pn).square().sum()
    else:
        out["param_sq"] = torch.zeros((), device=device)
    have = [i for i, g in enumerate(grads) if g is not None]
    if have:
        zeros = [(grads[i] == 0).sum() for i in have]
        out["num_zeros"] = torch.stack(zeros).sum()
    else:
        out["num_zeros"] = torch.zeros((), dtype=torch.int64, device=device)
    if per_layer:
        sq = torch.zeros(len(plan.groups), device=device)
        if have:
            gn = torch._foreach_norm([grads[i].float() for i in have])
            idx = plan.group_index if len(have) == len(grads) else plan.group_index[have]
            sq.index_add_(0, idx.to(device), torch.stack(gn).square())
        out["grad_sq"] = sq
    return out


def snapshot(plan: ParamPlan) -> list[torch.Tensor]:
    """Copies of this rank's owned local parameter pieces (before ``optimizers.step``)."""
    return [local(p).detach().clone() for p in plan.params]


def update_sq(plan: ParamPlan, before: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's owned contribution to the squared norm of the update just applied
    (the parameters now minus ``before``): fp32 scalar on ``device``. Summed over the
    world (the ownership rule above) it is the unsharded model's update norm."""
    if not before:
        return torch.zeros((), device=device)
    diffs = [local(p).detach().float() - b.float() for p, b in zip(plan.params, before)]
    return torch.stack(torch._foreach_norm(diffs)).square().sum()


def loss_sum(accumulated_loss: torch.Tensor | None, global_valid_tokens: torch.Tensor) -> torch.Tensor | None:
    """This rank's loss sum: torchtitan's step loss is already divided by the global valid
    tokens, so times them it is the sum. The one formula for the step's record and a
    proof's executions, which are compared bit for bit (computed once in float32 and once
    in float64, a step whose token count is not a power of two differed in its last bits
    and was proven ``hardware``)."""
    return None if accumulated_loss is None else (accumulated_loss * global_valid_tokens).sum()


def clip_coef(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor ``clip_grad_norm_`` multiplied the gradients by (torch's eps 1e-6)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
