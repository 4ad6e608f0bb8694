"""Every signal under FSDP2 / TP / PP / FSDP2xTP equals an unsharded single-process model.

Both sides start from one seed checkpoint (DCP, resharded on load) and see the same
rows: the reference rebuilds each DP rank's first batch with the run's own
dataloader config. The run is step 1 of the session's straight run of each
parallelism (``runs.straight``, conftest.py: text or indexed data, 0 or 2 workers). The reference computes its signals with plain tensor math on the
unsharded model -- no titan_ledger reduction code -- so placement, ownership
(TP-replicated norms), PP-stage and DP-rank bugs all show up as a mismatch.
"""

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import PARALLELISMS
from helpers import data_rows, first_batches, rank_losses, signal_keys, signals_ledger, unsharded_model

from titan_ledger.components.signals.attention import CpuAttention, document_causal_mask
from titan_ledger.components.signals.sums import layer_group
from titan_ledger.data.layout import distinct_documents
from titan_ledger.format.data_reader import DataLedger

pytestmark = pytest.mark.slow


#: elements a float cancellation may make exactly zero on one side only (see the test)
NUM_ZEROS_SLACK = 2


def reference(args: list[str], seed_path, dp: int, lr: float) -> dict:
    """Signals of step 1 computed on one unsharded model over the global batch."""
    from torchtitan.components.loss import IGNORE_INDEX

    config, model = unsharded_model(args)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(seed_path))
    model.load_state_dict(sd)
    model.train()
    attn = [m for m in model.modules() if isinstance(m, CpuAttention)]
    for m in attn:
        m.record_max_logit = True

    rows = first_batches(config, dp)  # per DP rank: (input, labels, positions)
    inputs = torch.cat([r[0] for r in rows])
    labels = torch.cat([r[1] for r in rows])
    positions = torch.cat([r[2] for r in rows])
    logits = model(inputs, positions=positions, attention_masks=document_causal_mask(positions))
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                           reduction="none", ignore_index=IGNORE_INDEX).view(labels.shape)
    valid = (labels != IGNORE_INDEX)
    # log Z per token, and the z-loss (--loss.z_loss_weight) the run added to its objective
    lse = torch.logsumexp(logits.float(), dim=-1)
    w = getattr(config.loss, "z_loss_weight", 0.0)
    objective = ce + w * torch.where(valid, lse.square(), 0.0)
    # per DP rank, per (row within the rank's step, document segment): loss sum and tokens
    seg = torch.cumsum((positions == 0).long(), dim=1) - 1
    doc_sums: list[dict] = []
    start = 0
    for r in rows:
        d = {}
        for i in range(r[1].shape[0]):
            g = start + i
            for sg in seg[g].unique().tolist():
                m = seg[g] == sg
                d[(i, sg)] = (float(ce[g][m].detach().double().sum()), int(valid[g][m].sum()))
        doc_sums.append(d)
        start += r[1].shape[0]
    per_rank = objective.split([r[1].shape[0] for r in rows])
    per_rank_tok = valid.split([r[1].shape[0] for r in rows])
    local_avg = [(c.sum() / t.sum()).item() for c, t in zip(per_rank, per_rank_tok)]
    tokens = int(valid.sum())
    (objective.sum() / tokens).backward()
    lse_valid = lse[valid].detach().double()

    params = dict(model.named_parameters())
    grad_sq = sum(p.grad.double().square().sum() for p in params.values())
    per_layer: dict[str, float] = {}
    for n, p in params.items():
        per_layer[layer_group(n)] = per_layer.get(layer_group(n), 0.0) + p.grad.double().square().sum().item()
    gn = math.sqrt(grad_sq)
    max_norm = config.training.max_norm
    # the update AdamW applies to the clipped gradients (--ledger.update_norm)
    before = {n: p.detach().clone() for n, p in params.items()}
    torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    kw = dict(config.optimizer.param_groups[0].optimizer_kwargs)
    kw["lr"] = lr
    torch.optim.AdamW(list(params.values()), **kw).step()
    update = math.sqrt(sum((p.detach().double() - before[n].double()).square().sum() for n, p in params.items()))
    return {
        "consumed_samples": inputs.shape[0],
        "consumed_tokens": tokens,
        "loss": (objective.sum() / tokens).item(),
        "z_loss": float(lse_valid.square().mean()),
        "logz_mean": float(lse_valid.mean()),
        "logz_max": float(lse_valid.max()),
        "loss_max": max(local_avg),
        "loss_max_rank": max(range(dp), key=lambda i: local_avg[i]),
        "grad_norm": gn,
        "grad_norm_clipped": gn * min(1.0, max_norm / (gn + 1e-6)),
        "num_zeros": int(sum((p.grad == 0).sum() for p in params.values())),
        "param_norm": math.sqrt(sum(before[n].double().square().sum() for n in params)),
        "update_norm": update,
        "max_logit": max(m.take_max_logit(torch.device("cpu")).item() for m in attn),
        "grad_norm_per_layer": {k: math.sqrt(v) for k, v in per_layer.items()},
        "doc_sums": doc_sums,
        "param_names": set(params),
    }


@pytest.mark.parametrize("case", list(PARALLELISMS))
def test_signals_equal_unsharded_reference(runs, case):
    dump = runs.straight(case)
    ledger = signals_ledger(dump)
    assert ledger.torn_lines == 0 and [r["step"] for r in ledger.history] == list(range(1, 7))
    row = ledger.history[0]
    assert set(row) == set(signal_keys()) | {"grad_norm_per_layer"}
    ref = reference(runs.args(case), runs.seed(PARALLELISMS[case].qk_norm), PARALLELISMS[case].dp, row["lr"])
    if PARALLELISMS[case].qk_norm:  # the run's model had the norms (and the reference too)
        assert "layers.0.attention.q_norm.weight" in ref["param_names"]
    for key in ("consumed_samples", "consumed_tokens", "loss_max_rank"):
        assert row[key] == ref[key], (key, row[key], ref[key])
    # num_zeros counts gradient elements that are exactly 0.0: the structural zeros (rows of
    # tokens no batch holds, masked positions) are the same in any layout, but an element
    # whose terms cancel can be exactly 0.0 in one reduction order and ~1e-10 in another.
    # Fresh-clone CI at e7a10f5 saw FSDP2xTP at 427,776 against the reference's 427,777 (also seen
    # at 128-token rows, 2026-12-02), so the count is equal up to NUM_ZEROS_SLACK elements.
    assert abs(row["num_zeros"] - ref["num_zeros"]) <= NUM_ZEROS_SLACK, (row["num_zeros"], ref["num_zeros"])
    for key in ("loss", "loss_max", "grad_norm", "grad_norm_clipped", "param_norm", "update_norm", "max_logit",
                "z_loss", "logz_mean", "logz_max"):
        assert row[key] == pytest.approx(ref[key], rel=1e-4), (key, row[key], ref[key])
    assert row["grad_norm_per_layer"] == pytest.approx(ref["grad_norm_per_layer"], rel=1e-4)
    assert row["skipped"] is False and row["step"] == 1
    # the per-rank files hold each DP rank's local loss
    assert max(rank_losses(dump, 1)) == pytest.approx(ref["loss_max"], rel=1e-4)
    # per-document losses: every segment each DP rank ranked at step 1 equals the
    # unsharded recomputation (computed where the loss is: TP ranks, the last PP stage)
    for r in range(PARALLELISMS[case].dp):
        dl = data_rows(dump, r)[1]["doc_loss"]
        entries = dl["top"] + dl["bottom"]
        assert entries and dl["n"] == len(ref["doc_sums"][r])
        # the distinct documents rank separation reads: the host's count from the sample ids,
        # carried by the rank that owns the loss (a TP rank, the last PP stage)
        tags = DataLedger(dump / "ledger").at(1, r).tags  # explicit rows, or derived (indexed)
        assert dl["docs"] == distinct_documents(tags, 16) >= 1
        for row, sg, loss_sum, tokens in entries:
            want_sum, want_tokens = ref["doc_sums"][r][(row, sg)]
            assert tokens == want_tokens, (r, row, sg)
            assert loss_sum == pytest.approx(want_sum, rel=1e-4, abs=1e-3), (r, row, sg)
