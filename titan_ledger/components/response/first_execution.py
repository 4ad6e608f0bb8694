"""A flagged step's first execution, kept while its decision waits: :class:`FirstExecution`, :class:`KeptExecution`.

Design decision: a deferred decision (``[ledger.response] defer``) proves a step after the
next one has overwritten its gradients, so what the proof compares the first execution
with is kept apart from the prover that executes it -- a per-parameter checksum on the
device (the gradients' sums of squares and sums, :func:`_per_param_sq` and
:func:`_per_param_sum`: a changed bit changes one of them), or, where they cost no copy
(the CPU), the gradient tensors themselves. ``Recovery`` keeps them step by step and the
prover (:mod:`.prover`) reads them; neither needs the other's module for it, so they stand
here, and the checksum is unit-tested without a proof. Split from :mod:`.prover` (one
concern per file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titan_ledger.components.signals.sums import local


@dataclass
class FirstExecution:
    """A flagged step's first execution as a deferred decision keeps it for a step
    (``[ledger.response] defer``): its gradients are overwritten by the next step's, so what
    the proof compares is kept on the device instead -- per parameter the local
    gradient's sum of squares and its sum (a checksum: a changed bit changes one of them,
    a sign included) -- with the loss sum, tokens and grad norm ``Ledger.record`` saw."""

    loss_sum: Any
    local_tokens: int
    grad_norm: Any
    psq: Any
    sums: Any
    #: the gradients themselves, by reference, where they were kept anyway
    #: (:class:`KeptExecution`): the first update can then be applied bit for bit
    grads: list | None = None

    @classmethod
    def of(cls, model_parts: list, device: torch.device, execution: tuple, grads: list | None = None) -> FirstExecution:
        """The step just recorded, from the live gradients (device work only, no host read);
        or from the ``grads`` and ``execution`` a :class:`KeptExecution` kept."""
        if grads is None:
            grads = [p.grad for m in model_parts for p in m.parameters()]
        loss_sum, local_tokens, grad_norm = execution
        return cls(loss_sum, local_tokens, grad_norm, _per_param_sq(grads, device), _per_param_sum(grads, device))


class KeptExecution:
    """A deferred step's first execution kept as its gradient tensors, not a checksum:
    where every step's ``zero_grad`` sets the gradients to None (``disable_cuda_graphs``,
    the CPU backend's setting), the next step's backward makes new tensors anyway, so
    keeping the held step's costs no copy and no pass over them -- only their memory for
    a step. The checksum (:meth:`FirstExecution.of`: the same function on the same
    tensors, so the same bits) is computed only when the flag was read and the step was
    held. On the CPU the checksum cost 3.9 ms of every deferred step (debug model, ~0.8%
    of a step); on a GPU it is a device pass, and a second set of gradients is the memory
    that is short, so it stays (``Recovery``: CPU only)."""

    def __init__(self, execution: tuple) -> None:
        self.execution = execution  # (loss sum, local tokens, grad norm) as Ledger.record saw them
        self.grads: list | None = None

    def keep(self, model_parts: list) -> None:
        """After the step's ``optimizers.step()``: take its gradients off the parameters (as
        the next ``zero_grad(set_to_none=True)`` would) and keep them."""
        params = [p for m in model_parts for p in m.parameters()]
        self.grads = [p.grad for p in params]
        for p in params:
            p.grad = None

    def first(self, model_parts: list, device: torch.device) -> FirstExecution:
        """The checksum of the kept gradients, which it holds on to until the decision is
        made (an update applied as it was needs them, bit for bit)."""
        if self.grads is None:
            raise RuntimeError("titan_ledger: a deferred step's gradients were not kept after its update")
        first = FirstExecution.of(model_parts, device, self.execution, self.grads)
        first.grads, self.grads = self.grads, None
        return first


def _per_param_sq(grads, device) -> torch.Tensor:
    """This rank's gradient sum of squares per parameter (0 for a parameter without
    gradient), as float64: one vector, so that executions compare parameter by parameter.
    One fused norm over the local pieces, accumulated in float32: a deferred decision
    computes it every step, and float64 cost 3.5x as much on the CPU (2.1 against 0.6 ms
    for the debug model's 6.2M parameters). Equal gradients give equal values; a noise
    floor is resolved down to float32's rounding, about 1e-7 relative."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=device)
    have = [local(g) for g in grads if g is not None]
    norms = iter(torch._foreach_norm(have, 2, dtype=torch.float32) if have else ())
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([next(norms) if g is not None else zero for g in grads]).double().square()


def _per_param_sum(grads, device) -> torch.Tensor:
    """This rank's gradient sum per parameter, accumulated in float64 (with the sums of
    squares, a deferred decision's checksum of the first execution's gradients: a
    flipped sign leaves the squares alone, not the sum; float64, so that a change in a
    value's last bit is not rounded away -- 1.7 ms a step for the debug model on the CPU,
    a pass over the gradients on a GPU)."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([local(g).sum(dtype=torch.float64) if g is not None else zero for g in grads])
