"""The CPU attention equals FlexAttention's forward (CPU) and has a backward."""

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
from torchtitan.models.common.attention import (
    get_causal_mask_mod,
    get_efficient_causal_mask_mod_for_packed_document,
)

from titan_ledger.components.signals.attention import CpuAttention, document_causal_mask


def _positions(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Packed rows: random document lengths, positions restart at 0 per document.

    Every row starts at position 0: torchtitan's text dataset renormalises a row
    that begins mid-document (``_normalize_positions``).
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        pos, p = [], 0
        while len(pos) < seq:
            n = int(torch.randint(3, seq // 2, (1,), generator=g))
            pos.extend(range(p, p + n))
            p = 0
        rows.append(pos[:seq])
    return torch.tensor(rows)


def _flex_reference(q, k, v, positions, enable_gqa):
    mask_mod = and_masks(
        get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions)
    )
    B, _, L, _ = q.shape
    block_mask = create_block_mask(mask_mod, B, None, L, L, device="cpu", BLOCK_SIZE=16)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 4, 4), (3, 4, 2)])
def test_matches_flex_forward(batch, heads, kv_heads):
    torch.manual_seed(0)
    seq, dim = 64, 16
    positions = _positions(batch, seq, seed=batch)
    q = torch.randn(batch, seq, heads, dim)
    k = torch.randn(batch, seq, kv_heads, dim)
    v = torch.randn(batch, seq, kv_heads, dim)
    gqa = heads != kv_heads
    ours = CpuAttention(CpuAttention.Config())(
        q, k, v, attention_masks=document_causal_mask(positions), enable_gqa=gqa
    )
    ref = _flex_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions, gqa)
    torch.testing.assert_close(ours, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_mask_blocks_other_documents_and_future():
    positions = torch.tensor([[3, 4, 0, 1, 2, 0]])
    m = document_causal_mask(positions)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)


def test_backward_matches_dense_math():
    torch.manual_seed(1)
    B, L, N, H = 2, 32, 2, 8
    positions = _positions(B, L, seed=5)
    q, k, v = (torch.randn(B, L, N, H, requires_grad=True) for _ in range(3))
    mask = document_causal_mask(positions)
    out = CpuAttention(CpuAttention.Config())(q, k, v, attention_masks=mask)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]

    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    s = torch.einsum("blnh,bmnh->bnlm", q2, k2) / H**0.5
    s = s.masked_fill(~mask, float("-inf"))
    ref = torch.einsum("bnlm,bmnh->blnh", s.softmax(-1), v2)
    ref.square().sum().backward()
    for g, t in zip(grads, (q2, k2, v2)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)


def test_rejects_block_mask():
    x = torch.randn(1, 4, 1, 2)
    with pytest.raises(TypeError, match="dense bool mask"):
        CpuAttention(CpuAttention.Config())(x, x, x, attention_masks=None)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_softcap_matches_flex_with_a_tanh_score_mod(heads, kv_heads):
    """``replay rerun --variant logit_cap=X``: the CPU path writes the capped attention
    out; it must equal Flex with ``X * tanh(s / X)`` as its score_mod, and a cap far
    above every score must give plain attention back."""
    torch.manual_seed(1)
    batch, seq, dim, cap = 2, 64, 16, 2.0
    positions = _positions(batch, seq, seed=7)
    q, k, v = (torch.randn(batch, seq, h, dim) * 3 for h in (heads, kv_heads, kv_heads))
    gqa = heads != kv_heads
    attn = CpuAttention(CpuAttention.Config())
    attn.record_max_logit = True
    attn.softcap = cap
    ours = attn(q, k, v, attention_masks=document_causal_mask(positions), enable_gqa=gqa)
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    bm = create_block_mask(mask_mod, batch, None, seq, seq, device="cpu", BLOCK_SIZE=16)
    ref = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                         enable_gqa=gqa, score_mod=lambda s, b, h, i, j: cap * torch.tanh(s / cap))
    torch.testing.assert_close(ours, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert float(attn.take_max_logit(torch.device("cpu"))) <= cap  # the capped max is recorded
    attn.softcap = 1e6
    plain = CpuAttention(CpuAttention.Config())
    m = document_causal_mask(positions)
    torch.testing.assert_close(attn(q, k, v, attention_masks=m, enable_gqa=gqa),
                               plain(q, k, v, attention_masks=m, enable_gqa=gqa), rtol=1e-4, atol=1e-5)
