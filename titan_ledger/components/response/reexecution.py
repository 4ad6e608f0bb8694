"""One way to execute a training step again: :class:`Reexecution`.

Design decision: a step is executed more than once in three places -- the proof at the
alarm runs *extra* executions of a flagged step (``same``, ``masked``, ``control``,
and once more to put an applied update back in the gradients), a deferred decision
that changed the parameters *replaces* the next step's first execution (the redo), and
the window proof (:mod:`.window_proof`) re-runs the window's steps from a host snapshot
(extra executions, on state it puts back itself). All go through this one context, so what an execution touches is listed once and
restored once:

==================  ====================================  ================================
touched             an extra execution (``replaces=False``)  a replacing one (``replaces=True``)
==================  ====================================  ================================
gradients           fresh tensors (the caller keeps the first's by reference)  fresh tensors
the step record     the hooks see the executed step; the trainer's own is put back
``ntokens_seen``    put back (torchtitan counts every forward's tokens; the first execution's count stands)
MoE routing counts  put back (an extra execution routes no tokens the load-balancing update may count)
the RNG state       put back (CPU, and CUDA on a GPU)
per-step            drained after (what the extra             drained before (the replaced
accumulators        execution refilled: document losses,      execution's), kept after
                    log Z, max logits)
rehearsal faults    left fired (a transient fault happens     re-armed before (the replaced
                    in the first execution only)              execution never happened)
==================  ====================================  ================================

MoE counts on a redo: deferral is off when an optimizer step hook (MoE load balancing)
would read them (``Recovery.deferrable``), so they are put back in both cases.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from titan_ledger.components.response.host import Host, LedgerPort, RunFacts
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.errors import ProofFailure
from titan_ledger.rehearsal import faults


def check_deadline(world: int, device: torch.device, deadline: float, what: str, timeout: float) -> None:
    """Past ``deadline`` (``time.perf_counter``): :class:`ProofFailure`. Every rank asks at
    the same point of a proof and they agree (one MAX of a flag), so that none goes on
    into a collective the others have left."""
    import torch.distributed as dist

    over = time.perf_counter() > deadline
    if world > 1:
        flag = torch.tensor(1.0 if over else 0.0, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        over = bool(flag.item())
    if over:
        raise ProofFailure(f"{what} ran past --ledger.proof.timeout {timeout:g} s")


def expert_counts(model_parts) -> list[torch.Tensor]:
    """MoE layers' ``tokens_per_expert_E`` buffers (torchtitan's MoE): every forward adds
    its routing counts, and the load-balancing hook turns them into the expert-bias update
    at ``optimizers.step()``, so an extra execution's counts are taken back out."""
    return [b for m in model_parts for name, b in m.named_buffers() if name.rsplit(".", 1)[-1] == "tokens_per_expert_E"]


class Reexecution:
    """``with Reexecution(host, ledger, run, rec, replaces=...) as again: out = again.run(groups)``:
    the trainer's own ``execute`` (the copied torchtitan body) on ``groups`` -- ``rec``'s
    batches, or a masked copy of them -- with everything else put back on exit (the
    table in the module docstring). ``run`` may be called more than once inside one
    context (the proof's executions); each gets fresh gradients."""

    def __init__(self, host: Host, ledger: LedgerPort, facts: RunFacts, rec: StepRecord | None, *,
                 replaces: bool) -> None:
        self.host, self.ledger, self.facts, self.rec, self.replaces = host, ledger, facts, rec, replaces
        self._saved: tuple[Any, ...] | None = None

    def __enter__(self) -> Reexecution:
        t = self.host
        counts = expert_counts(self.facts.parts.model_parts)
        cuda = torch.cuda.get_rng_state() if self.facts.device.type == "cuda" else None
        self._saved = (t.step_record, t.ntokens_seen, counts, [c.clone() for c in counts],
                       torch.get_rng_state(), cuda)
        if self.replaces:
            self.ledger.discard_step_state()  # the replaced execution's accumulators
            faults.rearm(self.rec.faults)  # ...and its one-time faults: it never happened
        return self

    def run(self, groups, need_loss: bool = True):
        """One execution on ``groups`` with fresh gradients; returns ``execute``'s
        (accumulated loss, pre-clip grad norm, local and global valid tokens)."""
        t = self.host
        for m in self.facts.parts.model_parts:
            for p in m.parameters():
                p.grad = None
        t.attend(self.rec)  # the hooks see the executed step (a swap repeats; a bitflip is done)
        out = t.execute(groups, need_loss)
        if not self.replaces:
            self.ledger.discard_step_state()  # what the extra execution refilled
        return out

    def rewind_rng(self) -> None:
        """The RNG back to its state at entry: executions that must draw the same random
        numbers (the window proof's variants) each start here."""
        rng, cuda = self._saved[4:]
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)

    def __exit__(self, *exc) -> None:
        t = self.host
        outer, seen, counts, kept = self._saved[:4]
        t.attend(outer)
        t.ntokens_seen = seen
        for c, k in zip(counts, kept):
            c.copy_(k)
        self.rewind_rng()
