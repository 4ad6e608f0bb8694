"""Fault injection: one flipped bit in one gradient element (``--ledger.rehearsal.inject STEP:RANK:bitflip``).

Design decision: a hardware glitch (a flipped bit in HBM or an ALU) is the one
cause of a loss spike that is *not* part of the run's recorded state: replaying
the same data from the same checkpoint does not reproduce it. To rehearse that
case, ``bitflip`` flips one high exponent bit of one gradient element on one DP
rank, once, after the step's backward and before the gradient clip (the clip
computes the grad norm first, so the flip shows in ``grad_norm`` and in the spike
rules exactly as a real fault would). ``replay rerun`` never passes a bitflip on
(it is not data), so ``rerun --variant same`` says "not reproduced" and
``diagnose --rerun`` names ``hardware``.

Where: ``LedgerTrainer.train_step`` calls :func:`plan` once per step (one marked
line): it takes the injection off the step's data path (``bitflip`` is not a batch
replacement) and returns the step's :class:`StepFaults`, kept with the step's
bookkeeping. ``LedgerTrainer.forward_backward_step`` (an override of torchtitan's)
calls :func:`before_forward` (``swap``, every microbatch) and, once torchtitan's
``forward_backward_step`` has returned, :func:`after_backward` (``bitflip``, the
step's first call only): torchtitan's ``forward_backward_step`` returns after the
backward, and FSDP2 has reduce-scattered the gradients by then, so the sharded
``param.grad`` that the clip reads is what is flipped.

Which element and bit (pure functions, unit-tested on tensors): in this rank's
local shard of the parameter with the largest gradient magnitude (the first that
is non-empty breaks ties; a flip in a parameter whose gradients are all tiny, such as
an embedding's, barely moves the grad norm, which no spike zoo can use), the highest exponent
bit that is 0 in some element and whose flip makes that element at least 100x the
shard's largest magnitude and at most ``LIMIT`` (the grad norm jumps by orders of
magnitude but stays finite: its square must not overflow float32). Without one,
the top exponent bit of the largest element (what a real fault most often does;
the grad norm may then be inf, which the spike rules flag as non-finite).

``bitflip@F`` (issue 52: silent corruption too small for the grad-norm rules): a finite
flip of a chosen size, still one real bit of one element (exponent or mantissa: an
exponent bit alone moves an element 2, 4, 16, 256... x, too coarse to aim). Before the step's
clip every rank joins one grad-norm reduction (the clip's own, at an infinite max norm);
the rank owning that DP rank's loss then flips, among its local non-replicated gradient
shards, the bit that brings the global grad norm closest to F x (:func:`flip_to_factor`;
the factor reached is logged, and the ledger's ``grad_norm`` shows it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from titan_ledger.errors import ConfigError

BITFLIP = "bitflip"
SWAP = "swap"
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
    # (components.signals.sums.local, which sits above this layer)
    return g.to_local() if hasattr(g, "to_local") else g


def flip_largest_grad(params, limit: float = LIMIT) -> dict[str, Any] | None:
    """Flip one bit in the parameter (of ``(name, param)`` pairs) whose local gradient
    shard holds the largest magnitude (the first such on ties; empty shards are
    passed over). Returns the record (with the parameter name)."""
    best, top = None, -1.0
    for name, p in params:
        g = p.grad
        if g is None:
            continue
        local = _local(g)
        if local.numel() == 0 or not local.is_floating_point():
            continue
        m = float(local.detach().abs().max())
        if m > top:
            best, top = (name, local), m
    if best is None:
        return None
    out = flip_tensor(best[1], limit)
    return None if out is None else {"param": best[0], **out}


def rotate(items: list, rank: int) -> Any:
    """``swap``: DP rank ``rank`` takes rank ``(rank + 1) % n``'s item."""
    return items[(rank + 1) % len(items)]


def swap_batches(input_dict: dict, labels: torch.Tensor, group) -> tuple[dict, torch.Tensor]:
    """All-gather every batch tensor over the DP group and take the next rank's
    (every DP rank must call it; batches have one shape per step)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)

    def take(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return rotate(parts, rank)

    out = {k: take(v) if isinstance(v, torch.Tensor) else v for k, v in sorted(input_dict.items())}
    return out, take(labels)


INJECT_KINDS = ("repeat", "random", "bitflip", "swap")
FAULT_KINDS = ("bitflip", "swap")  # not a batch replacement
#: ``bitflip@F``: a finite flip that moves the step's grad norm F x (F > 1)
SCALED = "bitflip@"


def flip_factor(kind: str) -> float | None:
    """``bitflip@F`` -> F (> 1), None for any other kind; ConfigError for a bad F."""
    if not kind.startswith(SCALED):
        return None
    try:
        f = float(kind[len(SCALED):])
    except ValueError:
        f = float("nan")
    if not f > 1 or f == float("inf"):
        raise ConfigError(f"--ledger.rehearsal.inject ...:{kind}: write bitflip@F with a finite factor F > 1, "
                          f"e.g. 10:1:bitflip@2")
    return f


def is_fault(kind: str) -> bool:
    return kind in FAULT_KINDS or kind.startswith(SCALED)


def parse_injects(spec: str) -> list[tuple[int, int, str]]:
    """``"STEP:DP_RANK:KIND[,STEP:DP_RANK:KIND...]"`` -> [(step, dp_rank, kind)]; at most
    one data kind (repeat/random), any number of faults (bitflip, swap)."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        bits = part.split(":")
        try:
            step, rank, kind = int(bits[0]), int(bits[1]), bits[2]
            if len(bits) != 3:
                raise IndexError
        except (IndexError, ValueError):
            raise ConfigError(f"--ledger.rehearsal.inject {spec!r}: write STEP:DP_RANK:KIND, e.g. 8:1:repeat") from None
        if (kind not in INJECT_KINDS and flip_factor(kind) is None) or step < 1 or rank < 0:
            raise ConfigError(f"--ledger.rehearsal.inject {spec!r}: KIND is repeat or random (data) or bitflip, "
                              f"bitflip@F or swap (faults); STEP >= 1; DP_RANK >= 0")
        out.append((step, rank, kind))
    if sum(not is_fault(k) for _, _, k in out) > 1:
        raise ConfigError(f"--ledger.rehearsal.inject {spec!r}: at most one repeat/random batch (bitflip/swap may be added)")
    return out


def parse_inject(spec: str) -> tuple[int, int, str] | None:
    """``"STEP:DP_RANK:KIND"`` -> (step, dp_rank, kind): the data injection of
    :func:`parse_injects` (else its first fault), which the trainer applies."""
    specs = parse_injects(spec) if spec else []
    if not specs:
        return None
    return next((s for s in specs if not is_fault(s[2])), specs[0])



@dataclass
class StepFaults:
    """One step's fault injections (:func:`plan`)."""

    #: ``swap``: the DP ("batch") process group every microbatch of the step is rotated over
    swap_group: Any = None
    #: ``bitflip`` on this DP rank, not yet done: the step's first backward clears it
    bitflip: bool = False
    #: ``bitflip`` as planned (:func:`rearm`)
    planned_bitflip: bool = False
    #: ``bitflip@F``, not yet done (on EVERY rank: the grad norm it aims at is a collective):
    #: (F, the DP rank whose loss-owning rank flips); the step's first clip clears it
    scaled: tuple[float, int] | None = None
    planned_scaled: tuple[float, int] | None = None


def rearm(faults: StepFaults | None) -> None:
    """The step's first execution was discarded (a deferred decision executes it again):
    its one-time faults happen in the execution that counts."""
    if faults is not None:
        faults.bitflip = faults.planned_bitflip
        faults.scaled = faults.planned_scaled


def replace_batch(input_dict: dict[str, torch.Tensor], labels: torch.Tensor, kind: str, vocab: int,
                  seed: int) -> torch.Tensor:
    """``repeat`` / ``random`` (``--ledger.rehearsal.inject STEP:RANK:KIND``): this batch
    becomes one repeated (rare) token or uniform random tokens; returns the new labels."""
    inputs = input_dict["input"]
    if kind == "repeat":
        inputs.fill_(vocab - 1)
        return torch.full_like(labels, vocab - 1)
    g = torch.Generator().manual_seed(seed)
    inputs.copy_(torch.randint(3, vocab, inputs.shape, generator=g))
    return torch.randint(3, vocab, labels.shape, generator=g)


def parse_die(spec: str) -> tuple[int, int, str] | None:
    """``--ledger.rehearsal.die STEP:RANK:HOW`` -> (step, global rank, how): ``HOW`` is a
    signal name (``SIGKILL``, what the OOM killer sends; ``SIGSEGV``, ``SIGTERM``...) or
    ``exitN`` (``os._exit(N)``: a process lost without a traceback). None when empty."""
    if not spec:
        return None
    import signal

    bits = spec.split(":")
    try:
        step, rank, how = int(bits[0]), int(bits[1]), bits[2]
        if len(bits) != 3 or step < 1 or rank < 0:
            raise ValueError
        if how.startswith("exit"):
            int(how[4:])
        else:
            signal.Signals[how]
    except (IndexError, ValueError, KeyError):
        raise ConfigError(f"--ledger.rehearsal.die {spec!r}: write STEP:RANK:HOW with STEP >= 1, a global "
                          f"RANK and HOW a signal name or exitN, e.g. 5:1:SIGKILL or 5:1:exit3") from None
    return step, rank, how


def die_if_planned(spec: str, step: int, rank: int) -> None:
    """``--ledger.rehearsal.die``: at the start of ``step``, global rank ``rank`` ends
    itself for real (a signal from the kernel, or ``os._exit``), nothing flushed after the
    one line that says so (its time lets a test measure how soon the job ends)."""
    plan_ = parse_die(spec)
    if plan_ is None or plan_[:2] != (step, rank):
        return
    import os
    import signal
    import sys
    import time

    how = plan_[2]
    print(f"rehearsal: rank {rank} dies at step {step} ({how}) at t={time.time():.3f}", file=sys.stderr, flush=True)
    if how.startswith("exit"):
        os._exit(int(how[4:]))
    os.kill(os.getpid(), signal.Signals[how])
    time.sleep(60)  # a signal that does not end the process (a handler) must not train on


def data_runs_out(trainer) -> None:
    """``--ledger.rehearsal.data_end N``: every fetch from step N on finds no data, as
    the fetch of a finite dataset's end does (torchtitan then ends training)."""
    end = trainer.config.ledger.rehearsal.data_end
    if end and trainer.step >= end:
        from torchtitan.components.dataloader import DataloaderExhaustedError

        raise DataloaderExhaustedError()


def plan(trainer, rec) -> StepFaults | None:
    """Per step, from ``LedgerTrainer.train_step`` (after the step's record ``rec``, a
    ``StepRecord``, is made): this step's fault injections, None without any.

    ``bitflip`` (this DP rank): flip one gradient bit after the first backward of the
    step, before the clip. ``swap`` (every DP rank, the spec's rank is ignored): DP rank
    r trains on rank (r+1) % dp's batch -- every rank consumed and recorded its own
    samples (the data ledger is unchanged), then the batches are rotated right before
    the forward (after a ``repeat``/``random`` injection). Neither is a batch
    replacement: a fault spec is taken off ``rec.inject``."""
    die_if_planned(trainer.config.ledger.rehearsal.die, trainer.step, trainer.ledger.topo.rank)
    if rec.inject and is_fault(rec.inject):
        rec.inject = None  # not a batch replacement; the data ledger records no injection
    specs = parse_injects(trainer.config.ledger.rehearsal.inject or "")
    step, dp_rank = trainer.step, trainer.ledger.topo.dp_rank
    flip = (step, dp_rank, BITFLIP) in specs
    scaled = next(((flip_factor(k), r) for s, r, k in specs if s == step and k.startswith(SCALED)), None)
    out = StepFaults(bitflip=flip, planned_bitflip=flip, scaled=scaled, planned_scaled=scaled)
    if any(s == step and k == SWAP for s, _, k in specs):
        if trainer.parallel_dims.pp_enabled:
            raise RuntimeError("--ledger.rehearsal.inject ...:swap: not supported under pipeline parallelism")
        out.swap_group = trainer.parallel_dims.get_mesh("batch").get_group()
    return out if (out.swap_group is not None or out.bitflip or out.scaled) else None


def before_forward(faults: StepFaults | None, kwargs: dict[str, Any]) -> None:
    """``swap``: replace this microbatch's ``input_dict``/``labels`` in the keyword
    arguments of ``forward_backward_step`` by the next DP rank's (every microbatch)."""
    if faults is None or faults.swap_group is None:
        return
    kwargs["input_dict"], kwargs["labels"] = swap_batches(kwargs["input_dict"], kwargs["labels"],
                                                          faults.swap_group)


def after_backward(trainer, faults: StepFaults | None) -> None:
    """``bitflip``: after the step's first backward only, flip one bit of the largest
    local gradient shard (before the clip reads it). ``--ledger.rehearsal.nondeterminism``:
    after every backward, jitter every gradient (:func:`jitter_grads`)."""
    jitter_grads(trainer, float(trainer.config.ledger.rehearsal.nondeterminism))
    if faults is None or not faults.bitflip:
        return
    faults.bitflip = False  # once per step
    named = [(n, p) for m in trainer.model_parts for n, p in m.named_parameters()]
    done = flip_largest_grad(named)
    from torchtitan.tools.logging import logger

    logger.warning(f"titan_ledger: --ledger.rehearsal.inject bitflip at step {trainer.step}: {done}")


def before_clip(trainer, faults: StepFaults | None) -> None:
    """``bitflip@F``: before the step's first clip, every rank joins one grad-norm
    computation (torchtitan's ``clip_grad_norm_`` at an infinite max norm: the same
    reduction as the clip's, its scaling a multiplication by 1.0); then the rank owning
    the planned DP rank's loss flips the one bit of its local gradients that
    brings the global grad norm closest to F x (:func:`flip_to_factor`)."""
    if faults is None or faults.scaled is None:
        return
    factor, dp = faults.scaled
    faults.scaled = None  # once per step
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.logging import logger

    pd = trainer.parallel_dims
    params = [p for m in trainer.model_parts for p in m.parameters()]
    total = dist_utils.clip_grad_norm_(params, float("inf"), foreach=True, pp_mesh=pd.get_optional_mesh("pp"),
                                       ep_enabled=pd.ep_enabled)
    topo = trainer.ledger.topo
    if topo.loss_rank_of_dp[dp] != topo.rank:
        return
    named = [(n, p) for m in trainer.model_parts for n, p in m.named_parameters()]
    done = flip_to_factor(named, float(total) ** 2, factor)
    logger.warning(f"titan_ledger: --ledger.rehearsal.inject bitflip@{factor:g} at step {trainer.step}: {done}")


def flip_to_factor(params, total_sq: float, factor: float) -> dict[str, Any] | None:
    """Flip the one bit (exponent or mantissa: a 0 turned 1, the element grows) among the local gradient
    shards of ``params`` (``(name, param)`` pairs) that brings the gradient's global sum of
    squares ``total_sq`` closest to ``factor`` squared times itself (log distance): a silent
    corruption of a chosen size, a real bit flip all the same. Gradients replicated across
    ranks (a DTensor ``Replicate`` placement) are passed over: a flip in one replica is
    not what the norm counts. Returns what was done (with the factor reached), None when
    no finite flip exists."""
    if not total_sq > 0:
        return None
    target = math.log(factor)
    best = None  # (distance, name, tensor, index, bit)
    for name, p in params:
        g = p.grad
        if g is None or any(pl.is_replicate() for pl in getattr(g, "placements", ())):
            continue
        local = _local(g)
        if local.numel() == 0 or local.dtype not in _INT:
            continue
        vals = local.detach().reshape(-1)
        ints = vals.view(_INT[local.dtype])
        x2 = vals.double().square()
        for bit in range(torch.finfo(local.dtype).bits - 2, -1, -1):  # every bit but the sign
            m = _mask(bit, local.dtype)
            flipped = (ints ^ m).view(local.dtype).double()
            new_sq = total_sq - x2 + flipped.square()
            dist_ = (0.5 * (new_sq / total_sq).log() - target).abs()
            dist_ = torch.where(((ints & m) == 0) & torch.isfinite(flipped) & torch.isfinite(dist_), dist_,
                                torch.full_like(dist_, math.inf))
            i = int(dist_.argmin())
            if math.isfinite(float(dist_[i])) and (best is None or float(dist_[i]) < best[0]):
                best = (float(dist_[i]), name, local, i, bit)
    if best is None:
        return None
    _, name, local, idx, bit = best
    flat = local.view(-1)
    before = float(flat[idx])
    after = flip_value(before, bit, local.dtype)
    with torch.no_grad():
        flat[idx] = after
    reached = math.sqrt((total_sq - before ** 2 + after ** 2) / total_sq)
    return {"param": name, "index": idx, "bit": bit, "before": before, "after": after, "factor": reached}


#: ``jitter_grads``' generator per global rank (one process is one rank; tests fake several)
_JITTER: dict[int, torch.Generator] = {}


def jitter_grads(trainer, scale: float) -> None:
    """``--ledger.rehearsal.nondeterminism X``: a machine that does not execute a step bit
    for bit, rehearsed. After every backward each local gradient shard is scaled by
    ``1 + X * u``, ``u`` uniform in [-1, 1], one draw per parameter from a generator of
    its own (the run's RNG is untouched), so two executions of the same step differ by
    about ``X`` relative, as a GPU's atomics make them differ; the loss does not (a GPU's
    forward is reproducible, its attention and embedding backward are not). Every rank
    seeds it alike and draws in parameter order, so the copies of a replicated gradient
    (TP's ``Replicate`` placements, DDP/HSDP replicas) are scaled alike and stay equal,
    as a real all-reduce leaves them; the shards of one parameter are scaled alike too.
    ``X`` must exceed the gradients' dtype spacing (2^-8 in bf16, 2^-24 in fp32), or the
    product rounds back and the rehearsal is silently bit-reproducible."""
    if not scale:
        return
    rank = trainer.ledger.topo.rank
    gen = _JITTER.get(rank)  # one per process (tests fake several ranks in one)
    if gen is None:
        gen = _JITTER[rank] = torch.Generator().manual_seed(7919)
    with torch.no_grad():
        for m in trainer.model_parts:
            for p in m.parameters():
                if p.grad is not None:
                    u = float(torch.rand((), generator=gen)) * 2.0 - 1.0
                    local = _local(p.grad)
                    local.mul_(1.0 + scale * u)


# --------------------------------------------------------------------------- the response's own failures
#: where ``--ledger.rehearsal.response_fault`` can fail the response, and how
RESPONSE_PLACES = ("proof", "bisect", "window", "snapshot", "restore")
RESPONSE_KINDS = ("raise", "nan", "oom", "timeout")


class ResponseFault(RuntimeError):
    """A failure the rehearsal injected inside the response (``response_fault ...:raise``)."""


def parse_response_faults(spec: str) -> dict[str, str]:
    """``--ledger.rehearsal.response_fault "proof:raise,snapshot:oom"`` -> ``{place: kind}``:
    at every pass through ``place`` the response fails so (``raise``: an exception;
    ``oom``: an out-of-memory error, host memory for snapshot and restore; ``nan``: the
    execution's results not finite; ``timeout``: the proof's deadline passed)."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in str(spec or "").split(",") if p.strip()):
        where, _, kind = part.partition(":")
        ok = where in RESPONSE_PLACES and kind in RESPONSE_KINDS and where not in out and not (
            where in ("snapshot", "restore") and kind in ("nan", "timeout"))
        if not ok:
            raise ConfigError(f"--ledger.rehearsal.response_fault {spec!r}: {part!r} is not PLACE:KIND; places "
                              f"{', '.join(RESPONSE_PLACES)}, kinds {', '.join(RESPONSE_KINDS)} (snapshot and "
                              f"restore: raise or oom), each place once, e.g. proof:raise,snapshot:oom")
        out[where] = kind
    return out


def response_fault(faults: dict[str, str] | None, where: str) -> str | None:
    """At ``where`` in the response: raise the injected exception, or return the kind the
    caller applies itself (``nan``, ``timeout``); None when nothing is injected there."""
    kind = (faults or {}).get(where)
    if kind == "raise":
        raise ResponseFault(f"rehearsal: --ledger.rehearsal.response_fault {where}:raise")
    if kind == "oom":
        if where in ("snapshot", "restore"):
            raise MemoryError(f"rehearsal: --ledger.rehearsal.response_fault {where}:oom (host memory)")
        raise torch.OutOfMemoryError(f"rehearsal: --ledger.rehearsal.response_fault {where}:oom")
    return kind
