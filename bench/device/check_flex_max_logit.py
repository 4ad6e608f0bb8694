"""GPU check (prepared for a lent H200; ~2 device-minutes): Flex max logit and ledger syncs.

    python bench/device/check_flex_max_logit.py            # needs CUDA

1. ``LedgerFlexAttention`` (torchtitan's compiled FlexAttention asking for
   ``AuxRequest(max_scores=True)``) gives the same max logit as an eager dense
   reference, in fp32 and bf16, with the block-causal packed-document mask.
2. Forward+backward time of Flex with and without ``max_scores`` (median of 50).
3. ``Ledger.record``'s device work under ``torch.cuda.set_sync_debug_mode("error")``:
   any blocking device->host synchronisation raises.
Prints one JSON object; exit code 1 if a check fails.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TITAN_LEDGER_DEVICE", "cuda")

import torch  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from titan_ledger import backend

    backend.install("cuda")
    from torch.nn.attention.flex_attention import and_masks, create_block_mask
    from torchtitan.models.common.attention import (
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    from titan_ledger.attention import LedgerFlexAttention, _max_scaled_score, document_causal_mask

    dev = torch.device("cuda")
    torch.manual_seed(0)
    B, L, N, Nkv, H = 2, 2048, 16, 4, 128
    lens = [700, 500, 848]
    positions = torch.cat([torch.arange(n) for n in lens]).repeat(B, 1).to(dev)
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    bm = create_block_mask(mask_mod, B, None, L, L, device="cuda")
    dense = document_causal_mask(positions)
    out: dict = {"device": torch.cuda.get_device_name()}
    ok = True
    attn = LedgerFlexAttention(LedgerFlexAttention.Config())
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
        out[f"max_logit_{dtype}"] = {"flex": got, "eager": ref, "rel_err": rel, "ok": rel <= tol}
        ok &= rel <= tol

        def timed(record: bool) -> float:
            attn.record_max_logit = record
            ts = []
            for _ in range(50):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                attn(q, k, v, attention_masks=bm, enable_gqa=True).sum().backward()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            return sorted(ts[5:])[len(ts[5:]) // 2]

        timed(False), timed(True)  # compile both variants
        t_off, t_on = timed(False), timed(True)
        out[f"fwd_bwd_ms_{dtype}"] = {"without": t_off * 1e3, "with_max_scores": t_on * 1e3,
                                       "ratio": t_on / t_off}

    # 3. the ledger's per-step device work adds no blocking sync
    from titan_ledger.ledger import Ledger
    from titan_ledger.signals import ParamPlan

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).to(dev)
    model(torch.randn(32, 256, device=dev)).sum().backward()
    led = Ledger(Ledger.Config())
    led.enabled, led.device, led.world, led.rank, led.dp_size, led.dp_rank = True, dev, 1, 0, 1, 0
    led.max_norm, led.owns_loss, led.owns_tokens, led.global_batch, led._cuda = 1.0, True, True, 32, True
    led.plan = ParamPlan.build(model.named_parameters(), 1, 1)
    led.plan.group_index = led.plan.group_index.to(dev)
    led._attn, led._consumed_tokens = [attn], torch.zeros((), dtype=torch.float64, device=dev)
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        led.record(step=1, local_loss_sum=torch.ones((), device=dev), local_tokens=torch.ones((), device=dev),
                   grad_norm=gn, lr=1e-3, step_start=time.perf_counter(), data_loading_s=0.0)
        out["ledger_record_sync_free"] = True
    except RuntimeError as e:
        out["ledger_record_sync_free"] = False
        out["ledger_record_sync_error"] = str(e)[:300]
        ok = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
