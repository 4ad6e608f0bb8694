"""Per-document loss: the loss of every document segment of every packed row, on device.

Design decision: no extra forward and no second softmax. The cross-entropy that
torchtitan computes with ``reduction="sum"`` is computed here once with
``reduction="none"`` (the same branches as ``torchtitan.components.loss.
cross_entropy_loss``: plain, loss-parallel DTensor, spmd loss-parallel), the
per-token values are summed for the training loss, and -- detached -- added per
document segment with one ``index_add_``. ``DocLossCrossEntropy`` replaces
torchtitan's ``CrossEntropyLoss`` wherever the config names it (also as the inner
loss of ``ChunkedLossWrapper``), so it runs where the loss runs: every FSDP rank,
every TP rank (loss-parallel gives each the full per-token loss), the last PP
stage.

Which segment a token belongs to comes from the batch's ``positions`` (every
document segment restarts at 0, see ``data.layout.positions_of``): segment index
= number of position resets so far in the row. The trainer hands each
microbatch's ``positions`` to the :class:`DocLossTracker` in
``post_dataloading_process``, in microbatch order; the loss takes them in the same
order (the non-PP step, a PP last stage and ``ChunkedLossWrapper``'s sequence
chunks all call the loss in that order), so the loss needs no extra argument.
Validation runs the same loss object but feeds no positions: it is not tracked.
Context parallelism splits a document over ranks: not supported (the tracker is
off under CP).

Per step and rank the tracker keeps ``(sum, tokens)`` per (microbatch, row,
segment) on device and reduces them to a fixed-size summary (:meth:`summary`):
the ``k`` highest- and ``k`` lowest-mean segments with at least ``min_tokens``
label tokens, the median segment mean, and counts. Fixed size keeps the ledger row
and the recorder's one collective O(1) in the batch size; both sides matter,
because bad data is two-sided (random text: a very high loss; repeated tokens: a
very low one).

**z-loss and log Z.** The same pass also yields log Z = logsumexp(logits) per token
(the cross-entropy is log Z minus the label's logit), so the output-logit drift signal
costs no second read of the logits: ``ce_and_logz`` computes both (plainly, or with
:class:`_VocabParallelCE` on a TP vocab shard: the max and the sum of exponentials
all-reduced once, as torchtitan's loss-parallel CE does), :class:`LogZStats` sums
log Z and log Z^2 and keeps the max over the valid (unmasked) label tokens for the
recorder, and with ``[loss] z_loss_weight`` w > 0 the loss adds w * log Z^2 per valid
token to the summed cross-entropy before torchtitan divides by the global valid
tokens (PaLM's auxiliary loss; OLMo-core's ``z_loss_multiplier``). Validation (no
grad) computes the plain cross-entropy, without the penalty.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import spmd_types as spmd
import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss

from titan_ledger.data.layout import distinct_documents
from titan_ledger.errors import ConfigError


def segment_index(positions: torch.Tensor) -> torch.Tensor:
    """[B, L] positions -> [B, L] index of the document segment within its row."""
    return torch.cumsum((positions == 0).to(torch.int64), dim=1) - 1


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy and log Z from this TP rank's vocab shard ``[N, V/tp]``.

    Forward: two TP all-reduces for log Z (max, sum of exponentials) and one for the
    label's logit, as torchtitan's ``_LossParallelCrossEntropy`` does; the label logit
    comes from the rank whose shard holds it. Backward has no collective: every TP
    rank holds the same per-token gradients, and the local logits' gradient is
    ``softmax_local * (g_ce + g_lse)`` minus ``g_ce`` at the label (on its owner).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, global_vocab: int):
        x = logits.float()
        n_local = x.shape[-1]
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = (global_vocab + world - 1) // world  # torchtitan's (uneven) vocab split
        start = min(global_vocab, chunk * rank)
        if n_local != max(0, min(global_vocab, start + chunk) - start):
            raise ValueError(f"vocab shard of {n_local} classes for a {global_vocab}-class vocab on TP rank "
                             f"{rank}/{world}")
        m = x.amax(-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m.unsqueeze(-1))
        s = e.sum(-1)
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        lse = m + torch.log(s)
        valid = labels != IGNORE_INDEX
        local = labels - start
        mine = valid & (local >= 0) & (local < n_local)
        idx = torch.where(mine, local, 0)
        target = torch.where(mine, x.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group)
        ce = torch.where(valid, lse - target, 0.0)
        e.div_(s.unsqueeze(-1))  # the local softmax, kept for backward
        ctx.save_for_backward(e, idx, mine, valid)
        ctx.in_dtype = logits.dtype
        return ce, lse

    @staticmethod
    def backward(ctx, g_ce: torch.Tensor, g_lse: torch.Tensor):
        softmax, idx, mine, valid = ctx.saved_tensors
        g_ce = torch.where(valid, g_ce, 0.0)
        grad = softmax * (g_ce + g_lse).unsqueeze(-1)
        grad.scatter_add_(-1, idx.unsqueeze(-1), torch.where(mine, -g_ce, 0.0).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def ce_and_logz(pred: torch.Tensor, labels: torch.Tensor,
                global_vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(per-token cross-entropy [N], log Z [N])`` in one pass over the logits (the
    cross-entropy 0 at ignored labels), on the branches of torchtitan's
    ``cross_entropy_loss``; None where only its fused form is available (CP)."""
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
    from torchtitan.distributed.utils import get_spmd_backend

    if isinstance(pred, DTensor) and isinstance(labels, DTensor):
        return None  # torchtitan's local_map path (CP): no per-token form here
    if isinstance(pred, DTensor):
        if pred.placements == (Shard(pred.ndim - 1),):
            return _VocabParallelCE.apply(pred.to_local().flatten(0, 1), labels.flatten(0, 1),
                                          pred.device_mesh.get_group("tp"), pred.shape[-1])
        return None
    if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        return _VocabParallelCE.apply(pred.flatten(0, 1), labels.flatten(0, 1),
                                      current_spmd_mesh().get_group("tp"), global_vocab_size)
    x = pred.flatten(0, 1).float()
    flat = labels.flatten(0, 1)
    valid = flat != IGNORE_INDEX
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(-1, torch.where(valid, flat, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lse - target, 0.0), lse


class LogZStats:
    """This step's log Z over the valid label tokens, on device: ``[sum log Z^2, sum
    log Z, max log Z, tokens]`` (what the recorder reduces over DP ranks)."""

    SIZE = 4

    def __init__(self):
        self._acc: torch.Tensor | None = None

    def add(self, lse: torch.Tensor, valid: torch.Tensor) -> None:
        lse = lse.detach().double()
        part = torch.stack([torch.where(valid, lse.square(), 0.0).sum(), torch.where(valid, lse, 0.0).sum(),
                            torch.where(valid, lse, -torch.inf).amax(), valid.sum().double()])
        if self._acc is None:
            self._acc = part
        else:
            self._acc = torch.cat([self._acc[:2] + part[:2], torch.maximum(self._acc[2:3], part[2:3]),
                                   self._acc[3:] + part[3:]])

    def take(self) -> torch.Tensor | None:
        """The step's vector, or None when no loss ran here (PP's non-last stages: the
        recorder's defaults stand, with no tensor built from host floats), then reset."""
        out, self._acc = self._acc, None
        return out

    def rewind_step(self) -> None:
        """Forget this step's loss calls (the PP schedule's shape inference ran the loss)."""
        self._acc = None


@dataclass
class _Pending:
    key: torch.Tensor  # [B, L] row * L + segment index, per token
    offset: int = 0  # tokens of this microbatch already seen (ChunkedLossWrapper chunks)


class DocLossTracker:
    """Per-step (sum, tokens) per document segment, on device; a fixed-size summary."""

    #: summary layout: [n_segments, n_valid, median_mean, documents, (key, sum, tokens) x k hi,
    #: x k lo]; ``documents`` is a host count (``set_documents``), NaN when not given
    HEAD = 4

    def __init__(self, k: int = 4, min_tokens: int = 16, seq_len: int = 0):
        self.k = k
        self.seq_len = seq_len  # row length: keys are row * seq_len + segment
        self.min_tokens = min_tokens
        self.enabled = True
        self._queue: deque[_Pending] = deque()
        self._pushed: list[torch.Tensor] = []  # this step's microbatches, for rewind_step
        self._acc: list[torch.Tensor] = []
        self._documents = float("nan")

    @property
    def size(self) -> int:
        return self.HEAD + 6 * self.k

    # ------------------------------------------------------------------ feeding
    def push(self, positions: torch.Tensor) -> None:
        """One training microbatch's positions, in the order the loss will see it."""
        if not self.enabled:
            return
        seg = segment_index(positions)
        b, length = seg.shape
        self.seq_len = length
        key = torch.arange(b, device=seg.device).unsqueeze(1) * length + seg  # once per microbatch
        self._pushed.append(key)
        self._queue.append(_Pending(key))
        # (loss sum, label tokens) per (row, segment): one index_add per loss call
        self._acc.append(torch.zeros(b * length, 2, dtype=torch.float64, device=seg.device))

    def add(self, per_token: torch.Tensor, labels: torch.Tensor) -> None:
        """The loss of one call (a microbatch, or one sequence chunk of it)."""
        if not self._queue:
            return  # validation, or a loss call the trainer did not announce
        p = self._queue[0]
        mb = len(self._acc) - len(self._queue)
        b, length = p.key.shape
        chunk = labels.shape[-1] if labels.dim() > 1 else labels.numel() // b
        key = p.key[:, p.offset:p.offset + chunk].flatten()
        valid = (labels.reshape(-1) != IGNORE_INDEX)
        self._acc[mb].index_add_(0, key, torch.stack([per_token.detach().reshape(-1).double(),
                                                      valid.double()], dim=1))
        p.offset += chunk
        if p.offset >= length:
            self._queue.popleft()

    # ------------------------------------------------------------------ per step
    def set_documents(self, tags: list) -> None:
        """This step's rows' provenance (``RowTag`` s, every microbatch): how many distinct
        documents they hold (segments of ``min_tokens`` or more, as ranked). The device
        sees segments, not documents: four rows sliced from one long document are four
        segments and one document, which rank separation must know
        (``spikes.SpikeDetector``); a host count, so no device work."""
        self._documents = float(distinct_documents(tags, self.min_tokens)) if tags else float("nan")

    def summary(self, device: torch.device) -> torch.Tensor:
        """This step's fixed-size summary (float64, on device), then reset.

        Keys are ``(microbatch * rows_per_microbatch + row) * seq_len + segment``: the
        row index within the step's fetched rows, in the order the data ledger lists them.
        """
        out = torch.full((self.size,), float("nan"), dtype=torch.float64, device=device)
        out[3] = self._documents
        if not self._acc:
            self._reset()
            return out
        acc = torch.cat(self._acc)
        sums, toks = acc[:, 0], acc[:, 1]
        present = toks > 0
        valid = toks >= self.min_tokens
        means = sums / toks.clamp(min=1)
        out[0] = present.sum()
        out[1] = valid.sum()
        out[2] = torch.where(valid, means, torch.nan).nanmedian()
        k = min(self.k, means.numel())
        base = self.HEAD
        for sign in (1.0, -1.0):
            score = torch.where(valid, sign * means, -torch.inf)
            top = torch.topk(score, k)
            ok = torch.isfinite(top.values)
            trip = torch.stack([top.indices.double(), sums[top.indices], toks[top.indices]], dim=1)
            trip = torch.where(ok.unsqueeze(1), trip, torch.nan)
            out[base:base + 3 * k] = trip.flatten()
            base += 3 * self.k
        self._reset()
        return out

    def rewind_step(self) -> None:
        """Forget every loss call of this step so far, keep its microbatches: the PP
        schedule's shape inference ran the loss on made-up activations."""
        self._queue = deque(_Pending(key) for key in self._pushed)
        for t in self._acc:
            t.zero_()

    def _reset(self) -> None:
        self._documents = float("nan")
        self._queue.clear()
        self._pushed = []
        self._acc = []

    # ------------------------------------------------------------------ host side
    def decode(self, v: list[float]) -> dict[str, Any] | None:
        """A summary (host floats) -> ``{"n", "median", "top": [[key, sum, tokens]...],
        "bottom": [...]}`` with ``key`` split into (row, segment)."""
        if not v or v[0] != v[0]:  # NaN: no tracked loss this step
            return None
        length = self.seq_len or 1

        def trips(start):
            out = []
            for i in range(self.k):
                key, s, t = v[start + 3 * i:start + 3 * i + 3]
                if key == key:  # not NaN
                    out.append([int(key) // length, int(key) % length, round(s, 4), int(t)])
            return out

        out = {"n": int(v[0]), "n_valid": int(v[1]), "median": round(v[2], 6) if v[2] == v[2] else None,
               "top": trips(self.HEAD), "bottom": trips(self.HEAD + 3 * self.k)}
        if v[3] == v[3]:
            out["docs"] = int(v[3])  # distinct documents (rank separation reads it offline too)
        return out


class DocLossCrossEntropy(CrossEntropyLoss):
    """torchtitan's cross-entropy, also attributing each token's loss to its document,
    measuring log Z, and adding the z-loss when its weight is set."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        z_loss_weight: float = 0.0
        """z-loss: add this weight times the mean over valid label tokens of
        logsumexp(logits)^2 to the training loss (PaLM uses 1e-4; OLMo-core's
        ``z_loss_multiplier``). 0 adds nothing; log Z is recorded either way."""

        def __post_init__(self):
            if not (self.z_loss_weight >= 0 and math.isfinite(self.z_loss_weight)):
                raise ConfigError(f"--loss.z_loss_weight must be a finite number >= 0, got {self.z_loss_weight}")

    tracker: DocLossTracker | None = None
    logz: LogZStats | None = None

    def __init__(self, config: Config, **kwargs: Any):
        super().__init__(config, **kwargs)
        self.z_loss_weight = float(getattr(config, "z_loss_weight", 0.0))

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor,
                 global_valid_tokens: torch.Tensor | None = None, **kwargs: Any):
        tracker = self.tracker if self.tracker is not None and self.tracker.enabled else None
        if not torch.is_grad_enabled() or (tracker is None and self.logz is None and not self.z_loss_weight):
            return super().__call__(pred, labels, global_valid_tokens, **kwargs)
        got = ce_and_logz(pred, labels, self.global_vocab_size)
        if got is None:
            if self.z_loss_weight:
                raise NotImplementedError("--loss.z_loss_weight with context parallelism: the loss has no "
                                          "per-token form there; set --loss.z_loss_weight 0")
            return super().__call__(pred, labels, global_valid_tokens, **kwargs)
        per_token, lse = got
        valid = labels.reshape(-1) != IGNORE_INDEX
        if tracker is not None:
            tracker.add(per_token, labels)
        if self.logz is not None:
            self.logz.add(lse, valid)
        loss = per_token.sum()
        if self.z_loss_weight:
            loss = loss + self.z_loss_weight * torch.where(valid, lse.square(), 0.0).sum()
        if global_valid_tokens is not None:
            # as torchtitan's CrossEntropyLoss.__call__
            is_type_checking = spmd.is_type_checking()
            with spmd.no_typecheck():
                loss = loss / global_valid_tokens
                if is_type_checking:
                    spmd.assert_type(loss, {"dp": spmd.P, "cp": spmd.P, "tp": spmd.I})
        return loss, {}


class ChunkedDocLoss(ChunkedLossWrapper):
    """torchtitan's chunked loss around :class:`DocLossCrossEntropy`, with the z-loss
    weight at the top (``--loss.z_loss_weight``), as for an unchunked loss."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        z_loss_weight: float = 0.0
        """z-loss: add this weight times the mean over valid label tokens of
        logsumexp(logits)^2 to the training loss (every chunk's share). 0 adds nothing."""

    def __init__(self, config: Config, **kwargs: Any):
        inner = config.loss_fn
        if isinstance(inner, DocLossCrossEntropy.Config) and inner.z_loss_weight not in (0.0, config.z_loss_weight):
            raise ConfigError("set the z-loss weight with --loss.z_loss_weight ([loss] z_loss_weight), not "
                              "--loss.loss_fn.z_loss_weight")
        super().__init__(config, **kwargs)
        if not isinstance(self.loss_fn, DocLossCrossEntropy):
            if config.z_loss_weight:
                raise ConfigError(f"--loss.z_loss_weight needs titan_ledger's cross-entropy inside the chunked "
                                  f"loss, not {type(self.loss_fn).__name__}")
            return
        self.loss_fn.z_loss_weight = config.z_loss_weight


def as_ledger_loss(loss):
    """torchtitan's loss config -> ours (the same fields plus ``z_loss_weight``):
    ``CrossEntropyLoss`` -> :class:`DocLossCrossEntropy`, a ``ChunkedLossWrapper`` of it
    -> :class:`ChunkedDocLoss`; anything else is returned unchanged."""
    if type(loss) is CrossEntropyLoss.Config:
        return DocLossCrossEntropy.Config(global_vocab_size=loss.global_vocab_size)
    if type(loss) is ChunkedLossWrapper.Config and type(loss.loss_fn) in (CrossEntropyLoss.Config,
                                                                          DocLossCrossEntropy.Config):
        return ChunkedDocLoss.Config(num_chunks=loss.num_chunks, loss_fn=as_ledger_loss(loss.loss_fn))
    return loss


def use_doc_loss(config) -> bool:
    """Swap torchtitan's CrossEntropyLoss config for ours (also inside a chunked
    wrapper). Returns False when the loss is something else (then no per-doc loss)."""
    config.loss = as_ledger_loss(config.loss)
    loss = config.loss
    return isinstance(loss, DocLossCrossEntropy.Config) or (
        isinstance(loss, ChunkedLossWrapper.Config) and isinstance(loss.loss_fn, DocLossCrossEntropy.Config))


def find_doc_loss(loss_fn) -> DocLossCrossEntropy | None:
    if isinstance(loss_fn, DocLossCrossEntropy):
        return loss_fn
    inner = getattr(loss_fn, "loss_fn", None)
    return inner if isinstance(inner, DocLossCrossEntropy) else None
