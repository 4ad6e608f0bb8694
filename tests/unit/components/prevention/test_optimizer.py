"""Weight-decay presets on torchtitan's parameter groups (design article §3.4), in this
process: which parameters each preset exempts, the groups' kwargs, and that a checkpoint
written without the split resumes into the split (and back)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchtitan.components.optimizer import ParamGroupConfig

from titan_ledger.components.prevention.optimizer import LedgerOptimizers, describe_groups
from titan_ledger.errors import ConfigError


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.norm = nn.RMSNorm(8)
        self.proj = nn.Linear(8, 8, bias=True)
        self.output = nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.output(self.proj(self.norm(self.tok_embeddings(x))))


def _build(preset: str, model: nn.Module, **kw) -> LedgerOptimizers:
    cfg = LedgerOptimizers.Config(
        no_decay=preset, implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=r"^output\.", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.2, **kw}),
                      ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 2e-3, "weight_decay": 0.1, **kw})])
    return cfg.build(model_parts=[model])


def _decay(opt) -> dict[str, float]:
    return {n: g["weight_decay"] for o in opt.optimizers for g in o.param_groups for n in g["param_names"]}


@pytest.mark.parametrize("preset, exempt", [
    ("none", set()),
    ("megatron", {"norm.weight", "proj.bias"}),
    ("olmo2", {"norm.weight", "proj.bias", "tok_embeddings.weight"}),
])
def test_each_preset_exempts_its_parameters_and_keeps_the_groups_kwargs(preset, exempt):
    opt = _build(preset, Tiny())
    decay = _decay(opt)
    assert set(decay) == {"tok_embeddings.weight", "norm.weight", "proj.weight", "proj.bias", "output.weight"}
    assert {n for n, wd in decay.items() if wd == 0.0} == exempt
    assert decay["output.weight"] == 0.2 and decay["proj.weight"] == 0.1  # first match wins, as torchtitan
    lrs = {n: g["lr"] for o in opt.optimizers for g in o.param_groups for n in g["param_names"]}
    assert lrs["output.weight"] == 1e-3 and all(lrs[n] == 2e-3 for n in exempt)  # the group's other kwargs
    groups = describe_groups(opt)
    assert sum(g["params"] for g in groups) == 5 and len(groups) == (2 if preset == "none" else 3)
    assert sum(g["numel"] for g in groups if g["weight_decay"] == 0.0) == sum(
        p.numel() for n, p in Tiny().named_parameters() if n in exempt)


def test_a_checkpoint_without_the_split_resumes_into_it_and_back():
    torch.manual_seed(0)
    a = Tiny()
    opt = _build("none", a)
    a(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    b = Tiny()
    b.load_state_dict(a.state_dict())
    split = _build("olmo2", b)
    split.load_state_dict(sd)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        sa, sb = opt.optimizers[0].state[pa], split.optimizers[0].state[pb]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]), na
    assert _decay(split)["norm.weight"] == 0.0  # the preset's decay, not the checkpoint's
    back = _build("none", Tiny())
    back.load_state_dict(split.state_dict())
    assert _decay(back)["norm.weight"] == 0.1


def test_a_resume_with_another_epsilon_or_betas_trains_with_the_launchs_not_the_checkpoints():
    """A fix relaunched from a checkpoint (issue 67: ``--optimizer.eps 1e-6`` from step-360)
    must train with it: torchtitan's load restored every group's epsilon and betas from the
    checkpoint, and the relaunch trained bit for bit as the run it was to fix. The moments
    and the step count are the checkpoint's."""
    torch.manual_seed(0)
    a = Tiny()
    opt = _build("none", a, eps=1e-8, betas=(0.9, 0.999))
    a(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    b = Tiny()
    b.load_state_dict(a.state_dict())
    fixed = _build("none", b, eps=1e-6, betas=(0.9, 0.95))
    fixed.load_state_dict(opt.state_dict())
    groups = fixed.optimizers[0].param_groups
    assert all(g["eps"] == 1e-6 and tuple(g["betas"]) == (0.9, 0.95) for g in groups), groups
    pa, pb = next(a.parameters()), next(b.parameters())
    assert torch.equal(opt.optimizers[0].state[pa]["exp_avg_sq"], fixed.optimizers[0].state[pb]["exp_avg_sq"])
    assert float(fixed.optimizers[0].state[pb]["step"]) == 1.0


def test_an_unknown_preset_names_the_flag():
    with pytest.raises(ConfigError, match="--optimizer.no_decay 'olmo'"):
        LedgerOptimizers.Config(no_decay="olmo")


def test_scale_lr_sets_a_total_factor_that_repeated_checkpoint_loads_do_not_compound():
    """The recovery ladder's ``rollback_lr`` keeps the product of its factors and scales
    after every checkpoint load; torchtitan's load keeps the schedulers' base LRs, so a
    scale that multiplied them again would compound (0.5, then 0.5 x 0.5 on a base
    already halved: 0.125 instead of 0.25)."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from titan_ledger.components.prevention.optimizer import scale_lr

    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheds = LRSchedulersContainer([opt], lambda step: min(1.0, (step + 1) / 10))
    for _ in range(4):
        opt.step()
        scheds.step()
    saved = scheds.state_dict()
    full = opt.param_groups[0]["lr"]
    assert full == pytest.approx(1e-2 * 5 / 10)
    scale_lr(scheds, 0.5)  # the first rollback_lr rung
    assert opt.param_groups[0]["lr"] == pytest.approx(full * 0.5)
    for _ in range(3):
        opt.step()
        scheds.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 8 / 10 * 0.5)
    scheds.load_state_dict(saved)  # a later rollback loads the checkpoint again ...
    scale_lr(scheds, 0.5 * 0.5)  # ... and a second rung's factor joins the first
    assert opt.param_groups[0]["lr"] == pytest.approx(full * 0.25)
    assert scheds.schedulers[0].get_last_lr()[0] == pytest.approx(full * 0.25)
    opt.step()
    scheds.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 6 / 10 * 0.25)
