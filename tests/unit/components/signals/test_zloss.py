"""z-loss and log Z (``[loss] z_loss_weight``, titan_ledger.components.signals.doc_loss), in this
process: the loss and its gradient equal a direct recomputation, masked labels count
for neither, chunks add up to the whole, and the flags fail with the flag's name.
(Under TP and PP the same code runs in the session's straight runs, which
``tests/multiproc/test_signals_exact.py`` compares with an unsharded model.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss

from titan_ledger.components.signals.doc_loss import (
    ChunkedDocLoss,
    DocLossCrossEntropy,
    LogZStats,
    as_ledger_loss,
    ce_and_logz,
)
from titan_ledger.errors import ConfigError


def _batch(seed=0, b=2, length=12, vocab=40):
    g = torch.Generator().manual_seed(seed)
    pred = (3 * torch.randn(b, length, vocab, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (b, length), generator=g)
    labels[0, 3] = labels[1, 7] = IGNORE_INDEX  # masked (quarantine, padding): not a token
    return pred, labels


def _reference(pred, labels, w, tokens):
    x = pred.flatten(0, 1).double()
    flat = labels.flatten()
    valid = flat != IGNORE_INDEX
    ce = F.cross_entropy(x, flat, ignore_index=IGNORE_INDEX, reduction="sum")
    lse = torch.logsumexp(x, -1)[valid]
    return (ce + w * lse.square().sum()) / tokens, lse


@pytest.mark.parametrize("w", [0.0, 0.1])
def test_loss_and_gradient_equal_the_direct_form_and_log_z_is_recorded(w):
    pred, labels = _batch()
    tokens = torch.tensor(float((labels != IGNORE_INDEX).sum()))
    ours = DocLossCrossEntropy(DocLossCrossEntropy.Config(z_loss_weight=w))
    ours.logz = stats = LogZStats()
    loss, _ = ours(pred, labels, tokens)
    (g,) = torch.autograd.grad(loss, pred)
    ref_pred = pred.detach().clone().requires_grad_()
    ref, lse = _reference(ref_pred, labels, w, tokens)
    (rg,) = torch.autograd.grad(ref, ref_pred)
    assert math.isclose(float(loss.detach()), float(ref.detach()), rel_tol=1e-6)
    torch.testing.assert_close(g.double(), rg.double(), rtol=1e-5, atol=1e-8)
    zsq, zsum, zmax, n = stats.take().tolist()
    lse = lse.detach()  # (the recorded values are the fp32 pass's: 1e-6 of the fp64 ones)
    assert n == 22 and math.isclose(zsq / n, float(lse.square().mean()), rel_tol=1e-6)
    assert math.isclose(zsum / n, float(lse.mean()), rel_tol=1e-6)
    assert math.isclose(zmax, float(lse.max()), rel_tol=1e-6)
    # at weight 0 the loss is torchtitan's cross-entropy
    if w == 0:
        tt, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(pred, labels, tokens)
        assert math.isclose(float(loss.detach()), float(tt.detach()), rel_tol=1e-6)


def test_the_z_term_grows_with_the_logits_and_pulls_log_z_down():
    pred, labels = _batch(seed=1)
    tokens = torch.tensor(22.0)
    plain = DocLossCrossEntropy(DocLossCrossEntropy.Config())
    z = DocLossCrossEntropy(DocLossCrossEntropy.Config(z_loss_weight=0.5))
    shift = torch.zeros_like(pred, requires_grad=True)  # a common offset raises log Z, not the CE
    (gp,) = torch.autograd.grad(plain(pred.detach() + shift, labels, tokens)[0], shift)
    (gz,) = torch.autograd.grad(z(pred.detach() + shift, labels, tokens)[0], shift)
    assert abs(float(gp.sum())) < 1e-5  # the CE is shift-invariant
    assert float(gz.sum()) > 1.0  # the z-loss is not: its gradient pushes every logit down


def test_chunks_and_microbatches_add_up_and_rewind_forgets():
    pred, labels = _batch(seed=2)
    whole = LogZStats()
    x, lse = ce_and_logz(pred, labels)
    whole.add(lse, labels.flatten() != IGNORE_INDEX)
    parts = LogZStats()
    parts.add(torch.full((5,), 1e9), torch.ones(5, dtype=torch.bool))  # PP shape inference...
    parts.rewind_step()  # ...forgotten
    for c in range(3):
        sl = slice(4 * c, 4 * (c + 1))
        _, l2 = ce_and_logz(pred[:, sl], labels[:, sl])
        parts.add(l2, labels[:, sl].flatten() != IGNORE_INDEX)
    torch.testing.assert_close(parts.take(), whole.take())
    assert LogZStats().take() is None  # no loss ran here (PP's non-last stages): nothing built
    assert parts.take() is None  # taken once: the next step starts empty


def test_validation_has_no_penalty_and_configs_convert_with_one_flag():
    pred, labels = _batch(seed=3)
    z = DocLossCrossEntropy(DocLossCrossEntropy.Config(z_loss_weight=1.0))
    with torch.no_grad():
        val, _ = z(pred, labels, None)
        ce, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(pred, labels, None)
    assert math.isclose(float(val), float(ce), rel_tol=1e-6)
    cfg = as_ledger_loss(ChunkedLossWrapper.Config(num_chunks=4, loss_fn=CrossEntropyLoss.Config(global_vocab_size=40)))
    assert type(cfg) is ChunkedDocLoss.Config and cfg.num_chunks == 4
    assert type(cfg.loss_fn) is DocLossCrossEntropy.Config and cfg.loss_fn.global_vocab_size == 40
    cfg.z_loss_weight = 0.25
    built = cfg.build()
    assert built.loss_fn.z_loss_weight == 0.25 and built.num_chunks == 4
    cfg.loss_fn.z_loss_weight = 0.5  # the inner flag is not the one to set
    with pytest.raises(ConfigError, match="--loss.z_loss_weight"):
        cfg.build()
    with pytest.raises(ConfigError, match="--loss.z_loss_weight must be a finite number >= 0"):
        DocLossCrossEntropy.Config(z_loss_weight=-1.0)
