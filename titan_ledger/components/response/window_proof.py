"""The window proof: the cause that is not the data, proven in process by intervention.

Design decision: the proof at the alarm (:mod:`.prover`) re-executes the flagged step and
answers "data or hardware?"; every other cause -- the learning rate, Adam's state, logit
growth, the output logits -- acted on the steps *before* it, so the step alone proves
nothing. From the oldest host snapshot (:mod:`.snapshots`) :class:`WindowProof` re-runs
the window to the flagged step in this process, through the trainer's own ``execute``
and ``optimizers.step()``: once unchanged (``same``, the control: it must reproduce the
flag) and once per candidate fix (``lr``: every step's LR x ``lr_factor``; ``adam``:
beta2 and epsilon; ``eps``: epsilon raised; ``logit_cap``: a soft cap on the attention
scores; ``zloss``: a z-loss weight). Each variant's flagged step is judged once, by one
judge (``verdict.window_effect``): the trainer's own acting rules against the run's
history, novelty gate included, and the share of the flagged signal's excess the fix left
(``removed`` / ``lowered`` / ``not removed``); each pays a cost: the loss over the window's
last steps against the unchanged re-run's.
:func:`~.verdict.window_verdict` names the cause whose own fix removed it, the cheapest
fix first (a stall: the fix that lowered the loss). What it touched -- parameters,
optimizer state, gradients, the groups' LR, betas and epsilon, the attention's cap and
the loss's z-loss weight -- is put back from a copy taken first
(:class:`~.snapshots.HostState`), and the record goes in ``proof["window"]``.

Its own module: the ring owns memory and restore (a rollback uses it without any proof);
the window proof owns the replay and the judgement. Every variant starts from the same
RNG state (:meth:`~.reexecution.Reexecution.rewind_rng`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_ledger.components.prevention.optimizer import set_group_lr
from titan_ledger.components.response.config import WindowConfig
from titan_ledger.components.response.host import Host, LedgerPort, RunFacts
from titan_ledger.components.response.reexecution import Reexecution, check_deadline
from titan_ledger.components.response.snapshots import HostState, SnapshotRing
from titan_ledger.components.response.verdict import flags_as_run, window_effect, window_verdict
from titan_ledger.components.signals.sums import loss_sum
from titan_ledger.components.signals.topology import Topology
from titan_ledger.errors import ProofFailure
from titan_ledger.format.answers.causes import WINDOW_CAUSE
from titan_ledger.format.proofs import Finding, ProofRecord
from titan_ledger.rehearsal.faults import response_fault

#: the window re-run with nothing changed (the reference every fix is measured against;
#: ``same`` in the record, as the in-step proof's repeat)
UNCHANGED = "same"
#: the window's control: every step's LR x ``control`` (> 1): a perturbation that is no fix
CONTROL = "control"


@dataclass
class _Window:
    """One window proof's re-runs share these: the flagged step (``rec``, its batches
    held), the snapshot they start from, the parameters and optimizers it restores, and
    what the first re-runs leave for the later ones."""

    rec: Any
    snap: Any
    params: list
    opts: list
    stall: bool
    detector: Any  # the run's spike detector (``flags_as_run``, ``window_effect`` judge by its bars)
    kept: list[list] = field(default_factory=list)  # each group's (betas, eps) as the run has them
    kept_loss: dict[int, float] = field(default_factory=dict)  # the unchanged re-run's loss per replayed step


def _costs(runs: list[dict], by: dict[str, dict]) -> float | None:
    """Each re-run's cost (its window's last losses against the unchanged re-run's), set in
    its row; returns the unchanged re-run's (None: not finite, or no steps to price)."""
    base = by[UNCHANGED]["loss_end"]
    for r in runs:
        r["cost"] = None if r["loss_end"] is None or base is None else round(r["loss_end"] - base, 6)
    return base


class WindowProof:
    """Re-runs the window before a ``not_data`` alarm with each candidate cause's variant
    (the module docstring); ``Recovery._judge`` asks it after the step's proof."""

    def __init__(self, host: Host, ledger: LedgerPort, facts: RunFacts, ring: SnapshotRing,
                 config: WindowConfig | None = None, timeout: float = 300.0) -> None:
        """``config``: the run's ``[ledger.window]``; ``timeout``: ``[ledger.proof] timeout``."""
        self.host, self.ledger, self.facts, self.ring = host, ledger, facts, ring
        self.config = config or WindowConfig()
        self.timeout = float(timeout)
        self.spent: list[int] = []  # the steps whose window proofs spent the budget (the answers name them)

    def wanted(self, proof: ProofRecord, forced: bool = False, stall: bool = False, flat: bool = False) -> bool:
        """Whether the window proof runs for this proof (:meth:`why_not` says nothing against it)."""
        return self.why_not(proof, forced, stall, flat) is None

    def why_not(self, proof: ProofRecord, forced: bool = False, stall: bool = False,
                flat: bool = False) -> str | None:
        """None when the window proof runs: within ``max_proofs``, an acting flag proven
        ``not_data`` or ``optimizer_state`` (which cause, then: Adam's variant proves the
        state by intervention) whose loss rose; data convicted (``bad_data``: does a
        variant remove the spike with the data unmasked as well? -- the real set's LR runs
        had documents convicted at steps where every update moved the weights 6% of their
        norm); or a step ``--ledger.rehearsal.prove_at`` names and its proof left standing
        (``not_data``, ``outlier``: the window replayed on a clean step, every
        parallelism's replay checked against the run). Else why not, in words for the
        answer (``""``: no window proof was called for). ``flat``: the step's loss did not
        rise past ``loss_jump`` over its window median (a grad-norm jump alone, or one on a
        falling loss): the budget is kept for a loss spike -- measured on the memorisation
        plateau (issue 67): a dip at step 123 and a grad-norm jump with the loss unmoved at
        429 spent the two window proofs (no fix removed the first; every fix and a control
        the second), and the largest loss spike, at 633, got none."""
        r, cfg = self.ring, self.config
        v = proof.verdict
        if stall:  # the stall rule's forced proof: its own budget, whatever the step's verdict
            if not r.on:
                return "the stall's window proof needs host snapshots (--ledger.snapshots.every)"
            return None if r.stall_proofs < cfg.max_stall_proofs else (
                f"the stall window-proof budget is spent (--ledger.window.max_stall_proofs {cfg.max_stall_proofs})")
        called = ((v in (Finding.NOT_DATA, Finding.OPTIMIZER_STATE) and proof.acting) or v == Finding.BAD_DATA
                  or (forced and v in (Finding.NOT_DATA, Finding.OUTLIER)))
        if not called:
            return ""
        if not r.on:
            return "no host snapshots to replay the window from (--ledger.snapshots.every 0)"
        if flat and v != Finding.BAD_DATA and not forced:
            return ("the loss did not rise (a grad-norm jump alone): the window-proof budget is kept for a loss "
                    "spike")
        if r.proofs >= cfg.max_proofs:
            spent = ", ".join(map(str, self.spent)) or "earlier steps"
            return (f"the window-proof budget is spent: {cfg.max_proofs} proof(s), at step(s) {spent} "
                    f"(--ledger.window.max_proofs)")
        return None

    def prove(self, rec, stall: bool = False, prior: str | None = None) -> dict[str, Any]:
        """The window proof of the flagged step ``rec`` (its batches still held): the
        record that goes in ``proof["window"]``. ``stall``: the stall rule flagged the run
        (no spike at ``rec``): a fix removes it when it lowers the window's last steps'
        loss by the rule's ``min_gain`` against the unchanged re-run's. ``prior``: the cause
        the step's proof measured (``optimizer_state``), which its own fix confirms
        (``verdict.window_verdict``).

        The steps: spend the budget; re-run the window once per variant
        (:meth:`_replay`, everything it touched put back); price each fix against the
        unchanged re-run (:func:`_costs`); judge (:meth:`_judge_stall` /
        :meth:`_judge_spike`); the record (:meth:`_record`)."""
        import torch.distributed as dist

        ring, cfg = self.ring, self.config
        snap = ring.window(rec.step, stall=stall)  # a stall: from its onset (the anchor), where pinned
        if snap is None:
            return {"cause": None, "why": f"no snapshot from which steps up to {rec.step} can be replayed "
                                          f"(--ledger.snapshots.every {ring.config.every}, keep {ring.config.keep})"}
        if stall:
            ring.stall_proofs += 1
        else:
            ring.proofs += 1
            self.spent.append(rec.step)
        ring.settle()
        start = time.perf_counter()
        params, opts = ring.tensors(), ring.optimizers()
        causes = [c for c in cfg.causes if (c != "adam" or self._changes_adam(opts))
                  and (c != "eps" or self._raises_eps(opts)) and (c != "zloss" or self._loss() is not None)
                  and (c != "logit_cap" or self._attention())]
        w = _Window(rec, snap, params, opts, stall, self.ledger.detector)
        runs = self._replay(w, causes, deadline=start + self.timeout)
        by = {r["variant"]: r for r in runs}
        base = _costs(runs, by)
        if stall:
            cause, why, fixes = self._judge_stall(by, causes, base, snap.step)
        else:
            cause, why, fixes = self._judge_spike(by, causes, prior, w.detector)
        skipped = sorted(set(cfg.causes) - set(causes))
        if skipped:
            why += f"; not run: {', '.join(skipped)} (it would change nothing here)"
        if dist.is_initialized():
            dist.barrier()  # every rank leaves together (the window's collectives are done)
        return self._record(cause, why, fixes, runs, stall, rec.step, snap.step, start)

    # ------------------------------------------------------------------ the re-runs
    def _replay(self, w: _Window, causes: list[str], deadline: float) -> list[dict]:
        """One re-run of the window per variant -- unchanged first, each cause's fix, the
        control last -- each from the snapshot with the same random numbers; what they
        touched (parameters, optimizer state, gradients, the groups' LR, betas and eps, the
        attention's cap, the loss's z-loss weight) put back after, whatever happened."""
        params, opts = w.params, w.opts
        now = HostState().capture(params, opts)  # the state at the alarm, put back after
        grads = [p.grad for p in params]  # (a buffer's: None)
        w.kept = [[(g.get("betas"), g.get("eps")) for g in o.param_groups] for o in opts]
        runs: list[dict] = []
        try:
            with Reexecution(self.host, self.ledger, self.facts, None, replaces=False) as again:
                for variant in (UNCHANGED, *causes, *([CONTROL] if self.config.control else [])):
                    runs.append(self._run_variant(again, w, variant, runs, deadline))
        finally:
            self._model_variant(UNCHANGED)  # the attention's cap and the loss's z-loss as the run has them
            now.restore(params, opts)  # parameters, moments, the groups' LR, betas, eps
            for p, g in zip(params, grads):
                p.grad = g
        return runs

    def _run_variant(self, again: Reexecution, w: _Window, variant: str, runs: list[dict],
                     deadline: float) -> dict:
        """``variant``'s re-run of the window and of the flagged step (forward/backward on
        the window's parameters, no update): its row of ``runs``."""
        kind = response_fault(self.facts.faults, "window")  # (rehearsal)
        check_deadline(self.facts.topo.world, self.facts.device, -math.inf if kind == "timeout" else deadline, "the window proof", self.timeout)
        w.snap.tensors.restore(w.params, w.opts)
        # every variant draws the same random numbers (dropout, if a model has it);
        # the run's own draws per step are not kept, so with dropout ``same`` differs
        again.rewind_rng()
        self._model_variant(variant)
        last, flagged = self._replay_steps(again, w, variant)
        # the flagged step's forward/backward on the window's parameters (no update: no LR)
        loss, grad_norm, local_tokens, global_tokens = again.run(w.rec.batches)
        self._model_variant(UNCHANGED)
        mean = _global_loss(self.facts.topo, self.facts.device, loss_sum(loss, global_tokens), int(local_tokens))
        norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if kind == "nan" and variant != UNCHANGED:
            mean = norm = math.nan  # (rehearsal: every rank alike)
        if variant != UNCHANGED and runs and math.isfinite(runs[0]["loss"]) and \
                math.isfinite(runs[0]["grad_norm"]) and not (math.isfinite(mean) and math.isfinite(norm)):
            raise ProofFailure(f"the window's {variant} variant was not finite ({mean}, {norm}) where the "
                               f"unchanged window was")
        end = sum(last) / len(last) if last else None
        return {"variant": variant, "loss": mean, "grad_norm": norm,
                "normal": not flags_as_run(w.detector, mean, norm),
                "loss_end": end if end is None or math.isfinite(end) else None,
                "flagged": flagged}

    def _replay_steps(self, again: Reexecution, w: _Window, variant: str) -> tuple[list[float], list[int]]:
        """The window's steps after the snapshot, up to the flagged one, under ``variant``,
        each updated as the run updated it: the last ``cost_steps`` steps' losses (what the
        fix cost), and the steps the run's rules flag (a spike that came earlier; not for
        a stall)."""
        ring, cfg = self.ring, self.config
        last: list[float] = []  # the window's last steps' losses: what the fix cost
        flagged: list[int] = []  # replayed steps the run's rules flag (a spike that came earlier)
        for s in range(w.snap.step + 1, w.rec.step):
            entry = ring.log[s]
            self._variant(w.opts, entry.lrs, w.kept, variant)
            lo, gn, lt, gt = again.run(entry.batches)
            ls = _global_loss(self.facts.topo, self.facts.device, loss_sum(lo, gt), int(lt))
            if w.rec.step - s <= cfg.cost_steps:
                last.append(ls)
            if not w.stall:
                g = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
                if variant == UNCHANGED:
                    w.kept_loss[s] = ls
                # z-loss adds w log Z^2 to the loss: its losses are judged as the unchanged run's
                judged = w.kept_loss.get(s, ls) if variant == "zloss" else ls
                if flags_as_run(w.detector, judged, g):
                    flagged.append(s)
            if not entry.rec.update_skipped:
                self.facts.parts.optimizers.step()
        return last, flagged

    # ------------------------------------------------------------------ the judgement
    def _judge_stall(self, by: dict[str, dict], causes: list[str], base: float | None,
                     from_step: int) -> tuple[str | None, str, Any]:
        """A stall is no spike: a fix that removes it is one the loss improves under (the
        window's last losses lowered by the stall rule's ``min_gain``)."""
        gain = float(self.facts.stall.min_gain)
        removed = {c: by[c]["cost"] is not None and base is not None and by[c]["cost"] < -gain * abs(base)
                   for c in causes}
        for c in by:
            if c != UNCHANGED:
                by[c]["effect"] = "lowered" if (by[c]["cost"] is not None and base is not None
                                                and by[c]["cost"] < -gain * abs(base)) else "not removed"
        cause, why, fixes = window_verdict(False, removed, {c: by[c]["cost"] for c in causes},
                                           control=by.get(CONTROL, {}).get("effect"))
        for spike, stalled in (("reproduced the spike", "stalled as the run did"),
                               ("removed the spike from this window",
                                f"lowered the window's last losses by {gain:.0%} from step {from_step}"),
                               ("removed it", "lowered the loss"), ("removed by", "lowered by")):
            why = why.replace(spike, stalled)
        return cause, f"the stall: {why}", fixes

    def _judge_spike(self, by: dict[str, dict], causes: list[str], prior: str | None,
                     detector) -> tuple[str | None, str, Any]:
        """The one judge (``verdict.window_effect``): the run's own rules, and the share of
        the flagged signal's excess each fix left."""
        same = by[UNCHANGED]
        for c in by:
            if c != UNCHANGED:
                by[c]["effect"], by[c]["share"] = window_effect(detector, (same["loss"], same["grad_norm"]),
                                                                (by[c]["loss"], by[c]["grad_norm"]))
                # a replayed step the unchanged re-run did not flag, flagged under the variant:
                # the spike came earlier, it was not removed (the judge reads the whole window)
                moved = sorted(set(by[c]["flagged"]) - set(same["flagged"]))
                if moved:
                    by[c]["moved_to"] = moved[0]
                    if by[c]["effect"] == "removed":
                        by[c]["effect"] = "moved"
        return window_verdict(same["normal"], {c: by[c]["effect"] == "removed" for c in causes},
                              {c: by[c]["cost"] for c in causes}, prior=prior,
                              control=by.get(CONTROL, {}).get("effect"))

    def _record(self, cause: str | None, why: str, fixes, runs: list[dict], stall: bool, step: int,
                from_step: int, start: float) -> dict[str, Any]:
        """``proof["window"]``: the verdict, every re-run, and the settings it ran with."""
        cfg = self.config
        return {"cause": WINDOW_CAUSE.get(cause) if cause else None, "variant": cause, "why": why,
                "fixes": fixes, **({"stall": True} if stall else {}), "from_step": from_step, "steps": step - from_step, "runs": runs,
                "lr_factor": cfg.lr_factor, "beta2": cfg.beta2, "eps": cfg.eps, "eps_fix": cfg.eps_fix,
                "logit_cap": cfg.logit_cap, "zloss": cfg.zloss, "control": cfg.control,
                "seconds": round(time.perf_counter() - start, 4)}

    def _raises_eps(self, opts) -> bool:
        eps = self.config.eps_fix
        return any(g.get("eps") is not None and g["eps"] < eps for o in opts for g in o.param_groups)

    def _loss(self):
        """The run's loss when it is titan_ledger's (its z-loss weight can be set)."""
        from titan_ledger.components.signals.doc_loss import find_doc_loss

        ours = find_doc_loss(self.facts.parts.loss_fn)
        return ours if ours is not None and hasattr(ours, "z_loss_weight") else None

    def _attention(self) -> list:
        """The attention modules whose logits a cap can bound (titan_ledger's recorder)."""
        from titan_ledger.components.signals.attention import MaxLogitRecorder

        return [m for part in self.facts.parts.model_parts for m in part.modules() if isinstance(m, MaxLogitRecorder)]

    def _model_variant(self, variant: str) -> None:
        """What a variant changes outside the optimizer, set for its window and back to the
        run's own after it (``same``): the attention's logit cap (``logit_cap``: a tanh
        soft cap, replay rerun's own), the loss's z-loss weight (``zloss``)."""
        cfg = self.config
        if not hasattr(self, "_kept"):
            loss = self._loss()
            self._kept = ([(m, m.softcap) for m in self._attention()],
                          (loss, loss.z_loss_weight) if loss is not None else None)
        caps, z = self._kept
        for m, cap in caps:
            m.softcap = cfg.logit_cap if variant == "logit_cap" else cap
        if z is not None:
            z[0].z_loss_weight = cfg.zloss if variant == "zloss" else z[1]

    def _changes_adam(self, opts) -> bool:
        cfg = self.config
        return any(g.get("betas") is not None and (g["betas"][1] > cfg.beta2 or g.get("eps", cfg.eps) < cfg.eps)
                   for o in opts for g in o.param_groups)

    def _variant(self, opts, lrs: list[list], kept: list[list], variant: str) -> None:
        """Every param group's LR, betas and epsilon for one replayed step of ``variant``
        (``same``: as the run had them)."""
        cfg = self.config
        for o, lr, ks in zip(opts, lrs, kept):
            for g, x, (betas, eps) in zip(o.param_groups, lr, ks):
                set_group_lr(g, x * cfg.lr_factor if variant == "lr" else x * cfg.control if variant == CONTROL else x)
                adam = variant == "adam" and betas is not None
                if betas is not None:
                    g["betas"] = (betas[0], min(betas[1], cfg.beta2)) if adam else betas
                if eps is not None:
                    g["eps"] = max(eps, cfg.eps) if adam else max(eps, cfg.eps_fix) if variant == "eps" else eps


def _global_loss(topo: Topology, device: torch.device, local_sum, local_tokens: int) -> float:
    """The step's mean loss over every rank (loss owners add their sums, token owners their
    tokens: PP's last stage, one TP rank of each DP replica)."""
    import torch.distributed as dist

    f64 = {"dtype": torch.float64, "device": device}
    v = torch.stack([local_sum.detach().double().reshape(()) if (local_sum is not None and topo.owns_loss)
                     else torch.zeros((), **f64),
                     torch.tensor(float(local_tokens) if topo.owns_tokens else 0.0, **f64)])
    if topo.world > 1:
        dist.all_reduce(v)
    return float(v[0] / v[1]) if float(v[1]) else math.nan
