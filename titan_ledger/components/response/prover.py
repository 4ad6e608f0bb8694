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

What a deferred decision keeps of the first execution is :mod:`.first_execution`'s; what
follows data convicted -- group testing, the conviction's checks, the quarantine's
coverage -- is :mod:`.conviction`'s, which the prover builds and hands its executions, with
the proof's working state both fill (:class:`~.conviction.ProofCase`; one concern per file).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from titan_ledger.components.response.config import AdamCheckConfig, ConvictionConfig, ProofConfig, ProveMode
from titan_ledger.components.response.conviction import MODEL_MADE_KEPT, Conviction, ProofCase
from titan_ledger.components.response.first_execution import FirstExecution, _per_param_sq, _per_param_sum
from titan_ledger.components.response.host import Host, LedgerPort, RunFacts
from titan_ledger.components.response.ladder import NoteBudget
from titan_ledger.components.response.optimizer_state import AdamEntry, amplification, update_norms
from titan_ledger.components.response.reexecution import Reexecution, check_deadline
from titan_ledger.components.response.verdict import (
    Execution,
    Verdict,
    control_of,
    differing_ranks,
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
)
from titan_ledger.components.signals.sums import local, loss_sum
from titan_ledger.errors import ProofFailure
from titan_ledger.format.proofs import Applied, Finding, ProofRecord
from titan_ledger.rehearsal.faults import response_fault


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
        #: bad data): the last MODEL_MADE_KEPT, checkpointed by ``Recovery`` (``Conviction._model_made``)
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
        return [p for m in self.facts.parts.model_parts for p in m.parameters()]

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
        check_deadline(self.facts.topo.world, self.facts.device, self._deadline, "the proof", self.proof.timeout)
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

    def _distances(self, executions: list[Execution]) -> list[list[float]]:
        """Per global rank, the three executions' pairwise distances ``[d(0,1), d(0,2),
        d(1,2)]`` (:func:`local_distance`; one all-gather, a proof whose executions all
        differed only)."""
        import torch.distributed as dist

        topo = self.facts.topo
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

        topo = self.facts.topo
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

        ledger = self.ledger
        bar = float(self.adam.ratio)
        adam, owned = ledger.history().adam, self.facts.owned_params
        ratio = adam.ratio() if adam is not None else None
        if bar <= 0 or ratio is None or owned is None:
            return None
        restore = max(1.0, ratio) if math.isfinite(ratio) else 1e12
        where = {id(p): (o, g) for o in self.facts.parts.optimizers.optimizers for g in o.param_groups for p in g["params"]}
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
        if self.facts.topo.world == 1 and not entries:
            return None
        norms = update_norms(entries, restore, self.facts.device)
        if self.facts.topo.world > 1:
            dist.all_reduce(norms)
        n = norms.tolist()
        if n[0] <= 0.0:
            return None
        return {"amplification": round(amplification(n[2:]), 4), "amplification_step": round(amplification(n[:2]), 4),
                "restore": round(ratio, 4) if math.isfinite(ratio) else None,
                "bar": bar, "horizon": int(self.adam.horizon)}

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
        """The proof's steps in order, each on the one :class:`ProofCase`: the first execution
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
        v = self._convicting().group_test(case, v)
        if first is not None and v.verdict == Finding.HARDWARE and v.applied == Applied.ORIGINAL \
                and self._first_grads is None:
            self._in_grads = None  # the last repeat may be the odd one: executed again if applied
        if v.verdict in (Finding.NOT_DATA, Finding.OPTIMIZER_STATE) and ok and not case.original.normal:
            # the model (or Adam's state) made this update abnormal, no data to blame: remembered, so a later
            # conviction of data that does not stand out is asked whether the model is the cause (Conviction._model_made)
            self.model_made = [*self.model_made, int(rec.step)][-MODEL_MADE_KEPT:]
        if v.verdict == Finding.BAD_DATA and case.suspect is not None:
            conviction = self._convicting()
            v = conviction.check(case, v)
            if conviction.hits is not None:
                self._hits = conviction.hits  # applied only if the step acts on the conviction (convict)
        self.proofs += 1
        return self._record(case, v, acting)

    def _first_execution(self, rec, again: Reexecution, first: FirstExecution | None) -> ProofCase:
        """The flagged step's first execution, gathered over the ranks and judged against
        the run's history (in the step: its gradients by reference; deferred: what was kept)."""
        ledger = self.ledger
        if first is None:  # in the step: the first gradients, by reference (each execution gets fresh tensors)
            first_grads = [p.grad for p in self._params()]
            loss_sum, local_tokens, grad_norm = ledger.recorded().execution
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
        return ProofCase(rec=rec, again=again, first_grads=first_grads, original=original, groups=rec.batches,
                     detector=detector, rtol=float(self.proof.rtol),
                     factor=float(self.proof.noise_factor))

    def _repeat(self, case: ProofCase) -> bool:
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

    def _ask_adam(self, case: ProofCase) -> Verdict | None:
        """Adam first (the gradients in place are the first execution's, reproduced): the
        update recomputed under a healthy second moment; ``optimizer_state`` when that
        alone makes it normal."""
        case.adam = self._adam_check()
        if case.adam is None:
            return None
        return optimizer_verdict(case.adam["amplification"], float(self.adam.ratio),
                                 case.adam["restore"] or 1.0)

    def _suspect_with_control(self, case: ProofCase, event: dict[str, Any]) -> None:
        """The data the flag points at (a rank's batch, its standing-out documents) and a
        control of as much other data: each masked in an execution of its own."""
        from torchtitan.components.loss import IGNORE_INDEX

        c = case
        ledger = self.ledger
        topo = self.facts.topo
        c.tags_by_dp = _gather_tags(c.rec.tags if topo.data_writer else None, topo)
        recorded = ledger.recorded()
        summaries = _gather_by_dp(recorded.documents if topo.owns_tokens else None, topo)
        fired = [*event.get("rules", []), *event.get("notes", [])]
        rank = next((event.get(k) for r, k in (("doc_high", "doc_high_rank"), ("doc_low", "doc_low_rank"))
                     if r in fired and event.get(k) is not None), None)
        c.suspect = name_suspect(event, recorded.dp_loss,
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

    def _control_convicted(self, case: ProofCase) -> None:
        """The control's data convicted, not the suspect's: its update executed again (no
        gradients kept), and the two swap places."""
        from torchtitan.components.loss import IGNORE_INDEX

        c = case
        convicted = self._run(Applied.CONTROL, c.again, c.c_groups, c.first_grads)
        convicted.normal = normal_update(c.detector, convicted.loss, convicted.grad_norm, c.original.loss)
        c.after.append(convicted)
        c.suspect, c.ctrl = c.ctrl, c.suspect
        c.hits = mask_labels(c.groups, c.rec.tags, c.suspect, IGNORE_INDEX)[1] \
            if c.suspect.dp_rank == self.facts.topo.dp_rank else []

    def _convicting(self) -> Conviction:
        """The conviction's side of this proof (:mod:`.conviction`), built from the prover's state as it
        is now: ``model_made``, ``next_rec`` and the configs are set on the prover between proofs."""
        return Conviction(self.ledger, self.facts, self.proof, self.conviction, self._run, self._groups,
                          self.model_made, self.next_rec)

    def _record(self, case: ProofCase, v: Verdict, acting: bool) -> ProofRecord:
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
            out.dp_ranks = sorted({self.facts.topo.dp_rank_of[r] for r in v.ranks})
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
