"""The judgment of a flagged step: proof, verdict, bounds, ladder -- is its update applied?

Design decision: ``Recovery`` (recovery.py) owns *when* a step is decided -- the five
protocol calls, the deferral a step late, the actions that move the run -- and this mixin
owns *what* the decision is, from the same parts (the prover, the window proof, the
ladder, the breaker, the note budget): a flagged step is proven
(``[ledger.proof] scope``); its verdict acts under ``[ledger.response] policy`` within the
bounds (the quarantine's size, a control of the same novelty, the circuit breaker); the
ladder answers an acting flag no proof resolved. A mixin, not a second object, because
both halves act on the one ``Recovery``'s parts (a test swaps ``recovery.prover`` and both
halves see it) and checkpoint them together (``Recovery.state_dict``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_ledger.components.response.config import ProveMode, ResponseConfig
from titan_ledger.components.response.ladder import Action, ladder_report
from titan_ledger.errors import LedgerStop
from titan_ledger.format.proofs import HARMFUL, Applied, Finding, ProofRecord, describe_proof

if TYPE_CHECKING:
    from titan_ledger.components.response.bounds import Breaker
    from titan_ledger.components.response.first_execution import FirstExecution
    from titan_ledger.components.response.host import Host, LedgerPort, RunFacts
    from titan_ledger.components.response.ladder import Ladder, NoteBudget
    from titan_ledger.components.response.prover import Prover
    from titan_ledger.components.response.rewind import Rewind
    from titan_ledger.components.response.window_proof import WindowProof
    from titan_ledger.components.signals.step_record import StepRecord


class Judgment:
    """Decides a flagged step (``Recovery`` mixes it in; its parts are ``Recovery``'s)."""

    host: Host
    ledger: LedgerPort
    facts: RunFacts
    response: ResponseConfig
    prover: Prover
    window: WindowProof
    ladder: Ladder
    breaker: Breaker
    note_budget: NoteBudget
    rewind: Rewind
    _stall: dict | None  # the stall event this step's forced proof answers
    _forced_now: bool  # the step being judged is a forced proof's, nothing flagged it

    def _judge(self, rec: StepRecord, acting: bool, note: bool, forced: bool,
               first: FirstExecution | None = None, decided_at: int | None = None) -> bool:
        """Is this step's update applied? A flagged step is proven first
        (``--ledger.proof.scope``); what its verdict changes is the policy's
        (``--ledger.response.policy``: observe changes nothing) within the bounds (the
        quarantine's size, the circuit breaker); the ladder acts on an acting flag no proof
        resolved. In the step, or deferred (``first``: what was kept of the first
        execution; the caller then loads the update, ``_resolve``)."""
        self._forced_now = forced and not (acting or note)  # (_say: a forced proof of an unflagged step)
        wanted = self.prover.wanted(acting, note, rec.step)
        if note and not acting and self.prover.mode == ProveMode.ALL and not wanted:
            rec.unproven = "budget"  # past the note budget: recorded, not proven
        if wanted and not acting:
            self.note_budget.spend(rec.step)  # a note's proof
        variant = Applied.ORIGINAL
        try:
            if wanted or forced:
                proof = self._proven(rec, acting, forced, first, decided_at)
                if proof is not None:
                    resolved, variant = self._act_on(rec, proof)
                    if resolved:
                        rec.update_skipped = variant == Applied.NONE
                        return variant != Applied.NONE
            if not (self.ladder.acts and acting):
                return True
            return self._ladder(rec, decided_at)
        finally:
            if first is None and decided_at is None and rec.proof is not None:
                self.prover.load_update(rec, variant)  # in the step: the gradients of what is applied

    def _proven(self, rec: StepRecord, acting: bool, forced: bool, first, decided_at) -> ProofRecord | None:
        """The step's proof (and its window proof), or None when it failed: then the state
        the proof touched is put back, the failure is recorded in the step's event
        (``proof_failed``), and the step is decided as it would be without a proof -- no
        failure inside the response stops training."""
        ledger = self.ledger
        event = ledger.recorded().event
        try:
            proof = self.prover.prove(rec, acting=acting, event=event, first=first)
        except Exception as e:
            self.prover.abandon(rec)
            rec.proof_failed = _failure("proof", e)
            self._warn(f"titan_ledger: step {rec.step}: the proof failed ({rec.proof_failed['error']}); the step "
                       f"is decided as without a proof, the state it touched put back")
            return None
        rec.proof = proof
        proof.decided_at = decided_at  # deferred: proven behind the next step's launch (None: in the step)
        proof.policy = self.response.policy
        stall, self._stall = self._stall, None
        if stall is not None:  # the stall rule's flag: which fix lowers the loss over the window
            proof.stall = {"step": stall["step"], "kind": stall["stall"]["kind"]}
        first_loss = proof.executions[0].get("loss") if proof.executions else None
        median, jump = event.get("loss_recent", event.get("loss_median")), float(self.facts.spike.loss_jump)
        flat = isinstance(first_loss, float) and isinstance(median, float) and first_loss <= (1 + jump) * median
        why_not = self.window.why_not(proof, forced, stall=stall is not None, flat=flat)
        if why_not is None:  # not the data: which cause, from the host snapshot's window
            prior = Finding.OPTIMIZER_STATE if proof.verdict == Finding.OPTIMIZER_STATE else None
            try:
                proof.window = self.window.prove(rec, stall=stall is not None, prior=prior)
            except Exception as e:
                proof.window = {"cause": None, **_failure("window", e)}
                self.ledger.discard_step_state()
        elif why_not:  # called for and not run: the answer says why (a budget, no snapshots, a flat loss)
            proof.window = {"cause": None, "why": why_not}
        return proof

    def _broken_since(self, agree: bool) -> int | None:
        """The model's health as the written rows read it: the onset of the broken stretch it is
        in (None: healthy). ``agree``: one value on every rank (each drains its rows on its own
        schedule; a conviction held back on one rank and acted on by another would part the
        replicas): the latest onset any rank knows, one all_reduce, only where data was convicted."""
        since = self.ledger.history().broken_since
        if not agree:
            return since
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return since
        t = torch.tensor([since if since is not None else -1], dtype=torch.int64, device=self.facts.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return None if int(t.item()) < 0 else int(t.item())

    def _act_on(self, rec: StepRecord, proof: ProofRecord) -> tuple[bool, Applied]:
        """What the proof's verdict changes: ``(resolved, variant)`` -- whether the proof
        resolved the step (else the ladder decides it) and the update applied (``original``,
        ``same``, ``masked``, ``control``, ``none``). Under ``observe``, or when a bound
        holds the verdict back (the quarantine's size, the breaker), nothing changes: the proof records ``would_apply`` and ``held_back``."""
        verdict, wants = proof.verdict, proof.applied
        broken = self._broken_since(agree=verdict == Finding.BAD_DATA)
        if broken is not None:  # the model's health: what a proof measured, it measured on a broken model
            proof.health = {"broken_since": broken}
        if verdict in (Finding.NOT_DATA, Finding.OPTIMIZER_STATE):
            self._say(rec, proof)
            return False, Applied.ORIGINAL  # no data or fault to act on: the ladder (and the window proof's cause)
        if verdict == Finding.OUTLIER or wants == Applied.ORIGINAL:
            self._say(rec, proof)
            return True, Applied.ORIGINAL
        held = None
        if self.response.policy == "observe":
            held = "observe"
        elif verdict == Finding.BAD_DATA and broken is not None:
            held = "unhealthy"  # data abnormal on a broken model: recorded, not acted on (format.answers.episodes)
        elif verdict == Finding.BAD_DATA and (proof.coverage or {}).get("refused"):
            held = "quarantine_bound"
        elif verdict == Finding.BAD_DATA and ((proof.content or {}).get("novelty") or {}).get("available") is False \
                and ((proof.content or {}).get("stands_out") or {}).get("log_ratio") is None:
            held = "novelty"  # no control of the same novelty, nor the data's loss against the rest: no action
        if held is None and not self._breaker_allows(rec.step):
            held = "breaker"
        if held is not None:
            proof.would_apply, proof.applied, proof.held_back = wants, Applied.ORIGINAL, held
            self._say(rec, proof)
            # observe: resolved, nothing done (its action is none); a bound: the ladder decides
            return held == "observe", Applied.ORIGINAL
        self.breaker.record(rec.step)
        if verdict == Finding.BAD_DATA:
            self.prover.convict(rec, proof)
        if wants not in (Applied.ORIGINAL, Applied.NONE):  # the rows record what trained: this execution
            applied = next((e for e in reversed(proof.executions) if e.get("variant") == wants), None)
            if applied is not None:
                self.ledger.trained_as(rec, applied)
        self._say(rec, proof)
        return True, wants

    def _breaker_allows(self, step: int) -> bool:
        """Whether the circuit breaker lets an action be taken at ``step``; a pause or a
        resumption is recorded (spikes.jsonl), a pause also said as one ERROR line and a
        W&B alert."""
        ok = self.breaker.allows(step)
        self._breaker_events(step)
        return ok

    def _breaker_events(self, step: int) -> None:
        """The breaker's pauses and resumptions, recorded (spikes.jsonl); a pause is also one
        ERROR line and, with W&B on, an alert (rank 0), a resumption one WARNING line."""
        from torchtitan.tools.logging import logger

        rank0 = self.facts.topo.is_rank0
        for ev in self.breaker.take_events():
            if ev["breaker"] != "paused":
                self.ledger.record_event(ev)
                self._warn(f"titan_ledger: acting resumed at step {step} (paused at step {ev['paused_at']}: "
                           f"{self.breaker.window} steps without an action)")
                continue
            line = (f"titan_ledger: the response is thrashing: {len(ev['actions'])} actions in "
                    f"{ev['window']} steps (steps {', '.join(map(str, ev['actions']))}; "
                    f"--ledger.breaker.actions {ev['limit']}); acting paused at step {step}, recording continues")
            if rank0:
                logger.error(line)
            self.ledger.record_event(ev, alert=("titan_ledger: acting paused", line) if rank0 else None,
                                     metrics_logger=self.facts.parts.metrics_logger)

    def _ladder(self, rec: StepRecord, decided_at: int | None) -> bool:
        """The recovery ladder's answer to an acting flag no proof resolved."""
        ledger = self.ledger
        rung, action = self.ladder.on_spike(rec.step)  # the recovery ladder decides
        if decided_at is not None:  # deferred: decided at that step, its update held until then
            action = {**action, "decided_at": decided_at}
        changes = rung is not None and rung.action not in (Action.NONE, Action.STOP)
        if changes and not self._breaker_allows(rec.step):
            ledger.record_event({**action, "held_back": "breaker", "ladder": True})  # (a ladder's row: "ladder")
            return True
        ledger.record_event({**action, "ladder": True})
        if rung is not None and rung.action == Action.NONE:
            return True
        rec.update_skipped = True
        if rung is None or rung.action == Action.STOP:
            # the ladder is exhausted (or says stop): write what is pending, then stop
            # with a one-screen report (exit 1)
            ledger.drain(block=True, metrics_logger=self.facts.parts.metrics_logger)
            raise LedgerStop(ladder_report(self.facts.folder, self.ladder, self.facts, self.response.action, action))
        self.breaker.record(rec.step)
        if rung.rolls_back:
            self.rewind.pending = rec.step
            if rung.lr is not None:
                self.rewind.lr_scale *= rung.lr  # kept across every later checkpoint load
        return False

    def _say(self, rec: StepRecord, proof: ProofRecord) -> None:
        """A proof's line, for a proof that is no incident (a note's that found nothing
        harmful, a ``--ledger.rehearsal.prove_at`` step's), at INFO: an incident's proof --
        an acting flag's, a note it promoted, a stall's -- is said once, in the incident's
        answer (``SpikeGuard.on_row``), not here as well."""
        from torchtitan.tools.logging import logger

        if not self.facts.topo.is_rank0:
            return
        promoted = proof.verdict in HARMFUL and not self._forced_now  # a note its proof convicted
        if proof.acting or promoted or proof.stall is not None:
            return
        logger.info(f"titan_ledger: step {rec.step}: {describe_proof(proof.to_json())}")

    def _load_late(self, rec: StepRecord) -> bool:
        """A held step's update, decided applied, loaded into the gradients (the next step's
        are there now). Loading it may execute the step again; if that fails, the update is
        withheld instead (what a ``skip_update`` does) and the failure recorded: no failure
        inside the response stops training. Returns whether it is applied."""
        try:
            self.prover.load_update(rec, rec.proof.applied if rec.proof is not None else Applied.ORIGINAL)
            return True
        except Exception as e:
            self.prover.abandon(rec)
            rec.update_skipped = True
            rec.proof_failed = rec.proof_failed or _failure("update", e)
            self._warn(f"titan_ledger: step {rec.step}: its held update could not be recomputed "
                       f"({_failure('update', e)['error']}); the update is withheld")
            return False

    def _response_failure(self, step: int, where: str, e: BaseException) -> None:
        """A failure inside the response outside a proof (a snapshot's copy, a restore): one
        warning and an event (spikes.jsonl); training goes on without that part."""
        failure = _failure(where, e)
        self._warn(f"titan_ledger: step {step}: the response's {where} failed ({failure['error']}); "
                   f"training goes on without it")
        self.ledger.record_event({"step": step, "response_failure": failure})

    def _warn(self, line: str) -> None:
        from torchtitan.tools.logging import logger

        if self.facts.topo.is_rank0:
            logger.warning(line)


def _failure(where: str, e: BaseException) -> dict:
    """What a failure inside the response records (the event's ``proof_failed``, a window's)."""
    return {"where": where, "error": f"{type(e).__name__}: {e}"[:500]}
