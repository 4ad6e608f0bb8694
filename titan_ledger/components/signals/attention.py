"""Inner attentions that also record the step's max attention logit.

Design decision (CPU): FlexAttention has no CPU backward and torchtitan 0.3.0
refuses SDPA for language models (SDPA cannot take per-document masks). On CPU we
materialise the mask Flex uses -- causal, no attention across packed documents,
``positions == 0`` starts a document -- as a dense boolean tensor once per batch
and run ``scaled_dot_product_attention`` with it (it has a CPU backward). The
mask is O(B * L^2) booleans: fine at CPU-rehearsal sequence lengths, never on GPU.

Design decision (GPU): the max logit comes from FlexAttention's own
``AuxRequest(max_scores=True)`` (per-row max of the scaled pre-softmax scores,
masked positions excluded): no extra kernel. ``LedgerFlexAttention`` is
torchtitan's ``FlexAttention`` with that one request added.

Both keep a running max over the step's training-mode calls (microbatches, PP,
activation recompute; not validation, which runs in eval mode) in ``max_logit``;
the ledger reads and resets it each step. The value
stays on device: reading it is the ledger's business, once, packed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask
from torch.profiler import record_function
from torchtitan.distributed.compile import maybe_regional_inductor
from torchtitan.models.common.attention import FlexAttention
from torchtitan.protocols.module import Module

from titan_ledger.rehearsal import backend


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


class MaxLogitRecorder:
    """Mixin: a running max of the attention logits seen since the last reset."""

    record_max_logit: bool = False
    max_logit: torch.Tensor | None = None
    #: ``replay rerun --variant logit_cap=X`` only: scores soft-capped at X (Gemma 2's
    #: ``X * tanh(s / X)``) before the softmax; the recorded max is the capped one
    #: (what the softmax saw, as Flex's ``max_scores`` after a ``score_mod``)
    softcap: float | None = None
    #: QK-clip (``[qk_clip] enable``): keep one max per head (this rank's heads) instead of
    #: one scalar; the ledger places them at their (layer, head) slots
    per_head: bool = False

    def _record(self, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.max_logit = value if self.max_logit is None else torch.maximum(self.max_logit, value)

    def take_max_logit(self, device: torch.device) -> torch.Tensor:
        """The max since the last call (``-inf`` if none), and reset: a scalar, or this
        rank's ``[heads]`` maxima when ``per_head``."""
        v = self.max_logit
        self.max_logit = None
        return v if v is not None else torch.full((), float("-inf"), device=device)


class CpuAttention(MaxLogitRecorder, Module):
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
        if self.softcap is not None:
            out = _softcapped_attention(q, k, v, attention_masks, scale, self.softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        if self.record_max_logit and self.training:  # validation (eval mode) is not a train signal
            with record_function("titan_ledger.max_logit"):
                m = (_max_scaled_score_per_head if self.per_head else _max_scaled_score)(
                    q, k, attention_masks, scale)
                self._record(m if self.softcap is None else self.softcap * torch.tanh(m / self.softcap))
        return out.transpose(1, 2)


def _softcapped_attention(q, k, v, mask, scale, cap: float) -> torch.Tensor:
    """Attention with the scores soft-capped (``cap * tanh(s / cap)``), written out
    (SDPA has no score hook); q, k, v are (B, N, L, H). A rerun counterfactual, not
    a training path: it materialises the scores."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(v.dtype), v)


@torch.no_grad()
def _max_scaled_score(q, k, mask, scale) -> torch.Tensor:
    """max over unmasked (b, h, i, j) of q_i . k_j * scale; q, k are (B, N, L, H).

    The mask does not depend on the head, so the max over heads is taken first
    (one pass over the scores) and the mask is applied to the [B, L, L] result;
    ``scale > 0`` is applied to the single maximum.
    """
    if k.shape[1] != q.shape[1]:  # GQA: each kv head serves n_heads / n_kv_heads q heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pair_max = torch.matmul(q.float(), k.float().transpose(-1, -2)).amax(dim=1)
    return pair_max.masked_fill_(~mask[:, 0], float("-inf")).amax() * scale


@torch.no_grad()
def _max_scaled_score_per_head(q, k, mask, scale) -> torch.Tensor:
    """``[N]``: per head, the max over unmasked (b, i, j) of q_i . k_j * scale (QK-clip's
    input; it materialises the [B, N, L, L] scores, as the CPU attention does anyway)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2))
    return s.masked_fill_(~mask, float("-inf")).amax(dim=(0, 2, 3)) * scale


class LedgerFlexAttention(MaxLogitRecorder, FlexAttention):
    """torchtitan's FlexAttention that also asks Flex for the per-row max score."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        score_mod=None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform=None,
        **kwargs,
    ) -> torch.Tensor:
        # Copied from torchtitan.models.common.attention.FlexAttention.forward.
        assert isinstance(attention_masks, BlockMask), type(attention_masks)
        if self.softcap is not None:  # CHANGED from torchtitan: replay rerun's logit_cap variant
            score_mod = _softcap_mod(self.softcap, score_mod)
        q_BNLH = q_BLNH.transpose(1, 2)
        k_BNLH = k_BLNH.transpose(1, 2)
        v_BNLH = v_BLNH.transpose(1, 2)
        with maybe_regional_inductor(FlexAttention.inductor_configs):
            out_BNLH, aux = FlexAttention.compiled_flex_attn(
                q_BNLH,
                k_BNLH,
                v_BNLH,
                score_mod=score_mod,
                block_mask=attention_masks,
                scale=scale,
                enable_gqa=enable_gqa,
                # CHANGED from torchtitan: also return the per-row max score
                return_aux=AuxRequest(lse=out_transform is not None,
                                      max_scores=self.record_max_logit and self.training),
                kernel_options=self.kernel_options,
            )
        if self.record_max_logit and self.training:  # CHANGED from torchtitan
            with record_function("titan_ledger.max_logit"):
                ms = aux.max_scores  # [B, N, L]
                self._record(ms.amax(dim=(0, 2)) if self.per_head else ms.amax())
        out_BLNH = out_BNLH.transpose(1, 2)
        if out_transform is None:
            return out_BLNH
        lse_BLN = aux.lse.transpose(1, 2)
        return out_transform(out_BLNH, lse_BLN)


def _softcap_mod(cap: float, inner=None):
    def mod(score, b, h, q_idx, kv_idx):
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        return cap * torch.tanh(score / cap)

    return mod


def forget_pp_metadata_inference(schedule, recorders: list[MaxLogitRecorder], also=()) -> None:
    """Drop logits (and, via ``also``, anything else) seen during PP metadata inference.

    torch 2.14's pipeline schedules run one real forward/backward on made-up
    inputs to infer stage shapes, inside the first ``schedule.step()``; the stage
    then calls ``_post_metadata_inference_cleanup``. We extend that cleanup to
    forget what the attention recorders saw, and to call every function in ``also``
    (the per-document loss tracker's ``rewind_step``: the inference also runs the
    loss). Private torch API: if it moves, the PP exactness test fails rather than a
    wrong max_logit or document loss going unnoticed.
    """
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
        if cleanup is None:
            continue

        def wrapped(*args, _cleanup=cleanup, **kwargs):
            try:
                return _cleanup(*args, **kwargs)
            finally:
                for r in recorders:
                    r.max_logit = None
                for f in also:
                    f()

        stage._post_metadata_inference_cleanup = wrapped


# --------------------------------------------------------------- choosing the attention
def adapt_config(config) -> None:
    """Rewrite a Trainer config in place for the installed backend (CPU only).

    Swaps every FlexAttention/Varlen inner attention for the CPU masked attention,
    wraps ``parallelize_fn`` so FSDP reduces with SUM (gloo), and turns off the
    GPU-only features (CUDA graphs, compile, mixed-precision casts to bf16 that
    CPU matmuls do not need).
    """
    if backend.installed() != "cpu":
        return
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention


    spec = config.model_spec
    if spec is None:
        raise ValueError("config.model_spec is not set; build configs via a config function")
    model_cfg = spec.model
    for cls in (FlexAttention.Config, VarlenAttention.Config):
        for _fqn, _cfg, parent, attr in list(model_cfg.traverse(cls)):
            if parent is not None:
                if isinstance(parent, list):
                    parent[attr] = CpuAttention.Config()
                else:
                    setattr(parent, attr, CpuAttention.Config())
    fn = spec.parallelize_fn
    if not getattr(fn, "_titan_ledger_sum_reduction", False):
        spec = replace(spec, parallelize_fn=backend.sum_reduction(fn))
    config.model_spec = spec
    config.training.disable_cuda_graphs = True
    config.compile.enable = False


def use_max_logit_attention(config) -> None:
    """GPU: swap FlexAttention for ``LedgerFlexAttention`` (Flex ``max_scores``)."""
    from torchtitan.models.common.attention import FlexAttention


    model_cfg = config.model_spec.model
    for _fqn, cfg, parent, attr in list(model_cfg.traverse(FlexAttention.Config)):
        if parent is None or isinstance(cfg, LedgerFlexAttention.Config):
            continue
        if cfg.kernel_options.get("BACKEND") == "FLASH":
            raise ValueError(
                "--ledger.max_logit needs FlexAttention's Triton backend: torch 2.14 cannot "
                "return max scores with BACKEND='FLASH' (attn_backend 'flex_flash'). Use "
                "attn_backend 'flex' or set --ledger.no_max_logit."
            )
        new = LedgerFlexAttention.Config(block_size=cfg.block_size, kernel_options=cfg.kernel_options)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)


def uses_cpu_attention(model_config) -> bool:

    return any(True for _ in model_config.traverse(CpuAttention.Config))


def give_validator_dense_masks(validator) -> None:
    """torchtitan's Validator builds its own inputs (masks only for Flex/Varlen configs):
    extend its ``post_dataloading_process`` the way ``LedgerTrainer``'s is extended."""
    build = validator.post_dataloading_process

    def with_dense_mask(input_dict, labels, model_parts, _build=build):
        inputs, labels, extra_kwargs = _build(input_dict, labels, model_parts)
        extra_kwargs["attention_masks"] = document_causal_mask(extra_kwargs["positions"])
        return inputs, labels, extra_kwargs

    validator.post_dataloading_process = with_dense_mask
