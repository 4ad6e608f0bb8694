"""Prevention switches on the model config, in this process: ``[model] qk_norm`` gives
every llama3 attention torchtitan's per-head RMSNorm (with its TP sharding declaration),
and the built model normalizes q and k per head before the attention."""

from __future__ import annotations

import torch

from titan_ledger.components.prevention.qk_norm import apply_qk_norm
from titan_ledger.config.toml_frontend import parse, read_job


def _config(*flags: str):
    return parse(read_job(["--job.config_file", "train_configs/debug_cpu.toml", *flags]))


def test_qk_norm_flag_reaches_every_attention_with_its_tp_sharding():
    config = _config("--model.qk_norm")
    assert config.model.qk_norm is True
    assert _config().model.qk_norm is False
    model_cfg = config.model_spec.model
    n = apply_qk_norm(model_cfg)
    assert n == len(model_cfg.layers) == 6
    assert apply_qk_norm(model_cfg) == 0  # idempotent: an attention that has one keeps it
    for layer in model_cfg.layers:
        norm = layer.attention.qk_norm
        head_dim = layer.attention.dim // layer.attention.n_heads
        assert norm.normalized_shape == head_dim
        # the Qwen3 declaration: weight replicated over TP, activations sharded on heads
        assert set(norm.sharding_config.state_shardings) == {"weight"}
        assert norm.sharding_config.in_src_shardings is not None


def test_qk_norm_normalizes_each_head_of_q_and_k_before_attention():
    config = _config("--model.qk_norm")
    from titan_ledger.components.signals import attention

    attention.adapt_config(config)
    apply_qk_norm(config.model_spec.model)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    attn = model.layers["0"].attention
    assert attn.q_norm is not None and attn.k_norm is not None
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.attention.q_norm.weight", "layers.0.attention.k_norm.weight"} <= names
    seen = {}

    def keep(module, args, out):  # a hook that returns None leaves the output alone
        seen["q"] = (args[0], out)

    attn.q_norm.register_forward_hook(keep)
    tokens = torch.randint(0, 2048, (1, 16))
    positions = torch.arange(16).unsqueeze(0)
    from titan_ledger.components.signals.attention import document_causal_mask

    model(tokens, attention_masks=document_causal_mask(positions), positions=positions)
    q_in, q_out = seen["q"]
    # per head (last dim = head_dim): unit RMS after the norm (weight initialized to ones)
    assert q_in.shape[-1] == 256 // 16 and q_out.shape == q_in.shape
    rms = q_out.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=0)
    assert not torch.allclose(q_in.pow(2).mean(-1).sqrt(), torch.ones_like(rms), atol=1e-2)
