"""Host-memory snapshots: the state a window proof (:mod:`.window_proof`) re-runs from and
a rollback restores, no second job.

Design decision: the proof at the alarm (:mod:`.prover`) re-executes the flagged step
and answers "data or hardware?"; for every other cause -- the learning rate, Adam's
state -- the step alone proves nothing, because the cause acted on the steps *before*
it. A rerun from a checkpoint (``diagnose --rerun``) is a second job on the run's whole
world size. Instead, ``[ledger.snapshots] every = K`` keeps, every K steps and at the
process's first step, a copy of what each rank holds -- its local shards of the
parameters and of the optimizer state (FSDP2/TP/PP: the sharded state, never
gathered), its buffers (MoE's expert bias, which an optimizer step hook moves), the LR
schedulers', dataloader's and trainer's state -- in host memory, a ring of ``keep``;
and, when a window proof can run (``--ledger.proof.scope`` not off), per step since
the oldest, the step's batches (references: the tensors the step trained on), its
learning rates and whether its update was applied.

At an acting flag whose proof says ``not_data`` (or ``optimizer_state``, or where data
was convicted: does a fix remove the spike with the data unmasked as well?), the window
proof (:class:`~.window_proof.WindowProof`) re-runs the window from the oldest snapshot.
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
the window proof runs), and one more while a stall anchor is pinned.

A stall is no spike: it builds over hundreds of steps, and a window from the ring's
oldest snapshot sees its end only. So the ring also pins the snapshot at the stall
rule's onset (:meth:`SnapshotRing.pin`, ``--ledger.snapshots.stall_anchor``), and a
stall's window proof re-runs from there.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_ledger.components.prevention.optimizer import group_lr, set_group_lr
from titan_ledger.components.response.config import SnapshotsConfig
from titan_ledger.components.response.host import Host, LedgerPort, RunFacts
from titan_ledger.components.signals.sums import local
from titan_ledger.format.proofs import Applied, Finding
from titan_ledger.rehearsal.faults import response_fault


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

    def __init__(self, host: Host, ledger: LedgerPort, facts: RunFacts, config: SnapshotsConfig | None = None, *,
                 replays: bool = True, max_stall_proofs: int = 1) -> None:
        """``config``: the run's ``[ledger.snapshots]``; ``replays``: a window proof can run
        (``[ledger.proof] scope`` not off), so the steps' batches are kept; ``max_stall_proofs``
        (``[ledger.window]``): while a stall proof can still run, the stall's onset is pinned."""
        self.host, self.ledger, self.facts = host, ledger, facts
        self.config = config or SnapshotsConfig()
        self._replays = replays
        self.max_stall_proofs = max_stall_proofs
        self.ring: list[Snapshot] = []
        self.log: dict[int, Logged] = {}
        self._spare: list[HostState] = []
        self._stream = None
        self._started = False
        self._due: tuple[str, int] | None = None  # ("capture" | "reset", step): taken at the next step's start
        self.proofs = 0  # window proofs of spikes (--ledger.window.max_proofs)
        self.stall_proofs = 0  # of stalls (max_stall_proofs)
        self.anchor: Snapshot | None = None  # pinned at the stall rule's onset (stall_anchor)
        self._onset: int | None = None  # the onset the anchor was chosen for
        self.failures: list[tuple[int, BaseException]] = []  # copies that failed (Recovery records them)

    @property
    def on(self) -> bool:
        return self.config.every > 0

    def due(self, step: int) -> bool:
        """Whether the state after ``step`` is snapshotted (the step decides in the step)."""
        return self.on and step % self.config.every == 0

    @property
    def replays(self) -> bool:
        """Whether a window proof can run (``--ledger.proof.scope`` not off): only then
        are the steps' batches kept -- a ring a rollback alone reads holds no batches."""
        return self.on and self._replays

    def tensors(self) -> list:
        """What a snapshot copies of the model: every parameter's local shard, then every
        buffer -- the persistent ones a checkpoint holds (MoE's ``expert_bias``, which an
        optimizer step hook moves: a replay runs that hook too) and the counters a
        forward fills (``tokens_per_expert``), so that a replay starts from the bits the
        run had."""
        return ([p for m in self.facts.parts.model_parts for p in m.parameters()]
                + [b for m in self.facts.parts.model_parts for b in m.buffers()])

    def optimizers(self) -> list:
        return list(self.facts.parts.optimizers.optimizers)

    def capture(self, step: int) -> None:
        """Snapshot the state after ``step`` (the oldest slot's buffers reused). Taken
        where a checkpoint of ``step`` would be -- at the start of the next step, after
        the LR schedulers stepped and with no decision pending -- so that a rollback to
        it restores what a checkpoint load does."""
        t = self.host
        response_fault(self.facts.faults, "snapshot")  # (rehearsal)
        if self.facts.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream()
        while len(self.ring) >= self.config.keep:
            old = self.ring.pop(0)
            if old is not self.anchor:  # (a pinned snapshot outlives the ring)
                self._spare.append(old.tensors)
        tensors = (self._spare.pop() if self._spare else HostState()).capture(
            self.tensors(), self.optimizers(), self._stream)
        run = {"trainer": {**_host_copy(t.state_dict()), "step": step},
               "lr_schedulers": _host_copy(self.facts.parts.lr_schedulers.state_dict()),
               "dataloader": _host_copy(self.facts.parts.dataloader.state_dict())}
        self.ring.append(Snapshot(step, tensors, run))
        self._prune_log()

    def _prune_log(self) -> None:
        oldest = min(self.ring[0].step if self.ring else 1 << 62, self.anchor.step if self.anchor else 1 << 62)
        self.log = {s: e for s, e in self.log.items() if s > oldest}

    def pin(self) -> None:
        """The stall anchor (``--ledger.snapshots.stall_anchor``): at each new onset of the
        stall rule (``Ledger.stall_onset``: where its best window ended), the newest snapshot
        at or before it, kept while a stall proof can still run and for at most
        (``patience`` + 2) x ``window`` steps after the snapshot. The age is counted from
        the snapshot's step, not the onset's: every rank drops it at the same step, though
        ranks may drain the rows that move the onset a step apart."""
        t, stall = self.host, self.facts.stall
        onset = self.ledger.history().stall_onset if self.config.stall_anchor and self.replays else None
        if onset is None or self.stall_proofs >= self.max_stall_proofs:
            self._onset = None
            self._drop_anchor()
            return
        fit = [snap for snap in self.ring if snap.step <= onset]
        if onset != self._onset or (self.anchor is not None and fit and fit[-1].step > self.anchor.step):
            # the loss improved (a later onset), or a snapshot nearer the onset was taken
            self._onset = onset
            self.anchor = fit[-1] if fit else None  # (the one before it freed, not kept as a spare)
            self._prune_log()
        if self.anchor is not None and t.step - self.anchor.step > (stall.patience + 2) * stall.window:
            self._drop_anchor()

    def _drop_anchor(self) -> None:
        if self.anchor is not None:
            self.anchor = None
            self._prune_log()

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
                self.capture(self.host.step - 1)
            if self._due is not None:
                what, step = self._due
                self._due = None
                self.reset(step) if what == "reset" else self.capture(step)
        except Exception as e:
            self.clear()
            self.failures.append((self.host.step, e))
        try:
            self.pin()
        except Exception as e:  # (no anchor: a stall's window starts from the ring's oldest)
            self.anchor = None
            self.failures.append((self.host.step, e))

    def clear(self) -> None:
        """No snapshot stands: the next due step starts the ring again."""
        self.anchor = None
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
        proof = rec.proof
        if proof is not None and (proof.verdict == Finding.HARDWARE or proof.applied != Applied.ORIGINAL):
            if late:
                self.clear()
            else:
                self._due = ("reset", rec.step)
        elif self.due(rec.step) and not late:
            self._due = ("capture", rec.step)

    def window(self, step: int, stall: bool = False) -> Snapshot | None:
        """The oldest snapshot from which every step up to ``step`` can be replayed, with
        at least one update before it (a variant changes updates, not the step itself);
        ``stall``: the stall anchor first, where it stands."""
        for snap in ([self.anchor] if stall and self.anchor is not None else []) + self.ring:
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
        t = self.host
        # what --checkpoint.exclude_from_loading keeps a checkpoint load from restoring,
        # the snapshot does not restore either: a rollback goes where the load would
        excluded = set(self.facts.exclude_from_loading)
        self.settle()
        response_fault(self.facts.faults, "restore")  # (rehearsal)
        snap.tensors.restore(self.tensors(), None if "optimizer" in excluded else self.optimizers())
        for key, part, state in (("lr_scheduler", self.facts.parts.lr_schedulers, "lr_schedulers"),
                                 ("dataloader", self.facts.parts.dataloader, "dataloader"), ("train_state", t, "trainer")):
            if key not in excluded:
                part.load_state_dict(copy.deepcopy(snap.run[state]))

    @property
    def nbytes(self) -> int:
        held = self.ring + ([self.anchor] if self.anchor is not None and self.anchor not in self.ring else [])
        return sum(s.tensors.nbytes for s in held)


def _host_copy(obj):
    """A state dict, its tensors copied to the host (a later in-place update must not change it)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)
