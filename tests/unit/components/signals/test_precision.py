"""The precision audit (design article §3.5) on live modules in this process: each check
passes on an fp32 model and fails where the object says otherwise (bf16 master weights,
bf16 moments after a step, a norm that accumulates in bf16, a non-float32 loss, float8 in
the first block and the head)."""

from __future__ import annotations

import torch
from torch import nn

from titan_ledger.components.signals import precision


class Block(nn.Module):
    def __init__(self, d: int, norm: nn.Module | None = None):
        super().__init__()
        self.norm = norm or nn.RMSNorm(d, eps=1e-6)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


class Model(nn.Module):
    def __init__(self, d: int = 64, n: int = 3, norm_cls=None):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(d, norm_cls(d) if norm_cls else None) for i in range(n)})
        self.output = nn.Linear(d, 8, bias=False)


class Bf16AccumulatingRMSNorm(nn.Module):
    """RMSNorm whose sum of squares accumulates element by element in bfloat16."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        acc = torch.zeros(x.shape[:-1], dtype=x.dtype)
        for i in range(x.shape[-1]):
            acc = acc + x[..., i] * x[..., i]
        return x * torch.rsqrt(acc / x.shape[-1] + self.eps)[..., None] * self.weight.to(x.dtype)


class CpuAttention(nn.Module):  # named as titan_ledger's: the audit reads the module kind
    pass


def _loss():
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss(CrossEntropyLoss.Config())


def _by_check(rows):
    return {r["check"]: r for r in rows}


def test_an_fp32_model_passes_every_check():
    m = Model()
    m.attn = CpuAttention()
    opt = torch.optim.AdamW(m.parameters())
    rows = _by_check(precision.audit([m], opt, _loss()))
    for check in ("master weights", "Adam moments", "gradient reduction", "attention softmax / accumulation",
                  "logits into the loss", "norm statistics"):
        assert rows[check]["ok"] is True, rows[check]
    assert rows["compute dtype"]["found"] == "float32" and rows["compute dtype"]["ok"] is None
    assert "float8 GEMMs" not in rows and precision.deviations(list(rows.values())) == []
    assert "created like the parameters" in rows["Adam moments"]["how"]
    assert "master weights" in precision.table(list(rows.values()))


def test_bf16_weights_and_moments_a_bf16_norm_and_another_loss_are_deviations():
    # (at width 256 a bf16 running sum of squares near 30^2 stagnates: each term is
    # under the sum's rounding step)
    m = Model(d=256, norm_cls=Bf16AccumulatingRMSNorm).to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters())
    m.output(m.layers["0"](torch.randn(2, 256, dtype=torch.bfloat16))).sum().backward()
    opt.step()  # the moments exist now: read, not inferred
    rows = _by_check(precision.audit([m], opt, nn.MSELoss()))
    assert rows["master weights"]["ok"] is False and rows["master weights"]["found"] == "bfloat16"
    assert rows["Adam moments"]["ok"] is False and rows["Adam moments"]["how"] == "exp_avg / exp_avg_sq"
    assert rows["norm statistics"]["ok"] is False, rows["norm statistics"]
    assert rows["logits into the loss"]["ok"] is False and rows["logits into the loss"]["found"] == "MSELoss"
    assert rows["attention softmax / accumulation"]["ok"] is False  # no attention module found
    bad = {r["check"] for r in precision.deviations(list(rows.values()))}
    assert {"master weights", "Adam moments", "norm statistics", "logits into the loss"} <= bad
    # moments that a step pre-hook will create in bf16 (torchtitan's fused_opt_states_bf16)
    m32 = Model()
    opt32 = torch.optim.AdamW(m32.parameters())

    def _bf16_state_init_hook(optimizer, args, kwargs):
        return None

    opt32.register_step_pre_hook(_bf16_state_init_hook)
    row = _by_check(precision.audit([m32], opt32, _loss()))["Adam moments"]
    assert row["ok"] is False and row["found"] == "bfloat16" and "pre-hook" in row["how"]
    # the probe itself: torch's RMSNorm in bf16 keeps float32 statistics
    ok, err = precision.norm_accumulates_in_fp32(nn.RMSNorm(256, eps=1e-6).to(torch.bfloat16), 256,
                                                 torch.bfloat16, "cpu")
    assert ok and err <= 4


def test_float8_in_the_first_block_or_the_head_is_a_deviation():
    class Float8Linear(nn.Linear):  # named as torchao's
        pass

    m = Model(n=4)
    m.layers["1"].proj = Float8Linear(64, 64, bias=False)
    m.layers["2"].proj = Float8Linear(64, 64, bias=False)
    opt = torch.optim.AdamW(m.parameters())
    row = _by_check(precision.audit([m], opt, _loss(), n_layers=4))["float8 GEMMs"]
    assert row["ok"] is True and row["found"] == "2 float8 linears"
    m.layers["0"].proj = Float8Linear(64, 64, bias=False)
    m.output = Float8Linear(64, 8, bias=False)
    row = _by_check(precision.audit([m], opt, _loss(), n_layers=4))["float8 GEMMs"]
    assert row["ok"] is False and "2 at the edge" in row["found"], row
    # a PP stage holding blocks 1-2 of 4: block 1 is not an edge of the model
    stage = Model(n=4)
    del stage.layers["0"], stage.layers["3"]
    stage.layers["1"].proj = Float8Linear(64, 64, bias=False)
    del stage.output
    row = _by_check(precision.audit([stage], torch.optim.AdamW(stage.parameters()), _loss(), n_layers=4))
    assert row["float8 GEMMs"]["ok"] is True
