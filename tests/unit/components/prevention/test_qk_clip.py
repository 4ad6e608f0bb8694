"""QK-clip in this process: the factors (per query group, the q/k split), the row layout
of torchtitan's fused and separate projections, the per-head max the CPU attention
records, the binding to a built debug model, its config errors and the rerun variant."""

from __future__ import annotations

import math

import pytest
import torch

from titan_ledger.components.prevention.qk_clip import QKClip, QKClipConfig, clip_stats, group_eta, row_scales
from titan_ledger.components.signals.attention import (
    _max_scaled_score,
    _max_scaled_score_per_head,
    document_causal_mask,
)
from titan_ledger.config.toml_frontend import parse, read_job
from titan_ledger.errors import ConfigError


def test_eta_is_threshold_over_the_group_max_and_one_below_or_unseen():
    hm = torch.tensor([[50.0, 150.0, 90.0, 400.0], [float("-inf"), 10.0, 100.0, 100.0]], dtype=torch.float64)
    assert group_eta(hm, 100.0, 1).flatten().tolist() == pytest.approx([1.0, 100 / 150, 1.0, 0.25, 1, 1, 1, 1])
    # GQA, two query heads a group: the group's max decides (Megatron's rule)
    assert group_eta(hm, 100.0, 2).flatten().tolist() == pytest.approx([100 / 150, 0.25, 1.0, 1.0])
    heads, eta_min = clip_stats(group_eta(hm, 100.0, 2), 2).tolist()
    assert heads == 4 and eta_min == 0.25
    assert clip_stats(group_eta(hm[1:], 100.0, 1), 1).tolist() == [0.0, 1.0]


def test_logits_scale_by_eta_whatever_alpha():
    torch.manual_seed(0)
    q, k = torch.randn(3, 4), torch.randn(5, 4)  # one head's q and k rows' outputs
    for alpha in (0.0, 0.3, 0.5, 1.0):
        eta = torch.tensor([0.4], dtype=torch.float64)
        sq, sk = row_scales(eta, 1, 4, alpha, fused=False)
        got = (q * sq.float()) @ (k * sk.float()).T
        assert torch.allclose(got, 0.4 * (q @ k.T), rtol=1e-6)


def test_fused_rows_match_torchtitan_split_layout():
    """Scaling ``wqkv`` with the fused vector equals scaling the ``wq``/``wk`` that
    torchtitan's own checkpoint hook splits it into; ``wv`` is untouched."""
    from titan_ledger.rehearsal import backend

    backend.ensure_installed()
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.common.linear import Linear

    hd, n_heads, n_kv = 3, 4, 2
    mod = FusedQKVLinear.Config(head_dim=hd, n_heads=n_heads, n_kv_heads=n_kv,
                                wqkv=Linear.Config(in_features=5, out_features=n_kv * (n_heads // n_kv + 2) * hd)).build()
    torch.manual_seed(1)
    with torch.no_grad():
        mod.wqkv.weight.copy_(torch.randn_like(mod.wqkv.weight))
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    eta = torch.tensor([0.5, 0.8], dtype=torch.float64)
    (fused,) = row_scales(eta, n_heads // n_kv, hd, 0.3, fused=True)
    with torch.no_grad():
        mod.wqkv.weight.mul_(fused.float()[:, None])
    after = mod.state_dict()
    sq, sk = row_scales(eta, n_heads // n_kv, hd, 0.3, fused=False)
    assert torch.allclose(after["wq.weight"], before["wq.weight"] * sq.float()[:, None])
    assert torch.allclose(after["wk.weight"], before["wk.weight"] * sk.float()[:, None])
    assert torch.equal(after["wv.weight"], before["wv.weight"])
    # head h of wq belongs to group h // 2: its rows carry that group's eta^alpha
    assert sq.view(n_heads, hd)[:, 0].tolist() == pytest.approx([0.5 ** 0.3] * 2 + [0.8 ** 0.3] * 2)


def test_cpu_attention_per_head_max_is_the_masked_max_of_each_head():
    torch.manual_seed(2)
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)  # GQA: 4 query heads, 2 kv heads
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    mask = document_causal_mask(positions)
    per_head = _max_scaled_score_per_head(q, k, mask, None)
    kk = k.repeat_interleave(2, dim=1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(8)
    want = s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    assert torch.allclose(per_head, want, rtol=1e-6)
    assert torch.allclose(per_head.amax(), _max_scaled_score(q, k, mask, None), rtol=1e-6)


def _config(*flags: str):
    return parse(read_job(["--job.config_file", "train_configs/debug_cpu.toml", *flags]))


def _model(config):
    from titan_ledger.components.signals import attention

    attention.adapt_config(config)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    with torch.no_grad():
        model.init_weights()
    return model


def test_qk_clip_binds_every_layer_and_scales_the_heads_over_the_threshold():
    config = _config("--qk_clip.enable", "--qk_clip.threshold", "2.5", "--qk_clip.alpha", "0.5")
    assert config.qk_clip.enable and config.qk_clip.threshold == 2.5
    model = _model(config)
    clip = QKClip(config.qk_clip, [model], n_layers=6, tp_rank=0, tp_size=1)
    assert [layer.index for layer in clip.layers] == list(range(6)) and clip.size == 6 * 16
    assert all(layer.inner.per_head for layer in clip.layers)
    # this rank's maxima at their slots (layer 4 saw no call: its slots stay -inf)
    taken = [(layer.inner, torch.full((16,), 1.0) if layer.index != 4 else torch.tensor(float("-inf")))
             for layer in clip.layers]
    taken[2] = (clip.layers[2].inner, torch.arange(16, dtype=torch.float32) * 0.25)  # heads 11-15 > 2.5
    loc = torch.zeros(clip.size, dtype=torch.float64)
    clip.place(loc, taken)
    assert torch.isinf(loc[4 * 16:5 * 16]).all()
    heads, eta_min = clip.reduce(loc[None]).tolist()
    assert heads == 5 and eta_min == pytest.approx(2.5 / 3.75)
    w = clip.layers[2].params[0][0]
    before = w.detach().clone()
    others = {n: p.detach().clone() for n, p in model.named_parameters() if p is not w}
    clip.apply()
    hd = 256 // 16
    rows = torch.ones(16)
    rows[11:] = (2.5 / (torch.arange(11, 16) * 0.25)).sqrt()
    # fused rows: [q head h (hd rows), k head h (hd rows), v head h (hd rows)] per group (MHA)
    want = before.view(16, 3, hd, -1).clone()
    want[:, 0] *= rows[:, None, None]
    want[:, 1] *= rows[:, None, None]
    assert torch.allclose(w.detach(), want.view_as(before), rtol=1e-6)
    assert all(torch.equal(p.detach(), others[n]) for n, p in model.named_parameters() if p is not w)
    assert clip.head_max is None  # applied once


def test_qk_clip_config_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--qk_clip.threshold"):
        QKClipConfig(threshold=0)
    with pytest.raises(ConfigError, match="--qk_clip.alpha"):
        QKClipConfig(alpha=1.5)
    config = _config("--qk_clip.enable", "--model.qk_norm")
    from titan_ledger.components.prevention.qk_norm import apply_qk_norm

    apply_qk_norm(config.model_spec.model)
    with pytest.raises(ConfigError, match="--model.qk_norm"):
        QKClip(config.qk_clip, [_model(config)], n_layers=6, tp_rank=0, tp_size=1)


def test_qk_clip_rerun_variant():
    from titan_ledger.tools.rerun.variants import CAUSE_OF, Variant, ledger_values, parse_variant, variant_args

    assert parse_variant("qk_clip=50") == Variant("qk_clip", 50.0)
    assert parse_variant("qk_clip", allow_open=True) == Variant("qk_clip")
    assert CAUSE_OF["qk_clip"] == "logit_growth"
    rows = [{"step": 9, "max_logit": 240.0}, {"step": 10, "max_logit": 30.0}]
    assert ledger_values(Variant("qk_clip"), rows, 9) == Variant("qk_clip", 120.0)
    assert ledger_values(Variant("qk_clip"), rows, 10) == Variant("qk_clip", 0.0)  # no growth: not applicable
    config = _config()
    assert variant_args(Variant("qk_clip", 120.0), 9, config) == (
        ["--qk_clip.enable", "--qk_clip.threshold", "120"], {})
    assert variant_args(Variant("qk_clip", 0.0), 9, config) is None
    assert variant_args(Variant("qk_clip", 120.0), 9, _config("--model.qk_norm")) is None
    assert variant_args(Variant("qk_clip", 120.0), 9, _config("--qk_clip.enable")) is None
