"""Proof at the alarm: a flagged step re-executed in place, before its update.

Design decision: between the clip and ``optimizers.step()`` the flagged step is still
in memory -- its batches (``StepRecord.batches``), the parameters and the optimizer
state it was computed from -- so a counterfactual costs a forward/backward, not a
checkpoint reload on the run's whole world size. :class:`Prover` re-executes the step
through the trainer's own ``execute`` (the copied torchtitan body, so nothing about
the step differs but the labels a variant masks):

* ``same``: the step again. Unequal to the first execution (bit for bit, or past
  ``--ledger.proof.rtol``) is a transient fault (``hardware``): a third
  execution decides which result is applied, and the ranks whose local loss or
  gradients changed are named. When all three differ, the machine does not execute
  the step bit for bit (a GPU without ``--debug.deterministic``: atomics in attention's
  and embeddings' backward) and the proof measures that noise itself instead of
  trusting a constant: the closest two executions give the floor, per parameter and
  rank, and an execution is a fault only when it stands farther from both others than
  ``--ledger.proof.noise_factor`` times that floor (``verdict.odd_one_out``);
  otherwise the step reproduced within this machine's noise, and the noise is recorded
  with the proof (the tolerance, measured at every proof that needs one).
* ``control`` then ``masked``: the evidence's suspect (one DP rank's whole batch, or
  the documents that stand out on it) loss-masked, and, as a control, as much other
  data masked (another DP rank's batch, or other documents of like size). ``bad_data``
  only when ``masked`` brings the *update* back under the grad-norm rules' bars of
  this run's own history and ``control`` does not: masking the data that defines a
  per-rank or per-document statistic always removes the statistic, so the statistic
  proves nothing.

The decision itself (``verdict.judge``) is a pure function of the executions'
numbers, in ``verdict.py``, unit-tested without processes; this module executes. An unflagged step costs nothing here: the trainer
asks :meth:`Prover.wanted` only with the flag the update guard reads anyway.

Every extra execution goes through :class:`~titan_ledger.components.response.reexecution.Reexecution`,
which puts back what it touches (its table); the first execution's gradients are kept
by reference here and put back unless another result is applied. The models here draw
no random numbers in forward/backward; a model with dropout would need the step's
starting RNG state, which is not kept (it would cost every step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from titan_ledger.components.response.bisection import BISECT_BALANCE, bisect_documents
from titan_ledger.components.response.bounds import Coverage, quarantine_coverage
from titan_ledger.components.response.config import AdamCheckConfig, ConvictionConfig, ProofConfig, ProveMode
from titan_ledger.components.response.host import Host, LedgerPort, RunFacts
from titan_ledger.components.response.ladder import NoteBudget
from titan_ledger.components.response.optimizer_state import AdamEntry, amplification, update_norms
from titan_ledger.components.response.reexecution import Reexecution, check_deadline
from titan_ledger.components.response.verdict import (
    Execution,
    Suspect,
    Verdict,
    control_of,
    differing_ranks,
    document_tokens,
    judge,
    local_distance,
    mask_labels,
    mean_loss,
    name_suspect,
    noise_record,
    normal_update,
    optimizer_verdict,
    reproduced,
    same_tensor,
    stands_out,
)
from titan_ledger.components.signals.sums import local, loss_sum
from titan_ledger.errors import ProofFailure
from titan_ledger.format.proofs import Applied, Finding, ProofRecord
from titan_ledger.rehearsal.faults import response_fault


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


@dataclass
class _Case:
    """One proof's working state, which its steps (``Prover._prove``) fill in order."""

    rec: Any
    again: Reexecution
    first_grads: Any  # the first execution's gradients (in the step) or what a deferral kept
    original: Execution  # the first execution, gathered
    groups: list  # the step's batches
    detector: Any  # the run's spike detector (its history judges every execution)
    rtol: float
    factor: float
    repeats: list = field(default_factory=list)  # the same batch again (one, or two)
    distances: list | None = None  # the executions' noise, where no two agree bit for bit
    adam: dict | None = None  # Adam's check
    suspect: Suspect | None = None
    ctrl: Suspect | None = None
    c_groups: list | None = None  # the batches with the control's data masked
    control: Execution | None = None
    masked: Execution | None = None
    hits: list = field(default_factory=list)  # this rank's masked segments of the suspect
    tags_by_dp: dict = field(default_factory=dict)
    after: list = field(default_factory=list)  # executions after the verdict (a convicted control, group testing)
    bisection: Any = None
    everywhere: bool = False  # the convicted documents masked on every rank that holds them
    holders: list = field(default_factory=list)
    content: dict | None = None
    coverage: Coverage | None = None
    fragile: dict | None = None  # the LR's fingerprint where it held back a conviction
    checks: dict | None = None  # the conviction's content checks (near copies, stands out, seen before, novelty)


# --------------------------------------------------------------------------- the seam
class Prover:
    """Re-executes a flagged step of one ``LedgerTrainer`` (``Recovery`` asks it). A proof
    decides nothing about training: it returns its record (:meth:`prove`), and what the
    step applies is ``Recovery``'s (the ``act`` policy, the bounds), which then asks for
    it: :meth:`convict` (the quarantine and the step's masks) and :meth:`load_update` (the
    gradients of the update to apply)."""

    def __init__(self, host: Host, ledger: LedgerPort, facts: RunFacts, note_budget: NoteBudget | None = None, *,
                 proof: ProofConfig | None = None, adam: AdamCheckConfig | None = None,
                 conviction: ConvictionConfig | None = None) -> None:
        self.host, self.ledger, self.facts = host, ledger, facts
        self.faults = facts.faults  # --ledger.rehearsal.response_fault (the response's own failures, rehearsed)
        # the run's [ledger.proof], [ledger.adam_check] and [ledger.conviction] (Recovery passes them)
        self.proof = proof or ProofConfig()
        self.adam = adam or AdamCheckConfig()
        self.conviction = conviction or ConvictionConfig()
        self.note_budget = note_budget  # Recovery's: how many notes may be proven (None: every one)
        self.proofs = 0
        # what the gradients hold after the last proof (deferred decisions apply from them)
        self._rec = self._in_grads = None
        self._groups: dict[str, Any] = {}
        self._first_grads: list | None = None  # the first execution's gradients, by reference, when kept
        self._hits: list = []  # this rank's [row, segment] of the convicted documents (applied by convict)
        self._deadline = math.inf
        #: the step after the one proven, fetched (deferred decisions: ``Recovery`` sets it), else None
        self.next_rec = None
        #: steps whose update the model made abnormal with no data to blame (reproduced, abnormal, not
        #: bad data): the last MODEL_MADE_KEPT, checkpointed by ``Recovery`` (:meth:`_model_made`)
        self.model_made: list[int] = []

    @property
    def mode(self) -> str:
        return self.proof.scope

    def wanted(self, acting: bool, note: bool, step: int) -> bool:
        """Whether a step flagged so is proven: an acting flag unless ``[ledger.proof] scope = "off"``,
        a note with ``[ledger.proof] scope = "all"`` while the note budget allows (``Recovery.note_budget``)."""
        return (self.mode != ProveMode.OFF and acting) or (note and self.notes_allowed(step))

    def notes_allowed(self, step: int) -> bool:
        """Whether a note at ``step`` would be proven (asked before its flag is known, for
        the deferred hold; nothing spent)."""
        return self.mode == ProveMode.ALL and (self.note_budget is None or self.note_budget.allows(step))

    # ------------------------------------------------------------------ executions
    def release(self) -> None:
        """The decision is made: the proven step's record and batches (device tensors once
        executed) are not kept until the next proof."""
        self._rec = self._in_grads = None
        self._groups = {}
        self._first_grads = None
        self._hits = []

    def _params(self) -> list:
        return [p for m in self.host.model_parts for p in m.parameters()]

    def _run(self, variant: str, again: Reexecution, groups, first, prev: Execution | None = None) -> Execution:
        """One execution of the step on ``groups`` (``again``: the proof's re-execution
        context), gathered per rank;
        ``first``: the first execution's gradients (in the step) or its
        :class:`FirstExecution` (deferred), which ``equal`` is judged against; ``prev``: a
        second repeat's first repeat, compared by checksum (a fifth per-rank value). A
        variant that masks data (not ``same``) whose results are not finite fails the
        proof (:class:`ProofFailure`): a mask's update is judged by its numbers."""
        kind = response_fault(self.faults, "bisect" if variant == "bisect" else "proof")  # (rehearsal)
        if kind == "timeout":
            self._deadline = -math.inf
        check_deadline(self.ledger.topo.world, self.facts.device, self._deadline, "the proof", self.proof.timeout)
        t0 = time.perf_counter()
        params = self._params()
        loss, grad_norm, local_tokens, global_tokens = again.run(groups)
        self._in_grads = variant
        grads = [p.grad for p in params]
        psq, sums = _per_param_sq(grads, self.facts.device), _per_param_sum(grads, self.facts.device)
        if isinstance(first, FirstExecution):  # deferred: the first gradients are gone, their checksum is not
            equal = same_tensor(psq, first.psq) and same_tensor(sums, first.sums)
        else:
            equal = True
            for g0, g in zip(first, grads):
                if g0 is None or g is None:
                    equal = equal and (g0 is None) == (g is None)
                else:
                    equal = equal and same_tensor(local(g0), local(g))
        again = prev is None or (same_tensor(psq, prev.psq) and same_tensor(sums, prev.sums))
        ex = self._gathered(variant, loss_sum(loss, global_tokens), psq, local_tokens, equal, grad_norm,
                            seconds=time.perf_counter() - t0, again=again)
        ex.sums = sums
        if variant != Applied.SAME and kind == "nan":
            ex.loss = ex.grad_norm = math.nan  # (rehearsal: every rank alike)
        if variant != Applied.SAME and not (math.isfinite(ex.loss) and math.isfinite(ex.grad_norm)):
            raise ProofFailure(f"the {variant} execution's loss or grad norm was not finite "
                               f"({ex.loss}, {ex.grad_norm})")
        return ex

    def load_update(self, rec, applied: str) -> None:
        """Leave in the gradients the update ``applied`` names (``original``: the step as it
        was first executed -- its own gradients where they were kept, by reference, else
        executed again; ``same``: a repeat; ``masked``/``control``: the proof's mask;
        ``none``: nothing is applied), executing the step once more only when they are
        not already there."""
        if applied == Applied.NONE:
            return
        if applied == Applied.ORIGINAL and self._rec is rec and self._first_grads is not None:
            if self._in_grads != Applied.ORIGINAL:
                for p, g in zip(self._params(), self._first_grads):
                    p.grad = g
                self._in_grads = Applied.ORIGINAL
            return
        # the execution whose gradients stand for ``applied`` (the first's: a repeat's, equal)
        want = Applied.SAME if applied == Applied.ORIGINAL else applied
        if want is None or (self._rec is rec and self._in_grads == want):
            return
        groups = self._groups.get(want) if self._rec is rec else None
        with Reexecution(self.host, self.ledger, self.facts, rec, replaces=False) as again:
            again.run(groups if groups is not None else rec.batches)
        self._rec, self._in_grads = rec, want
        if rec.proof is not None:
            rec.proof.update_recomputed = want  # its gradients were gone: executed once more to apply it

    def abandon(self, rec) -> None:
        """A proof failed part-way: what its last execution left is taken back -- the
        per-step accumulators it refilled, the convicted documents' masks -- and the
        gradients go back to the first execution's where they were kept (else
        :meth:`load_update` executes the step again)."""
        self.ledger.discard_step_state()
        self._hits = []
        if self._rec is rec and self._first_grads is not None:
            for p, g in zip(self._params(), self._first_grads):
                p.grad = g
            self._in_grads = Applied.ORIGINAL
        else:
            self._in_grads = None

    def convict(self, rec, proof: ProofRecord) -> None:
        """Act on a ``bad_data`` proof (``Recovery``, when the policy and the bounds allow):
        the convicted documents quarantined for the rest of the run (every rank) and the
        step's masks recorded in its data row (the ranks whose rows held them)."""
        if self._rec is rec and self._hits:
            rec.masked.setdefault("proof", []).extend(self._hits)
        docs = [(s, int(d)) for s, d in proof.documents or []]
        if docs:
            self.ledger.quarantine_proven(sorted(docs), rec.step)

    def _bisect(self, again: Reexecution, rec, groups, first_grads, original: Execution, sizes: dict,
                balance: float | None):
        """Group testing over the step's documents (``sizes``: tokens per document, every
        DP rank's or the convicted rank's): each round masks one half on every rank that
        holds its segments, then the other half as its control
        (``verdict.bisect_documents``; ``balance``: its size rule, None inside a rank an
        equal-size mask already convicted). Returns the bisection and its executions
        (variant ``bisect``)."""
        from torchtitan.components.loss import IGNORE_INDEX

        detector = self.ledger.detector
        mine = self.ledger.topo.dp_rank
        trail: list[Execution] = []

        def normal_without(docs) -> bool:
            masked = mask_labels(groups, rec.tags, Suspect(mine, frozenset(docs)), IGNORE_INDEX)[0]
            ex = self._run("bisect", again, masked, first_grads)
            ex.normal = normal_update(detector, ex.loss, ex.grad_norm, original.loss)
            trail.append(ex)
            return ex.normal

        return bisect_documents(sizes, normal_without, balance), trail

    def _distances(self, executions: list[Execution]) -> list[list[float]]:
        """Per global rank, the three executions' pairwise distances ``[d(0,1), d(0,2),
        d(1,2)]`` (:func:`local_distance`; one all-gather, a proof whose executions all
        differed only)."""
        import torch.distributed as dist

        topo = self.ledger.topo
        me = dist.get_rank() if dist.is_initialized() else 0
        a, b, c = executions
        loc = torch.tensor([local_distance(a, b, me), local_distance(a, c, me), local_distance(b, c, me)],
                           dtype=torch.float64, device=self.facts.device)
        if topo.world == 1:
            return [loc.tolist()]
        table = torch.empty(topo.world * 3, dtype=torch.float64, device=self.facts.device)
        dist.all_gather_into_tensor(table, loc)
        return table.view(topo.world, 3).tolist()

    def _gathered(self, variant: str, loss_sum, psq, local_tokens: int, equal: bool, grad_norm,
                  seconds: float = 0.0, again: bool = True) -> Execution:
        """One execution's per-rank ``[loss sum, grad sum of squares, tokens, equal, again]``
        (``again``: equal to the previous repeat), to every rank (one all-gather: a proven
        step only)."""
        import torch.distributed as dist

        topo = self.ledger.topo
        f64 = {"dtype": torch.float64, "device": self.facts.device}
        own = loss_sum.detach().double().reshape(()) if (loss_sum is not None and topo.owns_loss) else \
            torch.zeros((), **f64)
        grad_sq = psq.sum() if psq.numel() else torch.zeros((), **f64)
        loc = torch.stack([own, grad_sq, torch.tensor(float(local_tokens) if topo.owns_tokens else 0.0, **f64),
                           torch.tensor(1.0 if equal else 0.0, **f64), torch.tensor(1.0 if again else 0.0, **f64)])
        if topo.world > 1:
            table = torch.empty(topo.world * 5, **f64)
            dist.all_gather_into_tensor(table, loc)
            table = table.view(topo.world, 5)
        else:
            table = loc.view(1, 5)
        ranks = table.tolist()
        return Execution(variant, mean_loss(ranks), float(_full(grad_norm)), ranks, seconds=seconds,
                         clip_coef=self._coef(grad_norm), psq=psq)

    def _coef(self, grad_norm) -> float:
        """torchtitan's clip factor for this norm (``clip_grads_with_norm_``)."""
        max_norm = float(self.facts.max_norm)
        g = float(_full(grad_norm))
        return min(1.0, max_norm / (g + 1e-6)) if max_norm > 0 and math.isfinite(g) else 1.0

    # ------------------------------------------------------------------ Adam first, content
    def _adam_check(self) -> dict[str, Any] | None:
        """The step's Adam update recomputed from the gradients now in place (a repeat that
        reproduced the first execution) with the second moment restored to its long-run
        level (``optimizer_state``'s module): ``{"amplification", "restore", ...}``, all
        ranks summed (one all-reduce); None when off, before any applied update, or when
        no parameter has Adam's state yet."""
        import torch.distributed as dist

        t = self.host
        ledger = self.ledger
        bar = float(self.adam.ratio)
        ratio, owned = ledger.adam_ratio(), ledger.owned_params()
        if bar <= 0 or ratio is None or owned is None:
            return None
        restore = max(1.0, ratio) if math.isfinite(ratio) else 1e12
        where = {id(p): (o, g) for o in t.optimizers.optimizers for g in o.param_groups for p in g["params"]}
        entries = []
        for p in owned:  # owned pieces: every logical element once
            og = where.get(id(p))
            if p.grad is None or og is None:
                continue
            o, g = og
            st = o.state.get(p) or {}
            if "exp_avg_sq" not in st or g.get("betas") is None:
                continue
            step = st.get("step", 0)
            entries.append(AdamEntry(local(p.grad), local(st["exp_avg"]), local(st["exp_avg_sq"]),
                                     float(step.item() if isinstance(step, torch.Tensor) else step),
                                     float(g["betas"][0]), float(g["betas"][1]), float(g.get("eps", 1e-8))))
        if ledger.topo.world == 1 and not entries:
            return None
        norms = update_norms(entries, restore, self.facts.device)
        if ledger.topo.world > 1:
            dist.all_reduce(norms)
        n = norms.tolist()
        if n[0] <= 0.0:
            return None
        return {"amplification": round(amplification(n[2:]), 4), "amplification_step": round(amplification(n[:2]), 4),
                "restore": round(ratio, 4) if math.isfinite(ratio) else None,
                "bar": bar, "horizon": int(self.adam.horizon)}

    def _content(self, docs) -> dict:
        """(tokens, content digest) of each document (the corpus's, read back by the
        loader; None where it cannot be): the content control and the quarantine bound."""
        loader = self.ledger.loader
        return {d: (loader.document_facts(*d) if loader is not None else None) for d in docs}

    # ------------------------------------------------------------------ the proof
    def prove(self, rec, *, acting: bool, event: dict[str, Any], first: FirstExecution | None = None
              ) -> ProofRecord:
        """Prove the flagged step ``rec`` (its first execution as ``Ledger.record`` saw
        it; ``first``: what a deferred decision kept of it). Returns the proof record (the
        ``proof`` of the step's spike event) with ``verdict`` and ``applied``, the update
        the verdict calls for; nothing about training is changed (``Recovery`` decides
        and asks :meth:`convict` and :meth:`load_update`). Raises when the proof cannot be
        completed (:class:`ProofFailure`, or what an execution raised): ``Recovery`` then
        calls :meth:`abandon` and decides without it."""
        import torch.distributed as dist

        t = self.host
        start = time.perf_counter()
        self._deadline = start + float(self.proof.timeout)
        with Reexecution(t, self.ledger, self.facts, rec, replaces=False) as again:
            out = self._prove(rec, again, acting=acting, event=event, first=first)
        out.seconds = round(time.perf_counter() - start, 4)
        if dist.is_initialized():
            dist.barrier()  # every rank leaves the proof together (its collectives are done)
        return out

    def _prove(self, rec, again: Reexecution, *, acting: bool, event: dict[str, Any],
               first: FirstExecution | None) -> ProofRecord:
        """The proof's steps in order, each on the one :class:`_Case`: the first execution
        and its repeats (reproduced?), Adam first, the suspect's data against a control,
        a control convicted instead, group testing, the conviction's checks, the record."""
        case = self._first_execution(rec, again, first)
        ok = self._repeat(case)
        v = self._ask_adam(case) if ok and not case.original.normal and case.repeats[-1] is case.repeats[0] \
            else None
        if ok and v is None:
            self._suspect_with_control(case, event)
        if v is None:
            v = judge(case.original, case.repeats, case.masked, case.control, case.rtol,
                      suspect=case.suspect is not None, distances=case.distances, noise_factor=case.factor)
        if v.applied == Applied.CONTROL:
            self._control_convicted(case)
        v = self._group_test(case, v)
        if first is not None and v.verdict == Finding.HARDWARE and v.applied == Applied.ORIGINAL \
                and self._first_grads is None:
            self._in_grads = None  # the last repeat may be the odd one: executed again if applied
        if v.verdict in (Finding.NOT_DATA, Finding.OPTIMIZER_STATE) and ok and not case.original.normal:
            # the model (or Adam's state) made this update abnormal, no data to blame: remembered, so a later
            # conviction of data that does not stand out is asked whether the model is the cause (_model_made)
            self.model_made = [*self.model_made, int(rec.step)][-MODEL_MADE_KEPT:]
        if v.verdict == Finding.BAD_DATA and case.suspect is not None:
            v = self._check_conviction(case, v)
        self.proofs += 1
        return self._record(case, v, acting)

    def _first_execution(self, rec, again: Reexecution, first: FirstExecution | None) -> _Case:
        """The flagged step's first execution, gathered over the ranks and judged against
        the run's history (in the step: its gradients by reference; deferred: what was kept)."""
        ledger = self.ledger
        if first is None:  # in the step: the first gradients, by reference (each execution gets fresh tensors)
            first_grads = [p.grad for p in self._params()]
            loss_sum, local_tokens, grad_norm = ledger.last_execution
            psq = _per_param_sq(first_grads, self.facts.device)
            self._first_grads = first_grads
        else:
            first_grads = first
            loss_sum, local_tokens, grad_norm, psq = first.loss_sum, first.local_tokens, first.grad_norm, first.psq
            self._first_grads = first.grads  # (kept where they cost nothing: the CPU)
        self._rec, self._in_grads, self._groups, self._hits = rec, Applied.ORIGINAL, {Applied.SAME: rec.batches}, []
        original = self._gathered(Applied.ORIGINAL, loss_sum, psq, local_tokens, True, grad_norm)
        detector = ledger.detector
        original.normal = normal_update(detector, original.loss, original.grad_norm)
        return _Case(rec=rec, again=again, first_grads=first_grads, original=original, groups=rec.batches,
                     detector=detector, rtol=float(self.proof.rtol),
                     factor=float(self.proof.noise_factor))

    def _repeat(self, case: _Case) -> bool:
        """The same batch again (a third time where the first two differ, and the noise
        measured where all three do): whether the step reproduced."""
        c = case
        c.repeats = [self._run(Applied.SAME, c.again, c.groups, c.first_grads)]
        if differing_ranks(c.original, c.repeats[0], c.rtol):
            c.repeats.append(self._run(Applied.SAME, c.again, c.groups, c.first_grads, prev=c.repeats[0]))
            if differing_ranks(c.repeats[0], c.repeats[1], c.rtol) and differing_ranks(c.original, c.repeats[1],
                                                                                       c.rtol):
                c.distances = self._distances([c.original, *c.repeats])  # not bit-reproducible: measure the noise
        return reproduced(c.original, c.repeats, c.rtol, c.distances, c.factor)[0]

    def _ask_adam(self, case: _Case) -> Verdict | None:
        """Adam first (the gradients in place are the first execution's, reproduced): the
        update recomputed under a healthy second moment; ``optimizer_state`` when that
        alone makes it normal."""
        case.adam = self._adam_check()
        if case.adam is None:
            return None
        return optimizer_verdict(case.adam["amplification"], float(self.adam.ratio),
                                 case.adam["restore"] or 1.0)

    def _suspect_with_control(self, case: _Case, event: dict[str, Any]) -> None:
        """The data the flag points at (a rank's batch, its standing-out documents) and a
        control of as much other data: each masked in an execution of its own."""
        from torchtitan.components.loss import IGNORE_INDEX

        c = case
        ledger = self.ledger
        topo = ledger.topo
        c.tags_by_dp = _gather_tags(c.rec.tags if topo.data_writer else None, topo)
        summaries = _gather_by_dp(ledger.step_documents() if topo.owns_tokens else None, topo)
        fired = [*event.get("rules", []), *event.get("notes", [])]
        rank = next((event.get(k) for r, k in (("doc_high", "doc_high_rank"), ("doc_low", "doc_low_rank"))
                     if r in fired and event.get(k) is not None), None)
        c.suspect = name_suspect(event, ledger.last_dp_loss(),
                                 summaries.get(int(rank)) if rank is not None else None,
                                 c.tags_by_dp.get(int(rank)) if rank is not None else None,
                                 float(self.facts.spike.doc_outlier_floor))
        if c.suspect is not None:
            c.ctrl = control_of(c.suspect, topo.dp_size, c.tags_by_dp)
        if c.suspect is None or c.ctrl is None or c.original.normal:
            return
        mine = topo.dp_rank
        c.c_groups = mask_labels(c.groups, c.rec.tags, c.ctrl, IGNORE_INDEX)[0] if c.ctrl.dp_rank == mine \
            else c.groups
        c.control = self._run(Applied.CONTROL, c.again, c.c_groups, c.first_grads)
        c.control.normal = normal_update(c.detector, c.control.loss, c.control.grad_norm, c.original.loss)
        if c.suspect.dp_rank == mine:
            m_groups, c.hits = mask_labels(c.groups, c.rec.tags, c.suspect, IGNORE_INDEX)
        else:
            m_groups = c.groups
        c.masked = self._run(Applied.MASKED, c.again, m_groups, c.first_grads)
        c.masked.normal = normal_update(c.detector, c.masked.loss, c.masked.grad_norm, c.original.loss)
        self._groups.update(masked=m_groups, control=c.c_groups)

    def _control_convicted(self, case: _Case) -> None:
        """The control's data convicted, not the suspect's: its update executed again (no
        gradients kept), and the two swap places."""
        from torchtitan.components.loss import IGNORE_INDEX

        c = case
        convicted = self._run(Applied.CONTROL, c.again, c.c_groups, c.first_grads)
        convicted.normal = normal_update(c.detector, convicted.loss, convicted.grad_norm, c.original.loss)
        c.after.append(convicted)
        c.suspect, c.ctrl = c.ctrl, c.suspect
        c.hits = mask_labels(c.groups, c.rec.tags, c.suspect, IGNORE_INDEX)[1] \
            if c.suspect.dp_rank == self.ledger.topo.dp_rank else []

    def _group_test(self, case: _Case, v: Verdict) -> Verdict:
        """Group testing (``[ledger.proof] bisect``): where the step is abnormal and no document is
        named yet, halves of the step's documents masked round by round; the documents
        whose mask alone brings the update back are convicted, their update in place."""
        from torchtitan.components.loss import IGNORE_INDEX

        c = case
        topo = self.ledger.topo
        sizes = _documents(c.tags_by_dp, None if v.verdict == Finding.NOT_DATA or c.suspect is None
                           else c.suspect.dp_rank)
        if not (self.proof.bisect and len(sizes) > 1 and not c.original.normal and (
                v.verdict == Finding.NOT_DATA or (v.verdict == Finding.BAD_DATA and c.suspect is not None
                                                  and c.suspect.docs is None))):
            return v
        # searching the whole step, the halves are each other's only control: the size rule
        # (BISECT_BALANCE); inside a rank whose whole batch an equal-size mask (the other
        # rank's) already convicted, the rounds only narrow it down
        c.bisection, trail = self._bisect(c.again, c.rec, c.groups, c.first_grads, c.original, sizes,
                                          BISECT_BALANCE if v.verdict == Finding.NOT_DATA else None)
        c.after.extend(trail)
        if c.bisection.documents:
            docs = c.bisection.documents
            m_groups, c.hits = mask_labels(c.groups, c.rec.tags, Suspect(topo.dp_rank, docs), IGNORE_INDEX)
            # the convicted set's update, in place (its own name: ``masked`` stays the rank
            # mask's execution, which the record lists before the bisection's)
            in_place = self._run(Applied.MASKED, c.again, m_groups, c.first_grads)
            in_place.normal = normal_update(c.detector, in_place.loss, in_place.grad_norm, c.original.loss)
            c.after.append(in_place)
            self._groups[Applied.MASKED] = m_groups
            c.holders = sorted(dp for dp, tags in c.tags_by_dp.items() if set(document_tokens(tags or [])) & docs)
            c.suspect, c.everywhere = Suspect(c.holders[0] if c.holders else 0, docs, "bisection"), True
            searched = len(c.bisection.path[0]["a"] | c.bisection.path[0]["b"])
            return Verdict(Finding.BAD_DATA, Applied.MASKED,
                           why=f"group testing: masking {len(docs)} of the step's {searched} documents brings the "
                               f"update back to normal; masking the other half, at every round, does not")
        if v.applied in (Applied.MASKED, Applied.CONTROL):  # a whole rank stands: its update in place again
            rerun = self._run(v.applied, c.again, self._groups[v.applied], c.first_grads)
            rerun.normal = normal_update(c.detector, rerun.loss, rerun.grad_norm, c.original.loss)
            c.after.append(rerun)
        return v

    def _check_conviction(self, case: _Case, v: Verdict) -> Verdict:
        """Data convicted: harmful, not merely new, a copy, or in a broken model (issue 68).
        Not where a near-copy of its content trained beside it, where the run is unstable
        as a whole or its LR made it fragile, where content like theirs trained before
        without a flag, where the model made an update abnormal with no data to blame within
        the look-back and the documents' loss does not stand out from the rest's (a model a
        high LR broke spikes on ordinary text), nor where the data of the same novelty --
        the next step's, the convicted content masked, on the same weights -- is abnormal
        too; otherwise its masks are kept for :meth:`convict`. Without a next step to ask (a
        decision made in the step; a next step that is the convicted document itself), data
        harder than the rest of its step is not convicted -- a new kind of text is harder, and
        so is garbage, and without the data of the same novelty they cannot be told apart --
        while data easier than the rest (repeated, degenerate: no shift makes text easier) is;
        where neither can be measured the conviction stands unacted (``novelty``). The
        quarantine's coverage is measured either way. The documents' own loss against the
        rest of the step's (``content.stands_out``) is no bar by itself: a cold model gives
        everything the same loss -- the tour's injected batch of one repeated token trained
        at 7.63 against the step's 7.64 at step 10, and is bad data all the same."""
        from titan_ledger.components.response import content_checks as cc
        from titan_ledger.data.content import NEAR

        c = case
        ledger = self.ledger
        docs = c.suspect.docs
        if docs is None:  # the whole batch of the suspect rank: its documents
            docs = frozenset(document_tokens(c.tags_by_dp.get(c.suspect.dp_rank) or []))
        c.suspect = replace(c.suspect, docs=frozenset(docs))
        every = set(_documents(c.tags_by_dp, None))
        c.content = self._content(sorted(every))
        here = sum(n for d, n in _documents(c.tags_by_dp, None).items() if d in docs)
        c.coverage = self._coverage(sorted(docs), c.content, c.tags_by_dp)
        before = (c.coverage.ahead or {}).get("before_clean", 0) if c.coverage.ahead else 0
        conv = cc.convicted_shingles(c.groups, c.rec.tags, docs, ledger.topo)
        shared = cc.shared_shares(c.groups, c.rec.tags, conv, ledger.topo, self.facts.device)
        copies = sorted(d for d, x in shared.items() if x >= NEAR)
        c.checks = {"near_copies": {f"{s}:{d}": round(x, 3) for (s, d), x in shared.items()}}
        if copies:  # the control must be other content: a copy of it trained normally beside it
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but a near-copy of {len(copies)} of the {len(docs)} convicted documents "
                               f"(>= {NEAR:.0%} of their token shingles) trained unmasked in this step: masking them "
                               f"explains nothing a mask of their copies would not")
        if unstable := self._unstable(c.rec.step):  # the run flags step after step: its fragility, not data
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the run flagged {unstable} of the {UNSTABLE_WINDOW} steps before this "
                               f"one: unstable as a whole, a document that triggers a step in it is not proven bad "
                               f"(--ledger.conviction.unstable_flags {self.conviction.unstable_flags})")
        if not self.conviction.fragile and (fragile := self._fragile()) is not None:
            # the LR's fingerprint holds: every update moves the weights so far that masking
            # any data changes the step; a document that triggers it is not proven bad
            c.fragile = fragile
            moved = fragile.get("relative_update_pre_median") or fragile.get("param_norm_change_pre_median") or 0
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the LR's fingerprint holds (the updates moved the weights {moved:.1%} "
                               f"of their norm a step): in a run the LR made this fragile, a document that triggers "
                               f"a step is not proven bad (--ledger.conviction.fragile to convict anyway)")
        applied = self._convicted_execution(c, v)
        if applied is not None:  # their own loss against the rest of the step's (recorded; not a bar: below)
            theirs, rest, y = stands_out(c.original, applied)
            c.checks["stands_out"] = {"loss": _r(theirs), "rest": _r(rest), "log_ratio": _r(y)}
        seen = cc.seen_shares(ledger.content, conv, c.rec.step, ledger.flagged_steps(), ledger.topo, self.facts.device)
        c.checks["seen_before"] = {f"{s}:{d}": round(x, 3) for (s, d), x in seen.items()}
        if seen and all(x >= NEAR for x in seen.values()):
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but content like the convicted documents' (>= {NEAR:.0%} of their token "
                               f"shingles) trained in earlier steps without a flag: their content is not what made "
                               f"this step abnormal")
        if before >= here > 0:  # the same documents trained before, as much of them, without a flag
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the convicted documents trained {before} tokens in earlier steps "
                               f"without a flag ({here} here): what made this step abnormal is not their content")
        y = (c.checks.get("stands_out") or {}).get("log_ratio")
        made = self._model_made(c.rec.step)
        if made is not None:
            c.checks["model_made"] = {"step": made}
        if made is not None and y is not None and abs(y) < ORDINARY_LOSS:
            # a model that spikes on its own, and documents it finds no harder or easier than the rest: the
            # step hangs on them, but nothing in them is what a harmful document's loss shows
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the model made an abnormal update with no data to blame at step {made}, "
                               f"and the documents' loss is ordinary ({math.exp(y):.2f}x the rest's): in a model that "
                               f"spikes on its own, data that does not stand out is not proven bad")
        novel = self._novelty(c, docs, conv)
        if novel is not None and not novel.normal:
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the next step's data, the convicted content masked, is abnormal on "
                               f"the same weights too (grad norm {novel.grad_norm:.3g}): the data of the same "
                               f"novelty is as abnormal -- new data, not bad data")
        if novel is None and y is not None and y > 0:
            # no data of the same novelty to ask, and the documents are harder than the rest: a new kind of
            # text is, and so is garbage -- they cannot be told apart here (repeated, degenerate content is
            # easier than the rest, and no shift makes text easier)
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but no data of the same novelty was there to ask "
                               f"({c.checks['novelty']['why']}), and the documents are harder than the rest "
                               f"(loss {math.exp(y):.2g}x): new data and bad data cannot be told apart without it")
        if c.everywhere or c.suspect.dp_rank == ledger.topo.dp_rank:
            self._hits = c.hits  # applied only if the step acts on the conviction (convict)
        return v

    @staticmethod
    def _convicted_execution(c: _Case, v: Verdict) -> Execution | None:
        """The execution with exactly the convicted documents masked: group testing's in-place
        run, the suspect's mask, or a convicted control's re-run."""
        if v.applied == Applied.MASKED and c.bisection is not None and c.bisection.documents:
            return next((e for e in reversed(c.after) if e.variant == Applied.MASKED), None)
        if v.applied == Applied.CONTROL:
            return next((e for e in reversed(c.after) if e.variant == Applied.CONTROL), None)
        return c.masked

    def _novelty(self, c: _Case, docs, conv: dict) -> Execution | None:
        """The control of the same novelty (issue 68): the next step's batches -- fetched
        before a deferred decision is made, on every rank -- with the convicted content
        masked, executed on the weights the flagged step saw (its update is held), judged
        by the run's rules. None where there is no next step (a decision made in the step):
        the conviction then stands without acting (``novelty``)."""
        from torchtitan.components.loss import IGNORE_INDEX

        from titan_ledger.components.response import content_checks as cc

        nxt = self.next_rec
        if nxt is None or not nxt.batches:
            c.checks["novelty"] = {"available": False,
                                   "why": "decided in the step: the next step's data was not fetched yet"}
            return None
        groups, hits = cc.masked_next(nxt.batches, nxt.tags, docs, conv, IGNORE_INDEX)
        if not cc.any_label(groups, self.ledger.topo, self.facts.device):
            c.checks["novelty"] = {"available": False, "why": f"the next step ({nxt.step}) is the convicted content "
                                                              f"itself: nothing else to compare with"}
            return None
        ex = self._run("novelty", c.again, groups, c.first_grads)
        ex.normal = normal_update(c.detector, ex.loss, ex.grad_norm)
        c.after.append(ex)
        c.checks["novelty"] = {"available": True, "step": nxt.step, "normal": ex.normal,
                               "grad_norm": round(ex.grad_norm, 6), "loss": round(ex.loss, 6),
                               "masked_segments": hits}
        return ex

    def _record(self, case: _Case, v: Verdict, acting: bool) -> ProofRecord:
        """The proof record (the ``proof`` of the step's spike event, :meth:`ProofRecord.to_json`)."""
        c = case
        executions = [c.original, *c.repeats, *(e for e in (c.control, c.masked) if e is not None), *c.after]
        out = ProofRecord(verdict=v.verdict, applied=v.applied, why=v.why, acting=acting,
                          executions=[e.to_json() for e in executions], optimizer=c.adam, fragile=c.fragile)
        if v.verdict == Finding.HARDWARE and not math.isfinite(c.original.grad_norm):
            named = v.ranks and all(not math.isfinite(c.original.ranks[r][1]) for r in v.ranks) and \
                len(v.ranks) < len(c.original.ranks)
            out.why += ("; the first execution's grad norm was not finite, so its clip zeroed every rank's "
                        "finite gradients: " + ("the faulty rank's were left non-finite" if named else
                                                "the ranks it changed cannot be told apart"))
        if v.noise is not None:  # the machine's execution noise, measured by this proof
            out.noise = noise_record(v.noise, c.factor, c.distances)
        if v.ranks:
            out.ranks = v.ranks
            out.dp_ranks = sorted({self.ledger.topo.dp_rank_of[r] for r in v.ranks})
        if c.suspect is not None:
            out.suspect = {"dp_rank": c.suspect.dp_rank, "evidence": c.suspect.evidence}
            if c.suspect.docs is not None:
                out.documents = [[s, int(d)] for s, d in sorted(c.suspect.docs)]
            if c.content is not None:
                out.coverage = c.coverage.to_json()
        if c.bisection is not None:  # the group testing's path: per round, each half and what masking it did
            out.bisection = c.bisection.to_json()
            if c.everywhere:
                out.suspect["dp_ranks"] = c.holders
        if c.checks:
            out.content = c.checks
        if c.ctrl is not None and c.control is not None:
            out.control = {"dp_rank": c.ctrl.dp_rank, "evidence": c.ctrl.evidence,
                           **({"documents": [[s, int(d)] for s, d in sorted(c.ctrl.docs)]} if c.ctrl.docs else {})}
        return out

    def _fragile(self) -> dict | None:
        """The LR's fingerprint in the rows written before this step (``diagnose``'s F2 over
        the last 20: the update >= 1% of the weights' norm a step, or without
        ``--ledger.update_norm`` the norm itself moving >= 0.2%): its reading, else None."""
        from titan_ledger.components.detection import fingerprints as fp

        rows = list(self.ledger.recent)[-20:]
        reading = {"update": fp.relative_update(rows, {})}
        if len(rows) >= 5 and fp.lr_scale(reading, fp.Bars()):
            return {"cause": "lr", **reading["update"]}
        return None

    def _model_made(self, step: int) -> int | None:
        """The latest step before ``step``, within the look-back (``[ledger.conviction]
        lookback``), whose update the model made abnormal with no data to blame, or None."""
        horizon = int(self.conviction.lookback)
        return next((s for s in reversed(self.model_made) if step - horizon <= s < step), None)

    def _unstable(self, step: int) -> int:
        """The flagged steps among the :data:`UNSTABLE_WINDOW` written before ``step`` when
        they reach ``unstable_flags`` (else 0): a run diverging as a whole."""
        bar = int(self.conviction.unstable_flags)
        if bar <= 0:
            return 0
        n = sum(1 for r in self.ledger.recent
                if r.get("spike") and step - UNSTABLE_WINDOW <= int(r.get("step", 0)) < step)
        return n if n >= bar else 0

    def _coverage(self, docs: list, content: dict, tags_by_dp: dict) -> Coverage:
        """How much of the data quarantining ``docs`` would mask (``bounds``), with --
        an indexed corpus, read in its order from the flagged step's first sample -- the
        next 1,000 steps (an emptied one?) and the 1,000 before (``before_clean``: their
        tokens in earlier steps this process did not flag)."""
        from titan_ledger.data.layout import round_start

        ledger = self.ledger
        loader = ledger.loader
        sizes = {d: (content.get(d) or (None, None))[0] for d in docs}
        shares = {d: (loader.corpus_share(d[0], sizes[d]) if loader is not None and sizes[d] is not None else None)
                  for d in docs}
        seq_len = int(self.facts.seq_len)
        gb = ledger.global_batch
        step_tokens = gb * seq_len
        ahead = None
        first = next(((dp, tags[0]) for dp, tags in sorted(tags_by_dp.items()) if tags), None)
        if loader is not None and hasattr(loader, "scan") and first is not None:
            start = round_start(first[1].sample_id, first[0], int(self.facts.local_batch_size))
            ahead = loader.scan(set(docs), start, 1000, gb)
            back = min(1000, start // gb) if gb else 0
            behind = loader.scan(set(docs), start - back * gb, back, gb) if back else None
            if ahead is not None:
                ahead["before_clean"] = sum(n for k, n in (behind or {}).get("with", [])
                                            if start - (back - k) * gb not in ledger.flagged_at)
        # read as it streams (text, hf), a DP rank's rows are its own documents': one document
        # can fill a step only at DP 1
        lone = step_tokens if ledger.topo.dp_size == 1 else None
        return quarantine_coverage(docs, sizes, shares, step_tokens, float(self.conviction.max_share),
                                   ahead=ahead, lone_doc_step=lone)


#: the steps before a conviction whose flags say whether the run is unstable as a whole
#: (``--ledger.conviction.unstable_flags``; the ledger keeps the last 64 rows written)
UNSTABLE_WINDOW = 64
#: how many model-made abnormal steps the prover remembers (only the latest within the look-back is asked)
MODEL_MADE_KEPT = 64
#: documents whose loss is within this log ratio of the rest of their step's "do not stand out": the
#: broken-LR runs' convictions of ordinary docstrings were 0.03-0.09 (1.03-1.09x); the zoo's planted
#: documents -0.59 to +0.19 (0.55-1.20x), one of six within it (bad_data_ngram_b, 0.95x: convicted
#: because its model never spiked on its own) (bench/adversarial.py broken_lr_text; bench/zoo.py, issue 68)
ORDINARY_LOSS = 0.15


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


def _documents(tags_by_dp: dict[int, list], dp_rank: int | None) -> dict:
    """Tokens per (source, doc) in the step: every DP rank's rows, or ``dp_rank``'s."""
    pool = tags_by_dp if dp_rank is None else {dp_rank: tags_by_dp.get(dp_rank) or []}
    sizes: dict = {}
    for tags in pool.values():
        for d, n in document_tokens(tags or []).items():
            sizes[d] = sizes.get(d, 0) + n
    return sizes


def _full(g) -> torch.Tensor:
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _gather_by_dp(value, topo) -> dict[int, Any]:
    """One value per DP rank (from the rank that holds it; None elsewhere), to every rank."""
    import torch.distributed as dist

    every = [value]
    if topo.world > 1:
        every = [None] * topo.world
        dist.all_gather_object(every, value)  # a flagged step only
    out: dict[int, Any] = {}
    for r, v in enumerate(every):
        if v is not None:
            out.setdefault(topo.dp_rank_of[r], v)
    return out


def _gather_tags(tags, topo) -> dict[int, list]:
    return _gather_by_dp(list(tags) if tags is not None else None, topo)


def _r(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, 6)
