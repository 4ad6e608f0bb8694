"""Prevention (design article §3): model options that keep attention logits bounded.

Design decision: use torchtitan's own mechanisms, switched on from our config, rather
than our own modules. ``[model] qk_norm`` sets ``GQAttention.Config.qk_norm`` (the
per-head RMSNorm on q and k that Qwen3 uses; llama3 leaves it ``None``) on every
layer's attention before the model is built, with the sharding Qwen3 declares for it:
the norm weight replicated over TP, its input and output sharded on the head dim, so
under TP each rank normalizes its own heads and nothing is gathered. torchtitan's llama3
sharding (``set_llama3_sharding_config``) does not touch ``qk_norm``, so the
declaration made here survives ``update_from_config``.

The norm runs inside ``GQAttention.forward`` before RoPE and before the inner attention,
so the ledger's max attention logit (computed by the inner attention from the q and k it
is given) and the per-document loss (computed from the logits) need no change: they
measure the normalized model.

A checkpoint written without QK-norm has no ``q_norm``/``k_norm`` weights: turning it on
mid-run is a new model, not a resume (DCP refuses the load and names the missing keys).
"""

from __future__ import annotations

from dataclasses import dataclass

_QK_NORM_EPS = 1e-6  # Qwen3's and OLMo 2's epsilon for the per-head norm


@dataclass(kw_only=True, slots=True)
class ModelOptions:
    """Switches on the model that the TOML's model function does not expose."""

    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (torchtitan's ``GQAttention``
    ``qk_norm``, as Qwen3 and OLMo 2): bounds the attention logits that grow with the LR.
    Adds ``2 * head_dim`` weights per layer; a checkpoint written without it will not
    load with it."""


def apply_qk_norm(model_config) -> int:
    """Give every ``GQAttention.Config`` in ``model_config`` a per-head RMSNorm (and its
    TP sharding) unless it has one; returns how many attention configs were changed."""
    import spmd_types as spmd
    from torch import nn
    from torchtitan.models.common.attention import GQAttention
    from torchtitan.models.common.decoder_sharding import dense_activation_placement, dense_param_placement
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.protocols.sharding import ShardingConfig

    changed = 0
    for _fqn, cfg, _parent, _attr in list(model_config.traverse(GQAttention.Config)):
        if cfg.qk_norm is not None:
            continue
        head_dim = cfg.head_dim if cfg.head_dim is not None else cfg.dim // cfg.n_heads
        norm = RMSNorm.Config(normalized_shape=head_dim, eps=_QK_NORM_EPS, param_init={"weight": nn.init.ones_})
        # as torchtitan's qwen3/sharding.py: shard on the head dim (dim 2), weight replicated
        norm.sharding_config = ShardingConfig(
            state_shardings={"weight": dense_param_placement(tp=spmd.R)},
            in_src_shardings={"input": dense_activation_placement(tp=spmd.S(2))},
            in_dst_shardings={"input": dense_activation_placement(tp=spmd.S(2))},
            out_src_shardings=dense_activation_placement(tp=spmd.S(2)),
            out_dst_shardings=dense_activation_placement(tp=spmd.S(2)),
        )
        cfg.qk_norm = norm
        changed += 1
    return changed
