"""Check (a) of the GPU validation pack: the max attention logit of the attention kernel.

    python bench/device/check_flex_max_logit.py          # CUDA if visible, else the CPU form
    TITAN_LEDGER_DEVICE=cpu python bench/device/check_flex_max_logit.py

CUDA: ``LedgerFlexAttention`` (torchtitan's compiled FlexAttention asking for
``AuxRequest(max_scores=True)``) gives the same max logit as an eager dense fp32
reference, in fp32 and bf16, with the block-causal packed-document mask, also per head (QK-clip's input);
and the forward+backward time of Flex with and without ``max_scores`` (median of 30).

CPU (Flex has no CPU backward and torch 2.14 refuses ``max_scores`` on CPU): the CPU
rehearsal attention (``CpuAttention``) gives the same output as eager Flex with the
same block mask (so its dense mask is Flex's mask), and its max logit equals a
brute-force per-document loop.

The ledger's host syncs, checked here before, are now counted around a real
training step (``bench/device/worker.py``), so the check survives ledger refactors.
Prints one JSON object; exit code 1 if a check fails. ``run()`` is what
``bench/device/pack.py`` calls.
"""

from __future__ import annotations

import json
import sys
import time


def _timed_median(fn, n: int, cuda: bool) -> float:
    import torch

    ts = []
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts = sorted(ts[min(3, n - 1):])
    return ts[len(ts) // 2]


def _brute_force_max(q, k, positions, scale) -> float:
    """max over (b, h, i <= j within one document) of q_i . k_j * scale, per document."""
    import torch

    best = float("-inf")
    rep = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        starts = (positions[b] == 0).nonzero().flatten().tolist() + [positions.shape[1]]
        for s, e in zip(starts[:-1], starts[1:]):
            for h in range(q.shape[1]):
                sc = q[b, h, s:e].double() @ k[b, h // rep, s:e].double().T
                sc = sc.masked_fill(~torch.ones_like(sc, dtype=torch.bool).tril(), float("-inf"))
                best = max(best, sc.max().item() * scale)
    return best


def run(device: str) -> tuple[dict, bool]:
    """The check on ``device`` ("cuda" or "cpu"); the backend must match (installed here)."""
    from titan_ledger.rehearsal import backend

    backend.install(device)
    import torch
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
    from torchtitan.models.common.attention import (
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    from titan_ledger.components.signals.attention import (
        CpuAttention,
        LedgerFlexAttention,
        _max_scaled_score,
        _max_scaled_score_per_head,
        document_causal_mask,
    )

    cuda = device == "cuda"
    dev = torch.device(device)
    torch.manual_seed(0)
    if cuda:
        B, L, N, Nkv, H, lens = 2, 2048, 16, 4, 128, [700, 500, 848]
    else:
        B, L, N, Nkv, H, lens = 2, 256, 4, 2, 32, [100, 56, 100]
    positions = torch.cat([torch.arange(n) for n in lens]).repeat(B, 1).to(dev)
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    bm = create_block_mask(mask_mod, B, None, L, L, device=device)
    dense = document_causal_mask(positions)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": [B, L, N, Nkv, H]}
    ok = True
    if not cuda:
        attn = CpuAttention(CpuAttention.Config())
        attn.train()
        attn.record_max_logit = True
        q = torch.randn(B, L, N, H) * 4
        k = torch.randn(B, L, Nkv, H) * 4
        v = torch.randn(B, L, Nkv, H)
        got = attn(q, k, v, attention_masks=dense, enable_gqa=True)
        flex = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                              enable_gqa=True).transpose(1, 2)
        out_err = (got - flex).abs().max().item()
        mx = attn.take_max_logit(dev).item()
        ref = _brute_force_max(q.transpose(1, 2), k.transpose(1, 2), positions, H ** -0.5)
        rel = abs(mx - ref) / abs(ref)
        out["cpu_attention_vs_eager_flex"] = {"max_abs_err": out_err, "ok": out_err <= 1e-4}
        out["max_logit_float32"] = {"cpu_attention": mx, "brute_force": ref, "rel_err": rel, "ok": rel <= 1e-5}
        out["note"] = "CPU form: Flex max_scores is CUDA-only in torch 2.14; CpuAttention is the CPU path"
        return out, out_err <= 1e-4 and rel <= 1e-5

    attn = LedgerFlexAttention(LedgerFlexAttention.Config())
    attn.train()
    for dtype in (torch.float32, torch.bfloat16):
        q = (torch.randn(B, L, N, H, device=dev) * 4).to(dtype).requires_grad_()
        k = (torch.randn(B, L, Nkv, H, device=dev) * 4).to(dtype).requires_grad_()
        v = torch.randn(B, L, Nkv, H, device=dev).to(dtype).requires_grad_()
        attn.record_max_logit = True
        attn(q, k, v, attention_masks=bm, enable_gqa=True).sum().backward()
        got = attn.take_max_logit(dev).item()
        ref = _max_scaled_score(q.transpose(1, 2), k.transpose(1, 2), dense, None).item()
        rel = abs(got - ref) / abs(ref)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        name = str(dtype).removeprefix("torch.")
        out[f"max_logit_{name}"] = {"flex": got, "eager": ref, "rel_err": rel, "ok": rel <= tol}
        ok &= rel <= tol
        # QK-clip's input: Flex's max_scores per head (amax over batch and rows)
        attn.per_head = True
        attn(q, k, v, attention_masks=bm, enable_gqa=True)
        heads = attn.take_max_logit(dev).float()
        attn.per_head = False
        ref_h = _max_scaled_score_per_head(q.transpose(1, 2), k.transpose(1, 2), dense, None).float()
        rel_h = ((heads - ref_h).abs() / ref_h.abs()).max().item() if heads.shape == ref_h.shape else float("inf")
        out[f"max_logit_per_head_{name}"] = {"heads": list(heads.shape), "max_rel_err": rel_h, "ok": rel_h <= tol}
        ok &= rel_h <= tol

        def fwd_bwd(record: bool) -> None:
            attn.record_max_logit = record
            attn(q, k, v, attention_masks=bm, enable_gqa=True).sum().backward()
            attn.take_max_logit(dev)

        fwd_bwd(False), fwd_bwd(True)  # compile both variants
        t_off = _timed_median(lambda: fwd_bwd(False), 30, True)
        t_on = _timed_median(lambda: fwd_bwd(True), 30, True)
        out[f"fwd_bwd_ms_{name}"] = {"without": t_off * 1e3, "with_max_scores": t_on * 1e3,
                                     "ratio": t_on / t_off}
    return out, bool(ok)


def main() -> int:
    from titan_ledger.rehearsal import backend

    device = backend.resolve(None)
    out, ok = run(device)
    out["ok"] = ok
    print(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
