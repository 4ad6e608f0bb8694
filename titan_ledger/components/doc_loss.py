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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import spmd_types as spmd
import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss, _LossParallelCrossEntropy


def segment_index(positions: torch.Tensor) -> torch.Tensor:
    """[B, L] positions -> [B, L] index of the document segment within its row."""
    return torch.cumsum((positions == 0).to(torch.int64), dim=1) - 1


def per_token_cross_entropy(pred: torch.Tensor, labels: torch.Tensor,
                            global_vocab_size: int | None = None) -> torch.Tensor | None:
    """Per-token cross-entropy ``[B*L]`` (0 at ignored labels), mirroring torchtitan's
    ``cross_entropy_loss`` branches; None where only a fused sum is available."""
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
    from torchtitan.distributed.utils import get_spmd_backend

    if isinstance(pred, DTensor) and isinstance(labels, DTensor):
        return None  # torchtitan's local_map path (CP): no per-token form here
    if isinstance(pred, DTensor):
        if pred.placements == (Shard(pred.ndim - 1),):
            return _LossParallelCrossEntropy.apply(
                pred.to_local().flatten(0, 1).float(), labels.flatten(0, 1),
                pred.device_mesh.get_group("tp"), pred.shape[-1], "none")
        return None
    if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        return _LossParallelCrossEntropy.apply(
            pred.flatten(0, 1).float(), labels.flatten(0, 1),
            current_spmd_mesh().get_group("tp"), global_vocab_size, "none")
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none",
                           ignore_index=IGNORE_INDEX)


@dataclass
class _Pending:
    key: torch.Tensor  # [B, L] row * L + segment index, per token
    offset: int = 0  # tokens of this microbatch already seen (ChunkedLossWrapper chunks)


class DocLossTracker:
    """Per-step (sum, tokens) per document segment, on device; a fixed-size summary."""

    #: summary layout: [n_segments, n_valid, median_mean, (key, sum, tokens) x k hi, x k lo]
    HEAD = 3

    def __init__(self, k: int = 4, min_tokens: int = 16, seq_len: int = 0):
        self.k = k
        self.seq_len = seq_len  # row length: keys are row * seq_len + segment
        self.min_tokens = min_tokens
        self.enabled = True
        self._queue: deque[_Pending] = deque()
        self._pushed: list[torch.Tensor] = []  # this step's microbatches, for rewind_step
        self._acc: list[torch.Tensor] = []

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
    def summary(self, device: torch.device) -> torch.Tensor:
        """This step's fixed-size summary (float64, on device), then reset.

        Keys are ``(microbatch * rows_per_microbatch + row) * seq_len + segment``: the
        row index within the step's fetched rows, in the order the data ledger lists them.
        """
        out = torch.full((self.size,), float("nan"), dtype=torch.float64, device=device)
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

        return {"n": int(v[0]), "n_valid": int(v[1]), "median": round(v[2], 6) if v[2] == v[2] else None,
                "top": trips(self.HEAD), "bottom": trips(self.HEAD + 3 * self.k)}


class DocLossCrossEntropy(CrossEntropyLoss):
    """torchtitan's cross-entropy, also attributing each token's loss to its document."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        pass

    tracker: DocLossTracker | None = None

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor,
                 global_valid_tokens: torch.Tensor | None = None, **kwargs: Any):
        tracker = self.tracker
        if tracker is None or not tracker.enabled or not torch.is_grad_enabled():
            return super().__call__(pred, labels, global_valid_tokens, **kwargs)
        per_token = per_token_cross_entropy(pred, labels, self.global_vocab_size)
        if per_token is None:
            return super().__call__(pred, labels, global_valid_tokens, **kwargs)
        tracker.add(per_token, labels)
        loss = per_token.sum()
        if global_valid_tokens is not None:
            # as torchtitan's CrossEntropyLoss.__call__
            is_type_checking = spmd.is_type_checking()
            with spmd.no_typecheck():
                loss = loss / global_valid_tokens
                if is_type_checking:
                    spmd.assert_type(loss, {"dp": spmd.P, "cp": spmd.P, "tp": spmd.I})
        return loss, {}


def use_doc_loss(config) -> bool:
    """Swap torchtitan's CrossEntropyLoss config for ours (also inside a chunked
    wrapper). Returns False when the loss is something else (then no per-doc loss)."""
    from torchtitan.components.loss import ChunkedLossWrapper

    loss = config.loss
    if type(loss) is CrossEntropyLoss.Config:
        config.loss = DocLossCrossEntropy.Config(global_vocab_size=loss.global_vocab_size)
        return True
    if isinstance(loss, ChunkedLossWrapper.Config) and type(loss.loss_fn) is CrossEntropyLoss.Config:
        loss.loss_fn = DocLossCrossEntropy.Config(global_vocab_size=loss.loss_fn.global_vocab_size)
        return True
    return isinstance(loss, DocLossCrossEntropy.Config) or (
        isinstance(loss, ChunkedLossWrapper.Config) and isinstance(loss.loss_fn, DocLossCrossEntropy.Config))


def find_doc_loss(loss_fn) -> DocLossCrossEntropy | None:
    if isinstance(loss_fn, DocLossCrossEntropy):
        return loss_fn
    inner = getattr(loss_fn, "loss_fn", None)
    return inner if isinstance(inner, DocLossCrossEntropy) else None
