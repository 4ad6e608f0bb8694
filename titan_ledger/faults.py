"""Fault injection: one flipped bit in one gradient element (``--ledger.inject STEP:RANK:bitflip``).

Design decision: a hardware glitch (a flipped bit in HBM or an ALU) is the one
cause of a loss spike that is *not* part of the run's recorded state: replaying
the same data from the same checkpoint does not reproduce it. To rehearse that
case, ``bitflip`` flips one high exponent bit of one gradient element on one DP
rank, once, after the step's backward and before the gradient clip (the clip
computes the grad norm first, so the flip shows in ``grad_norm`` and in the spike
rules exactly as a real fault would). ``replay rerun`` never passes a bitflip on
(it is not data), so ``rerun --variant same`` says "not reproduced" and
``diagnose --rerun`` names ``hardware``.

Where: ``LedgerTrainer.train_step`` calls :func:`arm` once per step (one marked
line). When the step is the injected one, :func:`arm` takes the injection off the
step's data path (``bitflip`` is not a batch replacement) and wraps the trainer's
``forward_backward_step`` *for this step only* (an instance attribute, removed
after the first call): torchtitan's ``forward_backward_step`` returns after the
backward, and FSDP2 has reduce-scattered the gradients by then, so the sharded
``param.grad`` that the clip reads is what is flipped.

Which element and bit (pure functions, unit-tested on tensors): in this rank's
local shard of the first parameter with a non-empty gradient, the highest exponent
bit that is 0 in some element and whose flip makes that element at least 100x the
shard's largest magnitude and at most ``LIMIT`` (the grad norm jumps by orders of
magnitude but stays finite: its square must not overflow float32). Without one,
the top exponent bit of the largest element (what a real fault most often does;
the grad norm may then be inf, which the spike rules flag as non-finite).
"""

from __future__ import annotations

import struct
from typing import Any

import torch

BITFLIP = "bitflip"
#: largest magnitude a flipped element may take (its square stays finite in fp32)
LIMIT = 1e6

_EXP_BITS = {torch.float32: range(30, 22, -1), torch.bfloat16: range(14, 6, -1),
             torch.float16: range(14, 9, -1), torch.float64: range(62, 51, -1)}
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
        torch.float64: torch.int64}


def flip_value(value: float, bit: int, dtype: torch.dtype = torch.float32) -> float:
    """``value`` with ``bit`` of its ``dtype`` bit pattern flipped."""
    t = torch.tensor([value], dtype=dtype)
    i = t.view(_INT[dtype])
    i ^= _mask(bit, dtype)
    return float(t[0])


def _mask(bit: int, dtype: torch.dtype) -> int:
    width = torch.finfo(dtype).bits
    m = 1 << bit
    return m - (1 << width) if bit == width - 1 else m  # the sign bit as a negative int


def choose_bit(value: float, dtype: torch.dtype = torch.float32, limit: float = LIMIT) -> int:
    """The highest exponent bit of ``value`` that is 0 and whose flip gives a magnitude
    in (|value|, limit]; else the highest exponent bit that is 0 (a large effect
    either way); else the lowest exponent bit."""
    bits = list(_EXP_BITS[dtype])
    zero = [b for b in bits if not _bit_set(value, b, dtype)]
    for b in zero:
        v = abs(flip_value(value, b, dtype))
        if abs(value) < v <= limit:
            return b
    return zero[0] if zero else bits[-1]


def _bit_set(value: float, bit: int, dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return bool(struct.unpack("<I", struct.pack("<f", value))[0] >> bit & 1)
    t = torch.tensor([value], dtype=dtype).view(_INT[dtype])
    return bool((int(t[0]) >> bit) & 1)


def flip_tensor(t: torch.Tensor, limit: float = LIMIT, gain: float = 100.0) -> dict[str, Any] | None:
    """Flip one exponent bit of one element of ``t`` in place (a local, contiguous tensor).

    Searches every element and exponent bit (highest first) for a flip of a 0 bit
    whose result is finite, at most ``limit`` and at least ``gain`` x the tensor's
    largest magnitude (a large but finite jump of the grad norm); takes the largest
    such result. Without one, flips the top exponent bit of the largest-magnitude
    element (what a real fault most often does: the grad norm may become inf).
    Returns what was done, or None when ``t`` is empty or not floating point."""
    if t.numel() == 0 or not t.is_floating_point() or t.dtype not in _INT:
        return None
    if not t.is_contiguous():
        raise ValueError("flip_tensor needs a contiguous tensor")
    flat = t.view(-1)
    vals = flat.detach()
    top = float(vals.abs().max())
    floor = max(gain * top, 1e-30)
    ints = vals.view(_INT[t.dtype])
    choice = None
    for bit in _EXP_BITS[t.dtype]:
        m = _mask(bit, t.dtype)
        zero = (ints & m) == 0
        flipped = (ints ^ m).view(t.dtype).abs()
        ok = zero & torch.isfinite(flipped) & (flipped <= limit) & (flipped >= floor)
        if bool(ok.any()):
            cand = torch.where(ok, flipped, torch.zeros_like(flipped))
            choice = (int(cand.argmax()), bit)
            break
    if choice is None:
        choice = (int(vals.abs().argmax()), _EXP_BITS[t.dtype][0])
    idx, bit = choice
    before = float(flat[idx])
    after = flip_value(before, bit, t.dtype)
    with torch.no_grad():
        flat[idx] = after
    return {"index": idx, "bit": bit, "before": before, "after": after}


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if hasattr(g, "to_local") else g


def flip_first_grad(params, limit: float = LIMIT) -> dict[str, Any] | None:
    """Flip one bit in the first parameter (of ``(name, param)`` pairs) whose local
    gradient shard is non-empty. Returns the record (with the parameter name)."""
    for name, p in params:
        g = p.grad
        if g is None:
            continue
        local = _local(g)
        if local.numel() == 0:
            continue
        out = flip_tensor(local, limit)
        if out is not None:
            return {"param": name, **out}
    return None


def arm(trainer) -> None:
    """Per step, from ``LedgerTrainer.train_step``: when this step and DP rank are the
    ``bitflip`` injection, take it off the data path and flip after the backward."""
    io = getattr(trainer, "_io", None)
    if io is None:
        return
    if io.inject == BITFLIP:
        io.inject = None  # not a batch replacement; the data ledger records no injection
    from titan_ledger.ledger import parse_injects

    here = (trainer.step, trainer.ledger.topo.dp_rank, BITFLIP)
    if here not in parse_injects(trainer.config.ledger.inject or ""):
        return
    inner = trainer.forward_backward_step  # the bound method (class attribute)

    def flip_after_backward(**kwargs):
        del trainer.forward_backward_step  # once: the instance attribute goes away
        loss = inner(**kwargs)
        named = [(n, p) for m in trainer.model_parts for n, p in m.named_parameters()]
        done = flip_first_grad(named)
        from torchtitan.tools.logging import logger

        logger.warning(f"titan_ledger: --ledger.inject bitflip at step {trainer.step}: {done}")
        return loss

    trainer.forward_backward_step = flip_after_backward
