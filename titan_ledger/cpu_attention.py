"""Masked attention for the CPU rehearsal backend.

Design decision: FlexAttention has no CPU backward and torchtitan 0.3.0 refuses SDPA
for language models (SDPA cannot take per-document masks). On CPU we therefore
materialise the same mask Flex uses -- causal, and no attention across packed
document boundaries, where ``positions == 0`` starts a document -- as a dense
boolean tensor, once per batch, and run ``scaled_dot_product_attention`` with it
(which has a CPU backward). The dense mask is O(B * L^2) booleans: fine for the
sequence lengths a CPU rehearsal uses, and never active on GPU.

The mask is built in :func:`document_causal_mask` (pure, unit-tested against
FlexAttention's forward on CPU) and passed to the model as ``attention_masks`` by
``LedgerTrainer.post_dataloading_process``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan.protocols.module import Module


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions -> ``[B, 1, L, L]`` bool mask, True where q may attend k.

    A document starts wherever ``positions == 0``. torchtitan's dataloaders start
    every row at 0 (a row that begins mid-document is renormalised), which is the
    input Flex's packed-document mask is defined for.
    """
    if positions.dim() != 2:
        raise ValueError(f"positions must be [batch, seq], got shape {tuple(positions.shape)}")
    doc = torch.cumsum((positions == 0).to(torch.int32), dim=1)
    same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)
    seq = positions.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril_()
    return (same_doc & causal).unsqueeze(1)


class CpuAttention(Module):
    """Inner attention with a dense document-causal mask; drop-in for FlexAttention.

    Takes and returns ``(batch, seq, heads, head_dim)`` like torchtitan's inner
    attentions. ``attention_masks`` is the ``[B, 1, L, L]`` bool tensor from
    :func:`document_causal_mask`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor | None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform=None,
        **kwargs,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, torch.Tensor):
            raise TypeError(
                "CpuAttention needs a dense bool mask built from positions "
                f"(got {type(attention_masks).__name__}); batches must carry 'positions'"
            )
        if out_transform is not None:
            raise NotImplementedError("CpuAttention does not return the log-sum-exp")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)
