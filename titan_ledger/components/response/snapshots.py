"""Host-memory snapshots and the window proof they pay for: no second job.

Design decision: the proof at the alarm (:mod:`.prover`) re-executes the flagged step
and answers "data or hardware?"; for every other cause -- the learning rate, Adam's
state -- the step alone proves nothing, because the cause acted on the steps *before*
it. A rerun from a checkpoint (``diagnose --rerun``) is a second job on the run's whole
world size. Instead, ``[ledger.snapshots] every = K`` keeps, every K steps and at the
process's first step, a copy of what each rank holds -- its local shards of the
parameters and of the optimizer state (FSDP2/TP/PP: the sharded state, never
gathered), its buffers (MoE's expert bias, which an optimizer step hook moves), the LR
schedulers', dataloader's and trainer's state -- in host memory, a ring of ``keep``;
and, when a window proof can run (``--ledger.on_spike.prove`` not off), per step since
the oldest, the step's batches (references: the tensors the step trained on), its
learning rates and whether its update was applied.

At an acting flag whose proof says ``not_data`` (and where the proof convicted data: the
data unmasked, does a variant remove the spike as well?), :class:`WindowProof` re-runs the
window from the oldest snapshot to the flagged step in this process through the
trainer's own ``execute`` and ``optimizers.step()`` -- once unchanged (``same``, the
control: it must reproduce the flag), once per candidate cause with its variant
(``lr``: every step's LR x ``lr_factor``; ``adam``: beta2 ``beta2``, epsilon ``eps``) -- judges the
flagged step of each by the trainer's own acting rules against the run's history
(``verdict.flags_again``: the loss's and the grad norm's) and
decides with :func:`~.verdict.window_verdict` (one variant alone removes it: that
cause is proven). What it touched -- parameters, optimizer state, gradients, the
groups' LR, betas and epsilon -- is put back from a copy taken first (:class:`HostState`), the
cause is recorded in the proof (``proof["window"]``), and the configured action runs.
A rollback whose target a snapshot covers restores it (:meth:`SnapshotRing.restore_run`)
instead of loading a checkpoint, and restores what that load would (not what
``--checkpoint.exclude_from_loading`` names).

What the replay cannot repeat restarts the ring: a step whose proof applied an update
other than its batches' plain execution (``bad_data``'s masked update, ``hardware``'s)
is snapshotted at once (in the step; decided a step late, the ring is emptied); after a
rollback or a skip window the ring is emptied and the next due step starts it again, so
that a rollback goes where a checkpoint of the same steps would take it. Rehearsal faults that
act inside an execution (``swap``, ``bitflip``, ``nondeterminism``) are not replayed:
``same`` then differs, and nothing is proven. QK-clip (an update after the update) is
refused at launch (``config.validate``).

Copies: on the CPU a clone; on a GPU into pinned host buffers allocated once per ring
slot, on a side stream, the next update waiting on its event (:meth:`SnapshotRing.before_update`)
so that the forward/backward overlaps the copy. Memory: ``keep`` + 1 copies of each
rank's parameters and optimizer state (the ``+ 1``: the state at the alarm, held while
the window proof runs).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_ledger.components.prevention.optimizer import group_lr, set_group_lr
from titan_ledger.components.response.reexecution import Reexecution, check_deadline
from titan_ledger.components.response.verdict import SNAPSHOT_CAUSES, flags_again, window_verdict
from titan_ledger.components.signals.sums import local, loss_sum
from titan_ledger.errors import ProofFailure
from titan_ledger.rehearsal.faults import parse_response_faults, response_fault


# --------------------------------------------------------------------------- the state
class HostState:
    """One copy of the tensors a rank holds -- its parameters' local shards and its
    buffers (``params``: whatever tensors the caller passes, in place), then per
    optimizer and parameter the local shards of the state tensors (``step``, the
    moments) -- in host memory, with the param groups' settings (the LR a scheduler set,
    betas, eps: an optimizer checkpoint's ``param_groups``). Pure torch (no process group): ``capture`` and
    ``restore`` are unit-tested on a module and its optimizer.

    A parameter the optimizer holds no state for yet (before its first step) is
    recorded as absent; restoring it zeroes the state that exists since, which is what
    Adam's lazy initialisation creates (zero moments, step 0), so the next step computes
    the same bits as the first one did."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.opt: list[dict[str, torch.Tensor] | None] = []  # per (optimizer, group, param): host copies or absent
        self.groups: list[list[dict]] = []  # per optimizer and group: its settings (lr, betas, eps, ...)
        self.nbytes = 0
        self._event = None

    @staticmethod
    def _state_of(optimizers) -> list[tuple[dict | None, Any]]:
        return [(o.state.get(p), p) for o in optimizers for g in o.param_groups for p in g["params"]]

    def capture(self, params: list[torch.Tensor], optimizers, stream=None) -> HostState:
        """Copy ``params`` and the ``optimizers``' state (reusing this object's buffers
        when their shapes match). ``stream`` (CUDA): copy there, asynchronously (the
        caller makes the next in-place update wait on :meth:`wait_on`)."""
        sources = [local(p.detach()) for p in params]
        states = self._state_of(optimizers)
        fresh = len(self.params) != len(sources) or len(self.opt) != len(states) or any(
            (s is None) != (b is None) or (s is not None and set(s) != set(b)) for (s, _), b in zip(states, self.opt))
        if fresh:
            self.params = [_host_like(x) for x in sources]
            self.opt = [None if s is None else {k: _host_like(local(v)) for k, v in s.items()
                                                if isinstance(v, torch.Tensor)} for s, _ in states]
            self.nbytes = sum(b.numel() * b.element_size() for b in self._buffers())
        self.groups = [[{k: _host_copy(v) for k, v in g.items() if k != "params"} for g in o.param_groups]
                       for o in optimizers]
        pairs = list(zip(self.params, sources))
        for (s, _), bufs in zip(states, self.opt):
            if s is not None:
                pairs.extend((bufs[k], local(s[k].detach())) for k in bufs)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for b, x in pairs:
                    b.copy_(x, non_blocking=True)
            self._event = stream.record_event()
        else:
            for b, x in pairs:
                b.copy_(x)
        return self

    def _buffers(self):
        yield from self.params
        for bufs in self.opt:
            if bufs is not None:
                yield from bufs.values()

    def wait_on(self) -> None:
        """The device's next work waits for this copy (before parameters change in place)."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def ready(self) -> None:
        """The host waits for this copy (before reading it)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def restore(self, params: list[torch.Tensor], optimizers) -> None:
        """Put the copy back into ``params`` and the ``optimizers``' state, in place (the
        tensors keep their identity: a compiled step or a DTensor wrapper still holds them).
        ``optimizers`` None: the parameters alone (a rollback whose checkpoint load would
        exclude the optimizer)."""
        self.ready()
        with torch.no_grad():
            for p, b in zip(params, self.params, strict=True):
                local(p.data).copy_(b, non_blocking=True)
            if optimizers is None:
                return
            states = self._state_of(optimizers)
            if len(states) != len(self.opt):
                raise RuntimeError("titan_ledger: a snapshot's optimizer state does not match the optimizers' "
                                   "parameters (were parameter groups rebuilt?)")
            for (s, p), bufs in zip(states, self.opt):
                if bufs is None:
                    for v in (s or {}).values():  # absent then: what lazy initialisation creates
                        if isinstance(v, torch.Tensor):
                            local(v).zero_()
                    continue
                if s is None:
                    raise RuntimeError("titan_ledger: a snapshot holds optimizer state for a parameter that has none "
                                       "now; snapshots are restored backwards in time only")
                for k, b in bufs.items():
                    local(s[k]).copy_(b, non_blocking=True)
            for o, kept in zip(optimizers, self.groups, strict=True):  # what an optimizer checkpoint restores too
                for g, settings in zip(o.param_groups, kept, strict=True):
                    for k, v in settings.items():
                        if k == "lr":
                            set_group_lr(g, v)
                        else:
                            g[k] = copy.deepcopy(v)


def _host_like(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda":
        return torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    return torch.empty_like(x, device="cpu")


@dataclass
class Snapshot:
    """The state after ``step`` steps: the tensors, and what a rollback restores besides."""

    step: int
    tensors: HostState
    run: dict[str, Any] = field(default_factory=dict)  # trainer, dataloader, LR schedulers: state dicts


@dataclass
class Logged:
    """What the replay of one trained step needs (:meth:`SnapshotRing.log_step`)."""

    rec: Any  # the StepRecord: ``update_skipped`` is read at replay time (a deferred decision sets it later)
    batches: Any
    lrs: list[list]


# --------------------------------------------------------------------------- the ring (seam)
class SnapshotRing:
    """The ring of one ``LedgerTrainer`` (``Recovery`` drives it: one call at each spot)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.ring: list[Snapshot] = []
        self.log: dict[int, Logged] = {}
        self._spare: list[HostState] = []
        self._stream = None
        self._started = False
        self._due: tuple[str, int] | None = None  # ("capture" | "reset", step): taken at the next step's start
        self.proofs = 0
        self.failures: list[tuple[int, BaseException]] = []  # copies that failed (Recovery records them)

    @property
    def config(self):
        return self.trainer.config.ledger.snapshots

    @property
    def on(self) -> bool:
        return self.config.every > 0

    def due(self, step: int) -> bool:
        """Whether the state after ``step`` is snapshotted (the step decides in the step)."""
        return self.on and step % self.config.every == 0

    @property
    def replays(self) -> bool:
        """Whether a window proof can run (``--ledger.on_spike.prove`` not off): only then
        are the steps' batches kept -- a ring a rollback alone reads holds no batches."""
        return self.on and self.trainer.config.ledger.on_spike.prove != "off"

    def tensors(self) -> list:
        """What a snapshot copies of the model: every parameter's local shard, then every
        buffer -- the persistent ones a checkpoint holds (MoE's ``expert_bias``, which an
        optimizer step hook moves: a replay runs that hook too) and the counters a
        forward fills (``tokens_per_expert``), so that a replay starts from the bits the
        run had."""
        return ([p for m in self.trainer.model_parts for p in m.parameters()]
                + [b for m in self.trainer.model_parts for b in m.buffers()])

    def optimizers(self) -> list:
        return list(self.trainer.optimizers.optimizers)

    def capture(self, step: int) -> None:
        """Snapshot the state after ``step`` (the oldest slot's buffers reused). Taken
        where a checkpoint of ``step`` would be -- at the start of the next step, after
        the LR schedulers stepped and with no decision pending -- so that a rollback to
        it restores what a checkpoint load does."""
        t = self.trainer
        response_fault(parse_response_faults(t.config.ledger.rehearsal.response_fault), "snapshot")  # (rehearsal)
        if t.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream()
        while len(self.ring) >= self.config.keep:
            self._spare.append(self.ring.pop(0).tensors)
        tensors = (self._spare.pop() if self._spare else HostState()).capture(
            self.tensors(), self.optimizers(), self._stream)
        run = {"trainer": {**_host_copy(t.state_dict()), "step": step},
               "lr_schedulers": _host_copy(t.lr_schedulers.state_dict()),
               "dataloader": _host_copy(t.dataloader.state_dict())}
        self.ring.append(Snapshot(step, tensors, run))
        oldest = self.ring[0].step
        self.log = {s: e for s, e in self.log.items() if s > oldest}

    def at_start(self) -> None:
        """The start of a step (before a pending rollback or skip window runs): a snapshot
        due after the previous step is taken; at the process's first step, the state it
        starts from (a fresh run's init, or the checkpoint it resumed). A copy that fails
        (host memory) empties the ring, and the failure is kept for ``Recovery`` to record:
        training goes on, and the next due step tries again."""
        if not self.on:
            return
        try:
            if not self._started:
                self._started = True
                self.capture(self.trainer.step - 1)
            if self._due is not None:
                what, step = self._due
                self._due = None
                self.reset(step) if what == "reset" else self.capture(step)
        except Exception as e:
            self.clear()
            self.failures.append((self.trainer.step, e))

    def clear(self) -> None:
        """No snapshot stands: the next due step starts the ring again."""
        self._spare.extend(s.tensors for s in self.ring)
        self.ring, self.log, self._due = [], {}, None

    def reset(self, step: int) -> None:
        """What the replay cannot repeat happened: the ring restarts from the state after
        ``step`` (called at the next step's start, where that state is the trainer's)."""
        if self.on:
            self.clear()
            self.capture(step)

    def log_step(self, rec) -> None:
        """Before ``rec``'s update: its batches and learning rates, for a replay."""
        if self.replays and self.ring:
            self.log[rec.step] = Logged(rec, rec.batches, [[group_lr(g) for g in o.param_groups]
                                                           for o in self.optimizers()])

    def settle(self) -> None:
        """Every copy in flight is done (the host waits): before anything rewrites the
        parameters outside an update -- a window proof's replays, a rollback's restore."""
        for snap in self.ring:
            snap.tensors.ready()

    def before_update(self) -> None:
        """A copy still in flight finishes on the device before the parameters change."""
        if self.ring and self._stream is not None:
            self.ring[-1].tensors.wait_on()

    def after_decision(self, rec, late: bool = False) -> None:
        """After ``rec``'s update: a snapshot due, or a reset when the replay cannot repeat
        the applied update (a proof's masked or recomputed one), is taken at the next
        step's start. ``late``: decided a step late (the next step's batches are fetched
        already): the ring is cleared instead, and the next due step starts it again."""
        if not self.on:
            return
        proof = rec.proof or {}
        if proof.get("verdict") == "hardware" or proof.get("applied") not in (None, "original"):
            if late:
                self.clear()
            else:
                self._due = ("reset", rec.step)
        elif self.due(rec.step) and not late:
            self._due = ("capture", rec.step)

    def window(self, step: int) -> Snapshot | None:
        """The oldest snapshot from which every step up to ``step`` can be replayed, with
        at least one update before it (a variant changes updates, not the step itself)."""
        for snap in self.ring:
            if snap.step < step - 1 and all(s in self.log for s in range(snap.step + 1, step)):
                return snap
        return None

    def covering(self, target: int, checkpoint: int | None) -> Snapshot | None:
        """The newest snapshot at or before ``target`` that is not older than
        ``checkpoint`` (the step a rollback would load; None: none)."""
        fit = [s for s in self.ring if s.step <= target and (checkpoint is None or s.step >= checkpoint)]
        return fit[-1] if fit else None

    def restore_run(self, snap: Snapshot) -> None:
        """A rollback to ``snap`` from host memory: what a checkpoint load restores --
        parameters, optimizer state, LR schedulers, the dataloader's position (its
        iterator restarts there), the trainer's step and ledger counters."""
        t = self.trainer
        # what --checkpoint.exclude_from_loading keeps a checkpoint load from restoring,
        # the snapshot does not restore either: a rollback goes where the load would
        excluded = set(t.config.checkpoint.exclude_from_loading or ())
        self.settle()
        response_fault(parse_response_faults(t.config.ledger.rehearsal.response_fault), "restore")  # (rehearsal)
        snap.tensors.restore(self.tensors(), None if "optimizer" in excluded else self.optimizers())
        for key, part, state in (("lr_scheduler", t.lr_schedulers, "lr_schedulers"),
                                 ("dataloader", t.dataloader, "dataloader"), ("train_state", t, "trainer")):
            if key not in excluded:
                part.load_state_dict(copy.deepcopy(snap.run[state]))

    @property
    def nbytes(self) -> int:
        return sum(s.tensors.nbytes for s in self.ring)


def _host_copy(obj):
    """A state dict, its tensors copied to the host (a later in-place update must not change it)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


# --------------------------------------------------------------------------- the proof
class WindowProof:
    """Re-runs the window before a ``not_data`` alarm with each candidate cause's variant
    (the module docstring); ``Recovery._judge`` asks it after the step's proof."""

    def __init__(self, trainer, ring: SnapshotRing) -> None:
        self.trainer, self.ring = trainer, ring

    def wanted(self, proof: dict, forced: bool = False) -> bool:
        """Within ``max_proofs``: an acting flag proven ``not_data`` or ``optimizer_state``
        (which cause, then: Adam's variant proves the state by intervention);
        data convicted (``bad_data``: does a variant remove the spike with the data
        unmasked as well? -- the real set's LR runs had documents convicted at steps
        where every update moved the weights 6% of their norm); or a step
        ``--ledger.rehearsal.prove_at`` names and its proof left standing (``not_data``,
        ``outlier``: the window replayed on a clean step, every parallelism's replay
        checked against the run)."""
        r = self.ring
        v = proof.get("verdict")
        return r.on and r.proofs < r.config.max_proofs and (
            (v in ("not_data", "optimizer_state") and bool(proof.get("acting"))) or v == "bad_data"
            or (forced and v in ("not_data", "outlier")))

    def prove(self, rec, stall: bool = False) -> dict[str, Any]:
        """The window proof of the flagged step ``rec`` (its batches still held): the
        record that goes in ``proof["window"]``. ``stall``: the stall rule flagged the run
        (no spike at ``rec``): a fix removes it when it lowers the window's last steps'
        loss by the rule's ``min_gain`` against the unchanged re-run's."""
        import torch.distributed as dist

        t, ring = self.trainer, self.ring
        cfg = ring.config
        snap = ring.window(rec.step)
        if snap is None:
            return {"cause": None, "why": f"no snapshot from which steps up to {rec.step} can be replayed "
                                          f"(--ledger.snapshots.every {cfg.every}, keep {cfg.keep})"}
        ring.proofs += 1
        ring.settle()
        start = time.perf_counter()
        params, opts = ring.tensors(), ring.optimizers()
        now = HostState().capture(params, opts)  # the state at the alarm, put back after
        grads = [p.grad for p in params]  # (a buffer's: None)
        betas = [[(g.get("betas"), g.get("eps")) for g in o.param_groups] for o in opts]
        causes = [c for c in cfg.causes if (c != "adam" or self._changes_adam(opts))
                  and (c != "eps" or self._raises_eps(opts)) and (c != "zloss" or self._loss() is not None)
                  and (c != "logit_cap" or self._attention())]
        detector = t.ledger.guard.detector
        faults = parse_response_faults(t.config.ledger.rehearsal.response_fault)
        deadline = start + float(t.config.ledger.on_spike.prove_timeout)
        runs: list[dict] = []
        try:
            with Reexecution(t, None, replaces=False) as again:
                for variant in ("same", *causes):
                    kind = response_fault(faults, "window")  # (rehearsal)
                    check_deadline(t, -math.inf if kind == "timeout" else deadline, "the window proof")
                    snap.tensors.restore(params, opts)
                    # every variant draws the same random numbers (dropout, if a model has it);
                    # the run's own draws per step are not kept, so with dropout ``same`` differs
                    again.rewind_rng()
                    self._model_variant(variant)
                    last: list[float] = []  # the window's last steps' losses: what the fix cost
                    for s in range(snap.step + 1, rec.step):
                        entry = ring.log[s]
                        self._variant(opts, entry.lrs, betas, variant)
                        lo, _, lt, gt = again.run(entry.batches)
                        if rec.step - s <= cfg.cost_steps:
                            last.append(_global_loss(t, loss_sum(lo, gt), int(lt)))
                        if not entry.rec.update_skipped:
                            t.optimizers.step()
                    # the flagged step's forward/backward on the window's parameters (no update: no LR)
                    loss, grad_norm, local_tokens, global_tokens = again.run(rec.batches)
                    self._model_variant("same")
                    mean = _global_loss(t, loss_sum(loss, global_tokens), int(local_tokens))
                    norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                    if kind == "nan" and variant != "same":
                        mean = norm = math.nan  # (rehearsal: every rank alike)
                    if variant != "same" and runs and math.isfinite(runs[0]["loss"]) and \
                            math.isfinite(runs[0]["grad_norm"]) and not (math.isfinite(mean) and math.isfinite(norm)):
                        raise ProofFailure(f"the window's {variant} variant was not finite ({mean}, {norm}) where the "
                                           f"unchanged window was")
                    end = sum(last) / len(last) if last else None
                    runs.append({"variant": variant, "loss": mean, "grad_norm": norm,
                                 "normal": not flags_again(detector, mean, norm),
                                 "loss_end": end if end is None or math.isfinite(end) else None})
        finally:
            self._model_variant("same")  # the attention's cap and the loss's z-loss as the run has them
            now.restore(params, opts)  # parameters, moments, the groups' LR, betas, eps
            for p, g in zip(params, grads):
                p.grad = g
        by = {r["variant"]: r for r in runs}
        base = by["same"]["loss_end"]
        for r in runs:
            r["cost"] = None if r["loss_end"] is None or base is None else round(r["loss_end"] - base, 6)
        if stall:  # a stall is no spike: a fix that removes it is one the loss improves under
            gain = float(t.config.ledger.stall.min_gain)
            removed = {c: by[c]["cost"] is not None and base is not None and by[c]["cost"] < -gain * abs(base)
                       for c in causes}
            cause, why, fixes = window_verdict(False, removed, {c: by[c]["cost"] for c in causes})
            why = f"the stall: {why}".replace("removed it", "lowered the loss").replace("removed by",
                                                                                       "lowered by")
        else:
            cause, why, fixes = window_verdict(by["same"]["normal"], {c: by[c]["normal"] for c in causes},
                                               {c: by[c]["cost"] for c in causes})
        skipped = sorted(set(cfg.causes) - set(causes))
        if skipped:
            why += f"; not run: {', '.join(skipped)} (it would change nothing here)"
        if dist.is_initialized():
            dist.barrier()  # every rank leaves together (the window's collectives are done)
        return {"cause": SNAPSHOT_CAUSES.get(cause) if cause else None, "variant": cause, "why": why,
                "fixes": fixes, **({"stall": True} if stall else {}), "from_step": snap.step, "steps": rec.step - snap.step, "runs": runs,
                "lr_factor": cfg.lr_factor, "beta2": cfg.beta2, "eps": cfg.eps, "eps_fix": cfg.eps_fix,
                "logit_cap": cfg.logit_cap, "zloss": cfg.zloss, "seconds": round(time.perf_counter() - start, 4)}

    def _raises_eps(self, opts) -> bool:
        eps = self.ring.config.eps_fix
        return any(g.get("eps") is not None and g["eps"] < eps for o in opts for g in o.param_groups)

    def _loss(self):
        """The run's loss when it is titan_ledger's (its z-loss weight can be set)."""
        from titan_ledger.components.signals.doc_loss import find_doc_loss

        ours = find_doc_loss(self.trainer.loss_fn)
        return ours if ours is not None and hasattr(ours, "z_loss_weight") else None

    def _attention(self) -> list:
        """The attention modules whose logits a cap can bound (titan_ledger's recorder)."""
        from titan_ledger.components.signals.attention import MaxLogitRecorder

        return [m for part in self.trainer.model_parts for m in part.modules() if isinstance(m, MaxLogitRecorder)]

    def _model_variant(self, variant: str) -> None:
        """What a variant changes outside the optimizer, set for its window and back to the
        run's own after it (``same``): the attention's logit cap (``logit_cap``: a tanh
        soft cap, replay rerun's own), the loss's z-loss weight (``zloss``)."""
        cfg = self.ring.config
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
        cfg = self.ring.config
        return any(g.get("betas") is not None and (g["betas"][1] > cfg.beta2 or g.get("eps", cfg.eps) < cfg.eps)
                   for o in opts for g in o.param_groups)

    def _variant(self, opts, lrs: list[list], kept: list[list], variant: str) -> None:
        """Every param group's LR, betas and epsilon for one replayed step of ``variant``
        (``same``: as the run had them)."""
        cfg = self.ring.config
        for o, lr, ks in zip(opts, lrs, kept):
            for g, x, (betas, eps) in zip(o.param_groups, lr, ks):
                set_group_lr(g, x * cfg.lr_factor if variant == "lr" else x)
                adam = variant == "adam" and betas is not None
                if betas is not None:
                    g["betas"] = (betas[0], min(betas[1], cfg.beta2)) if adam else betas
                if eps is not None:
                    g["eps"] = max(eps, cfg.eps) if adam else max(eps, cfg.eps_fix) if variant == "eps" else eps


def _global_loss(trainer, local_sum, local_tokens: int) -> float:
    """The step's mean loss over every rank (loss owners add their sums, token owners their
    tokens: PP's last stage, one TP rank of each DP replica)."""
    import torch.distributed as dist

    topo = trainer.ledger.topo
    f64 = {"dtype": torch.float64, "device": trainer.device}
    v = torch.stack([local_sum.detach().double().reshape(()) if (local_sum is not None and topo.owns_loss)
                     else torch.zeros((), **f64),
                     torch.tensor(float(local_tokens) if topo.owns_tokens else 0.0, **f64)])
    if topo.world > 1:
        dist.all_reduce(v)
    return float(v[0] / v[1]) if float(v[1]) else math.nan
