"""Signal math without processes: grouping, clipping, local sums, Flex max_scores."""

import math

import torch

from titan_ledger.components.signals.attention import CpuAttention, document_causal_mask
from titan_ledger.components.signals.sums import ParamPlan, clip_coef, layer_group, local_sums, snapshot, update_sq


def test_layer_group():
    assert layer_group("layers.3.attention.wo.weight") == "layers.3"
    assert layer_group("layers.12._checkpoint_wrapped_module.ffn.w1.weight") == "layers.12"
    assert layer_group("tok_embeddings.weight") == "tok_embeddings"
    assert layer_group("norm.weight") == "norm"


def test_clip_coef_matches_torch_clip():
    for total in (0.5, 1.0, 3.0):
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.full((4,), total / 2.0)  # norm == total
        torch.nn.utils.clip_grad_norm_([p], max_norm=1.0)
        got = (torch.tensor(total) * clip_coef(torch.tensor(total), 1.0)).item()
        assert math.isclose(got, p.grad.norm().item(), rel_tol=1e-6)


def test_local_sums_single_process():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    model[0].weight.grad[0, :] = 0.0
    plan = ParamPlan.build(model.named_parameters(), world_size=1, pp_degree=1)
    out = local_sums(plan, per_layer=True, device=torch.device("cpu"))
    grads = [p.grad for p in model.parameters()]
    assert out["num_zeros"].item() == sum(int((g == 0).sum()) for g in grads)
    assert math.isclose(out["param_sq"].item(), sum(p.detach().square().sum().item() for p in model.parameters()),
                        rel_tol=1e-6)
    assert plan.groups == ["0", "1"]
    assert torch.allclose(out["grad_sq"], torch.tensor([
        sum(g.square().sum() for g in grads[:2]), sum(g.square().sum() for g in grads[2:])]))


def test_update_norm_is_the_norm_of_what_the_optimizer_applied():
    """SGD moves every parameter by lr x grad: the update norm is lr x the grad norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    plan = ParamPlan.build(model.named_parameters(), world_size=1, pp_degree=1)
    gn = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters()))
    before = snapshot(plan)
    torch.optim.SGD(model.parameters(), lr=0.25).step()
    assert math.isclose(update_sq(plan, before, torch.device("cpu")).sqrt().item(), 0.25 * gn.item(), rel_tol=1e-6)
    assert update_sq(plan, snapshot(plan), torch.device("cpu")).item() == 0.0  # nothing moved since
    # AdamW's first step moves each element by lr x sign(grad) (plus the decay): not lr x the grad norm
    model.zero_grad()
    model(torch.randn(5, 3)).sum().backward()
    before = snapshot(plan)
    torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0).step()
    n = sum(int((p.grad != 0).sum()) for p in model.parameters())
    assert math.isclose(update_sq(plan, before, torch.device("cpu")).sqrt().item(), 1e-2 * math.sqrt(n), rel_tol=1e-4)


def test_tied_weights_count_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"tok_embeddings": emb, "lm_head": head})
    plan = ParamPlan.build(model.named_parameters(remove_duplicate=False), world_size=1, pp_degree=1)
    assert len(plan.params) == 1


def test_cpu_max_logit_is_the_max_allowed_score():
    """Brute force over (batch, head, query, key) pairs the document-causal mask allows.

    (Flex's own ``max_scores`` is CUDA-only in torch 2.14 -- "Returning max scores is
    not supported on CPU" -- so the GPU path has its own device check script.)
    """
    torch.manual_seed(3)
    B, L, N, Nkv, H = 2, 24, 4, 2, 8
    positions = torch.tensor([list(range(10)) + list(range(9)) + list(range(5)), list(range(24))])
    q, k, v = torch.randn(B, L, N, H) * 3, torch.randn(B, L, Nkv, H) * 3, torch.randn(B, L, Nkv, H)
    attn = CpuAttention(CpuAttention.Config())
    attn.record_max_logit = True
    attn(q, k, v, attention_masks=document_causal_mask(positions), enable_gqa=True)
    ours = attn.take_max_logit(torch.device("cpu")).item()
    best = float("-inf")
    for b in range(B):
        starts = [i for i in range(L) if positions[b, i] == 0]
        doc = [max(s for s in starts if s <= i) for i in range(L)]
        for h in range(N):
            for i in range(L):
                for j in range(i + 1):
                    if doc[j] == doc[i]:
                        best = max(best, float(q[b, i, h] @ k[b, j, h // (N // Nkv)]) / H**0.5)
    assert math.isclose(ours, best, rel_tol=1e-5)
    assert attn.take_max_logit(torch.device("cpu")).item() == float("-inf")  # reset


def test_eval_mode_calls_are_not_recorded():
    """Validation runs the model in eval mode between steps; it is not a train signal."""
    x = torch.randn(1, 8, 2, 4)
    mask = document_causal_mask(torch.arange(8).unsqueeze(0))
    attn = CpuAttention(CpuAttention.Config())
    attn.record_max_logit = True
    attn.eval()
    attn(x, x, x, attention_masks=mask)
    assert attn.take_max_logit(torch.device("cpu")).item() == float("-inf")
    attn.train()
    attn(x, x, x, attention_masks=mask)
    assert attn.take_max_logit(torch.device("cpu")).item() > float("-inf")
