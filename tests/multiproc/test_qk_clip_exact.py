"""QK-clip under FSDP2 / TP / PP / FSDP2xTP equals an unsharded implementation.

One step from the session's seed checkpoint at LR 0 (AdamW then leaves every weight
exactly as it was), so the only change between the seed and the step-1 checkpoint is
the clip. The reference runs the same global batch through one unsharded model,
takes each (layer, head)'s max attention logit with plain tensor math, and scales the
seed's ``wq`` / ``wk`` head rows itself (eta^alpha, eta^(1 - alpha), eta = threshold /
max); ``wv`` and every other weight must be unchanged. The threshold lies between two
heads' maxima, so some heads are clipped and others are not: a head offset (TP), a
layer index (PP), a DP maximum or a DTensor slice (FSDP2xTP's strided shards) that is
wrong shows up as a mismatch.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import CONFIGS, explain, first_batches, signals_ledger, torchrun, unsharded_model
from torchtitan.models.common.attention import GQAttention

from titan_ledger.components.signals.attention import CpuAttention, document_causal_mask

pytestmark = pytest.mark.slow

CASES = {  # toml, nproc, dp
    "FSDP2": ("debug_cpu.toml", 2, 2),
    "TP": ("debug_cpu_tp.toml", 2, 1),
    "PP": ("debug_cpu_pp.toml", 2, 1),
    "FSDP2xTP": ("debug_cpu_fsdp_tp.toml", 4, 2),
}
ALPHA = 0.3  # not 0.5, so a swapped q/k share shows


def _args(toml: str, seed, threshold: float | None = None) -> list[str]:
    args = ["--job.config_file", CONFIGS / toml, "--training.steps", "1", "--checkpoint.enable",
            "--checkpoint.interval", "1", "--checkpoint.initial_load_path", seed,
            "--optimizer.lr", "0", "--dataloader.num_workers", "0"]
    if threshold is not None:
        args += ["--qk_clip.enable", "--qk_clip.threshold", repr(threshold), "--qk_clip.alpha", str(ALPHA)]
    return [str(a) for a in args]


def _load(model, path) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(path))
    return {k: v.clone() for k, v in sd.items()}


def _head_maxima(toml: str, seed, dp: int):
    """``(config, model, seed state dict, [layers, heads] max logits)`` on the unsharded model."""
    config, model = unsharded_model(_args(toml, seed))
    sd = _load(model, seed)
    model.load_state_dict(sd)
    model.train()
    attn = [m for m in model.modules() if isinstance(m, CpuAttention)]
    for m in attn:
        m.record_max_logit = m.per_head = True
    rows = first_batches(config, dp)
    positions = torch.cat([r[2] for r in rows])
    with torch.no_grad():
        model(torch.cat([r[0] for r in rows]), positions=positions,
              attention_masks=document_causal_mask(positions))
    return config, model, sd, torch.stack([m.take_max_logit(torch.device("cpu")) for m in attn]).double()


@pytest.mark.parametrize("case", list(CASES))
def test_qk_clip_equals_unsharded_reference(runs, case, tmp_path):
    toml, nproc, dp = CASES[case]
    seed = runs.seed()
    config, model, before, hm = _head_maxima(toml, seed, dp)
    # a threshold in the widest gap between neighbouring maxima around the median
    v = hm.flatten().sort().values
    mid = len(v) // 2
    lo = max(range(mid - 8, mid + 8), key=lambda i: v[i + 1] - v[i])
    threshold = float((v[lo] + v[lo + 1]) / 2)
    proc = torchrun(_args(toml, seed, threshold) + ["--dump_folder", tmp_path], nproc=nproc)
    assert proc.returncode == 0, explain(proc)

    eta = torch.where(hm > threshold, threshold / hm, torch.ones_like(hm))  # MHA: a group is a head
    clipped = int((eta < 1).sum())
    assert 0 < clipped < eta.numel()
    row = signals_ledger(tmp_path).history[0]
    assert row["qk_clip_heads"] == clipped
    assert row["qk_clip_eta_min"] == pytest.approx(float(eta.min()), rel=1e-5)

    after = _load(model, tmp_path / "checkpoint" / "step-1")
    hd = config.model_spec.model.dim // next(iter(config.model_spec.model.traverse(GQAttention.Config)))[1].n_heads
    for k, w in before.items():
        want = w
        parts = k.split(".")
        if parts[0] == "layers" and parts[-2] in ("wq", "wk"):
            share = ALPHA if parts[-2] == "wq" else 1 - ALPHA
            rows = eta[int(parts[1])].pow(share).repeat_interleave(hd)
            want = (w.double() * rows[:, None]).to(w.dtype)
        assert torch.allclose(after[k], want, rtol=2e-6, atol=0), (case, k)
    scaled = [k for k in before if k.endswith("wq.weight") and not torch.equal(after[k], before[k])]
    assert scaled, "nothing was clipped"
