"""QK-clip (MuonClip's clip, Kimi K2; Megatron core ``qk_clip``) on torchtitan's ``GQAttention``.

After ``optimizers.step()``, every query group whose max attention logit this step
exceeded ``threshold`` has its query rows scaled by eta^alpha and its key rows by
eta^(1 - alpha), eta = threshold / that max: the group's logits scale by eta, so the
next step's max is held near the threshold. A group is one KV head and the query heads
that share it (Megatron's rule for GQA: the max over the group; per head in MHA). The
Adam moments are left as they are (as Megatron and Kimi do).

Design decision: the input is free. The ledger already gathers every rank's max
attention logit in its one all-gather per step; with QK-clip on, each inner attention
keeps one max per head (``MaxLogitRecorder.per_head``) and each rank writes its heads'
maxima at their global ``(layer, head)`` slots of the vector it contributes (``-inf``
elsewhere), so the same all-gather gives every rank the ``[layers, heads]`` maxima
over DP, TP, CP and PP: no extra collective, nothing read on the host. Its cost is
``layers * heads`` more fp64 values per rank in that all-gather (80 x 64 x 8 bytes =
40 KB per rank for a 70B model).

The weights are scaled where they are: a parameter sharded by FSDP2 and/or TP is a
DTensor, and the row-scale vector -- identical on every rank, since it comes from the
gathered table -- is wrapped as a replicated DTensor on the parameter's mesh, so
DTensor's pointwise rule slices it to each local shard without communication (also for
FSDP2 x TP's strided shards). Under PP each stage scales its own layers.

A step whose update the guard rejected is not clipped: its weights did not move and its
logits were the flagged step's. QK-clip with ``[model] qk_norm`` is refused: the norms
re-normalise q and k, so scaling their projections changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from titan_ledger.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class QKClipConfig:
    """The ``[qk_clip]`` section."""

    enable: bool = False
    """After each optimizer step, scale the Q and K projection rows of every query group
    whose max attention logit exceeded ``threshold`` (MuonClip's QK-clip, as Megatron
    ``qk_clip``). Reads the ledger's per-head max logits: needs ``--ledger.signals`` and
    ``--ledger.max_logit`` (the defaults)."""

    threshold: float = 100.0
    """The max attention logit (scaled q.k, before the softmax) a head may reach (Kimi K2
    and Megatron: 100)."""

    alpha: float = 0.5
    """The share of the clip put on the queries: q rows scale by eta^alpha, k rows by
    eta^(1 - alpha)."""

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ConfigError(f"--qk_clip.threshold must be > 0 (got {self.threshold})")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"--qk_clip.alpha must be in [0, 1] (got {self.alpha})")


# --------------------------------------------------------------------------- the math (pure)
def group_eta(head_max: torch.Tensor, threshold: float, heads_per_group: int) -> torch.Tensor:
    """``[..., heads]`` maxima -> ``[..., groups]`` factors: threshold / (the group's max)
    where that max exceeds the threshold, else 1 (also where no logit was seen: -inf)."""
    g = head_max.unflatten(-1, (-1, heads_per_group)).amax(-1)
    return torch.where(g > threshold, threshold / g, torch.ones_like(g))


def row_scales(eta: torch.Tensor, heads_per_group: int, head_dim: int, alpha: float,
               fused: bool) -> tuple[torch.Tensor, ...]:
    """Per-output-row factors for one layer's projections, from its ``[groups]`` eta.

    ``fused`` (torchtitan's ``FusedQKVLinear``, rows ``[group, hpk + 2, head_dim]``: the
    group's query heads, its key, its value): one vector for ``wqkv``. Otherwise
    ``(q_rows, k_rows)`` for ``wq`` (``[heads * head_dim]``, head h in group h // hpk) and
    ``wk`` (``[groups * head_dim]``)."""
    q = eta.pow(alpha)[:, None].expand(-1, heads_per_group * head_dim)
    k = eta.pow(1.0 - alpha)[:, None].expand(-1, head_dim)
    if fused:
        return (torch.cat([q, k, torch.ones_like(k)], dim=1).reshape(-1),)
    return q.reshape(-1), k.reshape(-1)


def clip_stats(eta: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """``[2]``: query heads whose rows are scaled, and the smallest eta (1 when none)."""
    return torch.stack([(eta < 1).sum().to(eta.dtype) * heads_per_group, eta.min()])


# --------------------------------------------------------------------------- the component
@dataclass
class _Layer:
    index: int  # global layer index (PP stages keep torchtitan's layer keys)
    inner: object  # the inner attention (a MaxLogitRecorder)
    params: list  # [(parameter, "wqkv" | "wq" | "wk")]
    slot: int  # where this rank's heads start in the [layers * heads] vector
    local_heads: int


class QKClip:
    """Binds the clip to a built model: finds each ``GQAttention``, turns its inner
    attention's per-head max on, and scales its projections after the update."""

    def __init__(self, cfg: QKClipConfig, model_parts, *, n_layers: int, tp_rank: int, tp_size: int):
        from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, QKVLinear

        from titan_ledger.components.signals.attention import MaxLogitRecorder

        self.cfg = cfg
        self.n_layers = n_layers
        self.layers: list[_Layer] = []
        shape = None
        for part in model_parts:
            for name, mod in part.named_modules():
                if not isinstance(mod, GQAttention):
                    continue
                if mod.q_norm is not None:
                    raise ConfigError("--qk_clip.enable with --model.qk_norm: QK-norm re-normalises q and k, so "
                                      "scaling their projections changes nothing; choose one")
                m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
                if m is None or int(m.group(1)) >= n_layers:
                    raise ConfigError(f"--qk_clip.enable: cannot place attention {name!r} among {n_layers} layers")
                if not isinstance(mod.inner_attention, MaxLogitRecorder):
                    raise ConfigError("--qk_clip.enable needs the ledger's max-logit attention "
                                      "(--ledger.max_logit, FlexAttention on GPU or the CPU attention)")
                qkv = mod.qkv_linear
                if isinstance(qkv, FusedQKVLinear):
                    params = [(qkv.wqkv.weight, "wqkv")] + ([(qkv.wqkv.bias, "wqkv")] if qkv.wqkv.bias is not None else [])
                elif isinstance(qkv, QKVLinear):
                    params = [(qkv.wq.weight, "wq"), (qkv.wk.weight, "wk")]
                    params += [(lin.bias, kind) for lin, kind in ((qkv.wq, "wq"), (qkv.wk, "wk")) if lin.bias is not None]
                else:
                    raise ConfigError(f"--qk_clip.enable: {type(qkv).__name__} projections are not supported "
                                      "(QKVLinear and FusedQKVLinear are)")
                here = (mod.n_heads, mod.n_kv_heads, mod.head_dim)
                if shape not in (None, here):
                    raise ConfigError("--qk_clip.enable: every layer must have the same heads")
                shape = here
                local = mod.n_heads // tp_size
                mod.inner_attention.per_head = True
                self.layers.append(_Layer(int(m.group(1)), mod.inner_attention, params,
                                          int(m.group(1)) * mod.n_heads + tp_rank * local, local))
        if shape is None:
            raise ConfigError("--qk_clip.enable: the model has no GQAttention")
        self.n_heads, self.n_kv_heads, self.head_dim = shape
        self.hpk = self.n_heads // self.n_kv_heads
        self._slot_of = {id(layer.inner): layer for layer in self.layers}
        self.head_max: torch.Tensor | None = None  # [layers, heads], set by the recorder each step

    @property
    def size(self) -> int:
        return self.n_layers * self.n_heads

    def place(self, out: torch.Tensor, taken: list[tuple[object, torch.Tensor]]) -> None:
        """Write this rank's per-head maxima (``(inner attention, [local heads])``) into
        ``out`` (``[layers * heads]``, ``-inf`` where this rank has no head)."""
        out.fill_(float("-inf"))
        for inner, v in taken:
            layer = self._slot_of.get(id(inner))
            if layer is not None and v.dim() == 1:  # a scalar -inf: no call this step
                out[layer.slot:layer.slot + layer.local_heads] = v.double()

    def reduce(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[world, layers * heads]`` -> keeps ``head_max`` and returns ``[heads clipped, min eta]``."""
        self.head_max = gathered.amax(0).view(self.n_layers, self.n_heads)
        return clip_stats(group_eta(self.head_max, self.cfg.threshold, self.hpk), self.hpk)

    @torch.no_grad()
    def apply(self) -> None:
        """Scale this rank's Q/K rows by the factors of the last reduced step (after
        ``optimizers.step()``); a no-op for groups under the threshold (factor 1)."""
        if self.head_max is None:
            return
        eta = group_eta(self.head_max, self.cfg.threshold, self.hpk)  # [layers, groups]
        for layer in self.layers:
            scales = row_scales(eta[layer.index], self.hpk, self.head_dim, self.cfg.alpha,
                                fused=layer.params[0][1] == "wqkv")
            for p, kind in layer.params:
                rows = scales[0] if kind in ("wqkv", "wq") else scales[1]
                _scale_rows(p, rows)
        self.head_max = None


def _scale_rows(p: torch.Tensor, rows: torch.Tensor) -> None:
    """``p[i, ...] *= rows[i]`` in place, on a plain tensor or a DTensor of any placement."""
    from torch.distributed.tensor import DTensor, Replicate

    s = rows.to(device=p.device, dtype=p.dtype)
    if p.dim() == 2:
        s = s.unsqueeze(1)
    if isinstance(p, DTensor):
        s = DTensor.from_local(s, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    p.mul_(s)
