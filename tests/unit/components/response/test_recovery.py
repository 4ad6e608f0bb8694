"""titan_ledger.components.response.recovery: the protocol the trainer calls, as a state
machine on a fake trainer around a real model and a real fused AdamW (no processes).

The double runs ``LedgerTrainer``'s own ``train_step`` (the wrapper and the copied
step: ``before_step``, ``first_execution`` around ``execute``, ``Ledger.record``,
``update``), bound to it, inside torchtitan's loop (a step count, ``train_step``, a
checkpoint, ``settling`` around it): only ``execute`` (the forward/backward) and
torchtitan's components are faked. The fake ledger stands in for the recorder's queue
(``host_stats``), the rules (a planned flag per step) and the writers (rows in step
order, a held step's waiting for its decision). Every outcome is reached -- ``STANDS``, ``REDONE`` (a late update, a proof
that overwrote the gradients), ``DROPPED`` (a rollback decided a step late) -- and each
deferred run is compared, bit for bit, with the same run deciding every step in the
step: parameters, Adam's moments and step count, the rows and the ladder's actions. What
each decision is -- the verdict under the policy, the bounds, the breaker, the ladder -- is
the ``judgment`` mixin's (components/response/judgment.py), exercised here through it.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from doubles import CheckpointerDouble, HostDouble, LedgerDouble
from helpers import proof_record, run_facts

from titan_ledger.components.detection.guard import SpikeGuard
from titan_ledger.components.detection.spikes import STAT_KEYS, SpikeDetector
from titan_ledger.components.ledger.sections import RehearsalConfig
from titan_ledger.components.response.config import (
    BreakerConfig,
    ProofConfig,
    ResponseConfig,
    RollbackConfig,
)
from titan_ledger.components.response.ladder import NoteBudget
from titan_ledger.components.response.prover import Prover
from titan_ledger.components.response.recovery import Outcome, Recovery, Update
from titan_ledger.components.response.reexecution import Reexecution
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.topology import Topology
from titan_ledger.errors import LedgerStop

_NOTE = STAT_KEYS.index("note")
DOCS = 4  # documents per step's batch: (step, i)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return [((step, i), torch.randn(3, generator=g), torch.randn(1, generator=g)) for i in range(DOCS)]


def _microbatch(rows) -> tuple[dict, torch.Tensor]:
    """A fetched microbatch as torchtitan's iterator gives it: ``(input_dict, labels)``, a
    label token per row (the step's tokens are its documents)."""
    return {"rows": rows}, torch.zeros(len(rows), dtype=torch.long)


def _without(groups, docs) -> list:
    (inputs, _), = groups[0]
    return [[_microbatch([row for row in inputs["rows"] if row[0] not in docs])]]


def _ledger_config(act, defer, prove, action, budget, breaker) -> SimpleNamespace:
    """The ``[ledger]`` table the double trains with: the response's sections, as the
    trainer passes them, beside the ledger's own rehearsal and skip sections."""
    cfg = Recovery.Config(response=ResponseConfig(policy=act, defer=defer, action=action, repeat_horizon=100),
                          proof=ProofConfig(scope=prove, notes_rate=budget[0], notes_burst=budget[1]),
                          rollback=RollbackConfig(back=1, skip=2, limit=3),
                          breaker=BreakerConfig(actions=breaker[0], window=breaker[1]))
    return SimpleNamespace(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
                           rehearsal=RehearsalConfig(), skip=SimpleNamespace(lr="freeze"))


class _Ledger(LedgerDouble):
    """The ledger's side of the protocol (the port, and what the trainer's own step calls):
    flags from a plan, rows in step order."""

    def __init__(self, trainer, flags: dict[int, tuple[bool, bool]], action: str, folder: Path,
                 budget: tuple[float, int] = (0.01, 8)):
        super().__init__(folder=folder, guard=SpikeGuard(Topology.single(), SpikeDetector.Config(), action))
        self.t, self.plan = trainer, flags
        self.pending: list[StepRecord] = []
        self.rows: list[tuple] = []  # (step, update skipped, proof verdict) as written
        self.quarantine: set = set()
        self.proof_records: list = []  # every written step's proof (None: none)
        self.enabled, self.inject = True, None  # (a bitflip is planned from --ledger.rehearsal.inject)

    def record(self, rec, *, grad_norm, local_tokens, local_loss_sum):
        acting, note = self.plan.get(rec.step, (False, False))
        stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        stats[0], stats[_NOTE] = float(acting), float(note)
        self.guard.last_stats = stats
        self.stats[rec.step] = stats.tolist()
        self.last_execution = (local_loss_sum, local_tokens, grad_norm)
        self.pending.append(rec)

    def flags(self, rec=None):
        if rec is not None:
            return super().flags(rec)  # the recorder's queued copy (record: ``stats``)
        return self.plan.get(self.t.step, (False, False))

    def drain(self, block, metrics_logger=None):
        while self.pending and self.pending[0].decided:
            rec = self.pending.pop(0)
            self.rows.append((rec.step, rec.update_skipped, rec.proof.verdict if rec.proof else rec.unproven))
            self.proof_records.append(rec.proof)

    def record_event(self, ev, alert=None, metrics_logger=None):
        super().record_event(ev)  # (a ladder's action: ``actions``)
        if alert is not None:
            self.events.append({"alert": alert[1]})

    def remask(self, rec, docs):
        rec.batches = _without(rec.batches, set(docs))

    def record_skip(self, **kw):
        self.rows.append(("skipped", kw["first"], kw["last"]))

    def rewind(self, *, from_step, to_step, window, metrics_logger=None):
        self.drain(True)
        self.pending.clear()
        self.rows = [r for r in self.rows if r[0] == "skipped" or r[0] <= to_step]
        super().rewind(from_step=from_step, to_step=to_step, window=window)


class _Trainer(HostDouble):
    """A test double of the ``Host`` protocol (components/response/host.py): torchtitan's
    components faked around a real model and a real fused AdamW; the protocol's methods and
    the step (``train_step``, ``_train_step``, ``count_tokens``) are the trainer's own,
    inherited."""

    def __init__(self, tmp: Path, *, flags, action="skip_update", defer=True, prove="off", steps=12,
                 ckpt: int | None = None, fused=True, keep_grads=True, budget=(0.01, 8), act="act",
                 breaker=(4, 100), first_ckpt: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 1)
        self.model_parts = [self.model]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1, fused=fused)
        self.optimizers = SimpleNamespace(optimizers=[self.opt], step=self.opt.step, zero_grad=self.opt.zero_grad)
        self.device = torch.device("cpu")
        self.step, self.ntokens_seen, self.step_record = 0, 0, None
        self.gradient_accumulation_steps = self.num_pipeline_parallel_microbatches = 1
        self.config = SimpleNamespace(
            ledger=_ledger_config(act, defer, prove, action, budget, breaker),
            checkpoint=SimpleNamespace(enable=ckpt is not None, interval=ckpt or 1,
                                       enable_first_step_checkpoint=first_ckpt, folder="checkpoint"),
            validator=SimpleNamespace(enable=False),
            # disable_cuda_graphs: zero_grad frees the gradients every step, so a deferred step keeps
            # its own (KeptExecution) instead of a checksum pass
            training=SimpleNamespace(steps=steps, max_norm=1.0, disable_cuda_graphs=keep_grads),
            dump_folder=str(tmp))
        self.ledger = _Ledger(self, flags, action, tmp / "ledger", budget)
        self.metrics_processor = SimpleNamespace(logger=None, ntokens_since_last_log=0, data_loading_times=[],
                                                 should_log=lambda step: False)
        self.parallel_dims = SimpleNamespace(dp_enabled=False, pp_enabled=False)
        self.doc_loss, self._ledger_open = None, True  # (the ledger is open: no first-step checks)
        self.lr_schedulers = SimpleNamespace(step=self._lr_step, schedulers=[],
                                             get_metrics=lambda: {"lr": self.opt.param_groups[0]["lr"]})
        ck = self.config.checkpoint  # torchtitan's own _should_save over the double's settings
        self.checkpointer = CheckpointerDouble(enable=ck.enable, interval=ck.interval, enable_first_step_checkpoint=first_ckpt,
                                               maybe_wait_for_staging=lambda: None, maybe_wait_for_saving=lambda: None,
                                               load=self._load)
        self.saved: dict[int, tuple] = {}
        self.rows_at_save: dict[int, list] = {}
        self.ledger.loader = SimpleNamespace(skip=lambda n: SimpleNamespace(position_before=0, position_after=n))
        self.validator = self.dataloader = None  # (validation off; the loader is the ledger's)
        self.ready()  # the double offers what the response is given (Host)
        self.recovery = Recovery.Config.of(self.config.ledger).build(host=self, ledger=self.ledger,
                                                                      facts=run_facts(self))

    def should_continue_training(self):
        return self.step < self.config.training.steps

    def state_dict(self):  # torchtitan's train state (a host snapshot's; the ring is off here)
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]

    def _lr_step(self):  # a schedule that moves every step: a late update must use its own step's LR
        for g in self.opt.param_groups:
            g["lr"] = 0.1 / (1 + self.step)

    def _load(self, step):
        model, opt, lr = self.saved[step]
        self.model.load_state_dict(copy.deepcopy(model))
        self.opt.load_state_dict(copy.deepcopy(opt))
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.step = step

    def save(self):
        path = Path(self.config.dump_folder) / "checkpoint" / f"step-{self.step}"
        path.mkdir(parents=True, exist_ok=True)
        (path / ".metadata").touch()
        self.saved[self.step] = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()),
                                 self.opt.param_groups[0]["lr"])
        self.rows_at_save[self.step] = [r[0] for r in self.ledger.rows]  # what the ledger held when it saved

    def execute(self, groups, need_loss=True, tokens=None):
        """The copied step body's stand-in: forward/backward and clip on the rows."""
        (inputs, labels), = groups[0]
        rows = inputs["rows"]
        self.ntokens_seen += len(rows)
        loss = sum(((self.model(x) - y) ** 2).sum() for _, x, y in rows) / DOCS
        faults = self.step_record.faults if self.step_record is not None else None
        if faults is not None and faults.bitflip:  # a transient fault: once per execution it is armed for
            loss, faults.bitflip = loss * 100, False
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.training.max_norm)
        return loss.detach(), norm, torch.tensor(len(rows)), torch.tensor(len(rows))

    def batches(self):
        """torchtitan's data iterator: the step's rows, the quarantined documents left out
        (the fetch's filter)."""
        while True:
            yield _microbatch([row for row in _batch(self.step) if row[0] not in self.ledger.quarantine])

    def train(self):
        """torchtitan's loop (a step count, ``train_step``, a checkpoint) around the trainer's
        own ``train_step``; the outcomes of ``first_execution`` are collected on the way."""
        r = self.recovery
        outcomes, first = [], r.first_execution

        def spy(*args, **kw):
            out = first(*args, **kw)
            outcomes.append(out[0])
            return out

        r.first_execution = spy
        self.config.ledger.rehearsal.inject = ",".join(f"{s}:0:{k}" for s, k in self.faults)
        data = self.batches()
        with r.settling():
            while self.should_continue_training():
                self.step += 1
                self.train_step(data)
                if self.checkpointer._should_save(self.step, last_step=self.step == self.config.training.steps):
                    self.save()
        self.ledger.drain(True)
        return outcomes

    faults: tuple = ()


class _Prover(Prover):
    """A proof whose verdict per step is planned; what it applies is executed as the real
    prover does (through ``Reexecution``): ``masked`` trains without the step's document 0.
    Which steps are proven is the real prover's (``wanted``, ``notes_allowed``: the mode
    and Recovery's note budget)."""

    def __init__(self, trainer, mode, verdicts):
        self.trainer = self.t = trainer
        self.note_budget = trainer.recovery.note_budget
        self._mode, self.verdicts = mode, verdicts
        self.proofs = 0
        self.firsts = []  # what each proof got of the first execution

    @property
    def mode(self):
        return self._mode

    def release(self):
        pass

    def _groups(self, rec, applied):
        if applied == "masked":
            return _without(rec.batches, {(rec.step, 0)})
        return rec.batches

    def prove(self, rec, *, acting, event, first=None):
        self.proofs += 1
        self.firsts.append(first)
        verdict, applied, *extra = self.verdicts[rec.step]
        if verdict == "fail":
            raise RuntimeError("the proof failed")
        return proof_record(verdict, applied, acting=acting,
                            documents=[[rec.step, 0]] if verdict == "bad_data" else [], **(extra[0] if extra else {}))

    def convict(self, rec, proof):
        self.t.ledger.quarantine.add((rec.step, 0))

    def abandon(self, rec):
        pass

    def load_update(self, rec, applied):
        if applied == "none":
            return
        with Reexecution(self.t, self.t.ledger, run_facts(self.t), rec, replaces=False) as again:
            again.run(self._groups(rec, applied))


def _run(tmp, name, **kw):
    verdicts = kw.pop("verdicts", None)
    faults = kw.pop("faults", ())
    t = _Trainer(tmp / name, **kw)
    t.faults = faults
    if verdicts is not None:
        t.recovery.prover = _Prover(t, kw.get("prove", "acting"), verdicts)
    outcomes = t.train()
    return t, outcomes


def _state(t):
    st = t.opt.state_dict()["state"]
    return [p.detach().clone() for p in t.model.parameters()], \
        [(float(s["step"]), s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in st.values()]


def _assert_same_run(a, b):
    (pa, sa), (pb, sb) = _state(a), _state(b)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb)), "parameters differ"
    assert all(x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]) for x, y in zip(sa, sb))
    assert a.ledger.rows == b.ledger.rows
    assert a.ledger.actions == b.ledger.actions


FLAGS = {3: (True, False), 4: (True, False), 8: (False, True), 9: (True, True)}


@pytest.mark.parametrize("action", ["skip_update", "none", "none,skip_update*9", "skip_update*2,none"])
def test_a_deferred_run_with_the_ladder_trains_the_run_in_step_decisions_train(tmp_path, action):
    d, outcomes = _run(tmp_path, "deferred", flags=FLAGS, action=action)
    s, _ = _run(tmp_path, "in_step", flags=FLAGS, action=action, defer=False)
    # (`none` with prove off: a flag changes nothing, so nothing is deferred)
    assert (d.recovery.deferred > 0) is (action != "none") and s.recovery.deferred == 0
    _assert_same_run(d, s)
    assert set(outcomes) == {Outcome.STANDS}  # prove off: a held update is withheld, never applied late


@pytest.mark.parametrize("keep_grads", [True, False])
@pytest.mark.parametrize("verdict,applied", [("not_data", "original"), ("hardware", "same"),
                                             ("hardware", "none"), ("bad_data", "masked")])
def test_a_deferred_proof_applies_what_it_decides_and_the_next_step_is_redone(tmp_path, verdict, applied,
                                                                              keep_grads):
    verdicts = {s: (verdict, applied) for s in FLAGS}
    d, outcomes = _run(tmp_path, "deferred", flags=FLAGS, action="skip_update", prove="acting", verdicts=verdicts,
                       keep_grads=keep_grads)
    s, _ = _run(tmp_path, "in_step", flags=FLAGS, action="skip_update", prove="acting", verdicts=verdicts, defer=False)
    _assert_same_run(d, s)
    # a proof leaves its step's gradients changed: the step after it is always executed again
    assert Outcome.REDONE in outcomes and d.recovery.redone == outcomes.count(Outcome.REDONE) > 0
    if verdict == "bad_data":  # the redo trained the next step without the convicted document
        assert d.ledger.quarantine == {(3, 0), (4, 0), (9, 0)}
    skipped = applied == "none" or verdict == "not_data"  # not_data: the ladder's skip_update acts
    assert (3, skipped, verdict) in d.ledger.rows


def test_a_kept_first_execution_gives_the_proof_the_checksum_taken_in_the_step(tmp_path):
    """Deferred, a proof gets the first execution's checksum: taken at the step, or (the
    gradients freed every step anyway) computed from the kept gradients when the flag is
    read -- the same bits, whatever the next step's backward wrote meanwhile."""
    verdicts = {s: ("not_data", "original") for s in FLAGS}
    kept, _ = _run(tmp_path, "kept", flags=FLAGS, action="none", prove="acting", verdicts=verdicts)
    summed, _ = _run(tmp_path, "summed", flags=FLAGS, action="none", prove="acting", verdicts=verdicts,
                     keep_grads=False)
    a, b = kept.recovery.prover.firsts, summed.recovery.prover.firsts
    assert len(a) == len(b) == 3 and all(x is not None for x in a)
    for x, y in zip(a, b):
        assert torch.equal(x.psq, y.psq) and torch.equal(x.sums, y.sums) and x.local_tokens == y.local_tokens
        assert torch.equal(x.loss_sum, y.loss_sum) and torch.equal(x.grad_norm, y.grad_norm)


def test_notes_are_proven_only_with_prove_all(tmp_path):
    verdicts = {s: ("not_data", "original") for s in range(1, 13)}
    acting, _ = _run(tmp_path, "acting", flags=FLAGS, action="none", prove="acting", verdicts=verdicts)
    every, _ = _run(tmp_path, "all", flags=FLAGS, action="none", prove="all", verdicts=verdicts)
    assert acting.recovery.prover.proofs == 3 and every.recovery.prover.proofs == 4  # step 8: a note only
    _assert_same_run(every, _run(tmp_path, "all_in_step", flags=FLAGS, action="none", prove="all",
                                 verdicts=verdicts, defer=False)[0])


def test_the_note_budget_proves_the_notes_it_holds_and_records_the_rest_unproven(tmp_path):
    """``prove = "all"`` with a bucket of 2 note proofs refilled at 0.25 a step: notes at
    steps 2-9 and 11 (step 9 also acting). The bucket proves 2 and 3 (full at the start),
    then 6 (one token again after 4 steps) and 11; the rest are recorded ``unproven``; the
    acting flag at 9 is proven whatever the bucket holds, and spends nothing. Deferred and in-step decide alike, bit for bit."""
    flags = {s: (s == 9, True) for s in (*range(2, 10), 11)}
    verdicts = {s: ("outlier", "original") for s in range(1, 13)}
    kw = dict(flags=flags, action="none", prove="all", verdicts=verdicts, budget=(0.25, 2))
    d, _ = _run(tmp_path, "deferred", **kw)
    s, _ = _run(tmp_path, "in_step", defer=False, **kw)
    _assert_same_run(d, s)
    by = {r[0]: r[2] for r in d.ledger.rows}
    assert [k for k, v in by.items() if v == "outlier"] == [2, 3, 6, 9, 11]
    assert [k for k, v in by.items() if v == "budget"] == [4, 5, 7, 8]
    assert d.recovery.prover.proofs == 5


def test_note_budget_refills_alike_however_often_it_is_asked():
    a, b = NoteBudget(0.3, 2), NoteBudget(0.3, 2)
    for step in range(1, 40):
        a.allows(step)  # asked every step (deferred) or only at the notes (in the step)
    assert a.allows(40) == b.allows(40) and (a.tokens, a.at) == (b.tokens, b.at) == (2_000_000, 40)
    spent = [st for st in range(41, 60) if b.allows(st) and (b.spend(st) or True)]
    assert spent == [41, 42, 45, 48, 51, 55, 58]  # 2 at once, then one per 1 / 0.3 steps (integer millionths)
    c = NoteBudget(0.3, 2)
    c.load_state_dict(b.state_dict())
    assert (c.tokens, c.at) == (b.tokens, b.at)
    assert not NoteBudget(0.0, 0).allows(10)  # 0 and 0: notes never proven


def test_a_rollback_decided_a_step_late_drops_the_step_it_was_decided_in(tmp_path):
    flags = {7: (True, False)}
    d, outcomes = _run(tmp_path, "deferred", flags=flags, action="rollback", ckpt=2)
    s, _ = _run(tmp_path, "in_step", flags=flags, action="rollback", ckpt=2, defer=False)
    assert outcomes.count(Outcome.DROPPED) == 1 and d.ledger.rewinds == s.ledger.rewinds == 1
    _assert_same_run(d, s)
    # rolled back to step 6 (spike 7 - rollback_back 1), then steps 7-8 skipped
    assert ("skipped", 7, 8) in d.ledger.rows and [r[0] for r in d.ledger.rows].count(7) == 0


def test_a_stop_rung_writes_what_is_pending_and_stops_with_the_report(tmp_path):
    with pytest.raises(LedgerStop, match="the recovery ladder stopped training at step 4"):
        _run(tmp_path, "stop", flags=FLAGS, action="skip_update,stop")


@pytest.mark.parametrize("kw,why", [
    ({"fused": False}, "no found_inf"),
    ({"ckpt": 1}, "every step is a checkpoint step"),
    ({"defer": False}, "--ledger.response.no_defer"),
])
def test_every_fallback_decides_in_the_step_and_trains_the_same_run(tmp_path, kw, why):
    t, outcomes = _run(tmp_path, "fallback", flags=FLAGS, action="skip_update", **kw)
    assert t.recovery.deferred == 0 and t.recovery.pending is None, why
    ref, _ = _run(tmp_path, "deferred", flags=FLAGS, action="skip_update", ckpt=kw.get("ckpt"),
                  fused=kw.get("fused", True))
    _assert_same_run(t, ref)


def test_the_update_method_applies_withholds_or_holds_and_lifts_the_guard(tmp_path):
    t = _Trainer(tmp_path, flags={5: (True, False)}, action="skip_update", steps=20)
    r = t.recovery
    seen = []
    t.optimizers.step = lambda: seen.append(t.opt.found_inf if hasattr(t.opt, "found_inf") else None)
    for step, want in ((5, Update.HOLD), (6, Update.HOLD)):
        t.step = step
        rec = StepRecord(step=step, start=0.0)
        t.ledger.record(rec, grad_norm=torch.tensor(1.0), local_tokens=4, local_loss_sum=torch.tensor(4.0))
        assert r._decide(rec) is want
        r.pending = None  # (decided below through update)
    t.step = 5
    rec = StepRecord(step=5, start=0.0)
    t.ledger.record(rec, grad_norm=torch.tensor(1.0), local_tokens=4, local_loss_sum=torch.tensor(4.0))
    r.update(rec)
    assert float(seen[-1]) == 1.0 and t.opt.found_inf is None  # held on the device, then the guard lifted
    t.config.ledger.response.defer = False
    r._deferrable = None
    rec = StepRecord(step=5, start=0.0)
    n = len(seen)
    t.ledger.record(rec, grad_norm=torch.tensor(1.0), local_tokens=4, local_loss_sum=torch.tensor(4.0))
    r.update(rec)
    assert len(seen) == n and rec.update_skipped  # withheld in the step: optimizers.step() not called


def test_after_an_error_a_held_steps_rows_are_written_as_they_stand(tmp_path):
    """A rank that dies (or any error) ends training with a step's decision still held:
    ``settling`` marks it decided, update withheld when it was flagged, so the
    final drain writes its rows (the launcher's "last complete step" counts it)."""
    t = _Trainer(tmp_path, flags={4: (True, False)}, action="skip_update", steps=20)
    r = t.recovery
    data = t.batches()
    with pytest.raises(OSError), r.settling():
        for step in (1, 2, 3, 4):  # the trainer's own steps, as in _Trainer.train, stopping after step 4
            t.step = step
            t.train_step(data)
        assert r.pending is not None and r.pending.step == 4 and not r.pending.decided
        assert [row[0] for row in t.ledger.rows] == [1, 2, 3]  # step 4's rows wait for its decision
        raise OSError("step 5's fetch")
    t.ledger.drain(True)
    assert t.ledger.rows[-1] == (4, True, None) and r.pending is None


# --------------------------------------------------------------------------- the policy and its bounds (issue 60)
def test_observe_records_what_a_verdict_would_do_and_trains_the_run_no_response_trains(tmp_path):
    """``act = "observe"``: a ``bad_data`` or ``hardware`` verdict is recorded with what it
    would apply, nothing is quarantined, and the run -- deferred or in the step -- trains
    bit for bit as the run without proofs."""
    verdicts = {3: ("bad_data", "masked"), 4: ("hardware", "same"), 9: ("hardware", "none")}
    kw = dict(flags=FLAGS, action="none", prove="acting", verdicts=verdicts, act="observe")
    d, _ = _run(tmp_path, "deferred", **kw)
    s, _ = _run(tmp_path, "in_step", defer=False, **kw)
    off, _ = _run(tmp_path, "off", flags=FLAGS, action="none", prove="off", act="observe")
    (pd, sd), (po, so) = _state(d), _state(off)
    assert all(torch.equal(x, y) for x, y in zip(pd, po))
    assert all(x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]) for x, y in zip(sd, so))
    _assert_same_run(d, s)
    assert not d.ledger.quarantine and not any(r[1] for r in d.ledger.rows)  # no update withheld
    assert d.recovery.prover.proofs == 3 and d.recovery.breaker.steps == []  # nothing acted: nothing counted


def test_a_quarantine_the_bound_refuses_leaves_the_step_to_the_ladder(tmp_path):
    refused = {"coverage": {"refused": "masking them would leave 1 of the next 1000 steps with nothing"}}
    verdicts = {s: ("bad_data", "masked", refused) for s in FLAGS}
    d, _ = _run(tmp_path, "deferred", flags=FLAGS, action="skip_update", prove="acting", verdicts=verdicts)
    s, _ = _run(tmp_path, "in_step", flags=FLAGS, action="skip_update", prove="acting", verdicts=verdicts,
                defer=False)
    _assert_same_run(d, s)
    assert not d.ledger.quarantine  # nothing quarantined
    assert (3, True, "bad_data") in d.ledger.rows  # the ladder's skip_update took the step
    assert [a["action"] for a in d.ledger.actions] == ["skip_update"] * 3


def test_data_convicted_on_a_broken_model_is_recorded_not_acted_on(tmp_path):
    """Issue 77: a conviction needs a healthy state. The model's health says it broke at step 1
    (``History.broken_since``): the proofs' bad data is held back (``unhealthy``), the proof says
    when the model broke, nothing is quarantined, and the ladder takes the steps."""
    verdicts = {s: ("bad_data", "masked") for s in FLAGS}
    t = _Trainer(tmp_path / "broken", flags=FLAGS, action="skip_update", prove="acting")
    t.recovery.prover = _Prover(t, "acting", verdicts)
    t.ledger.broken_since = 1
    t.train()
    assert not t.ledger.quarantine and (3, True, "bad_data") in t.ledger.rows
    proofs = [p for p in t.ledger.proof_records if p is not None and p.verdict == "bad_data"]
    assert proofs and all(p.held_back == "unhealthy" and p.health == {"broken_since": 1} for p in proofs)


def test_the_breaker_holds_back_the_action_past_its_limit_and_records_the_pause(tmp_path):
    verdicts = {s: ("hardware", "none") for s in FLAGS}
    d, _ = _run(tmp_path, "deferred", flags=FLAGS, action="none", prove="acting", verdicts=verdicts,
                breaker=(1, 3))
    s, _ = _run(tmp_path, "in_step", flags=FLAGS, action="none", prove="acting", verdicts=verdicts,
                breaker=(1, 3), defer=False)
    _assert_same_run(d, s)
    # step 3's proof withholds its update (an action); step 4 would be the second within 3
    # steps: held back, its update applied; step 9 is a window later: acting again
    assert [(r[0], r[1]) for r in d.ledger.rows if r[2] == "hardware"] == [(3, True), (4, False), (9, True)]
    ev = [e for e in d.ledger.events if "breaker" in e]
    assert [e["breaker"] for e in ev] == ["paused", "resumed"] and ev[0]["step"] == 4, ev
    assert any("the response is thrashing: 1 actions in 3 steps" in e.get("alert", "") for e in d.ledger.events)


def test_a_proof_that_fails_decides_the_step_as_without_a_proof(tmp_path):
    """No failure inside the response stops training: the step goes to the ladder, as with
    ``prove = "off"``, and the run trains as that run does."""
    verdicts = {s: ("fail", "original") for s in FLAGS}
    d, _ = _run(tmp_path, "failing", flags=FLAGS, action="skip_update", prove="acting", verdicts=verdicts)
    off, _ = _run(tmp_path, "off", flags=FLAGS, action="skip_update", prove="off")
    (pd, sd), (po, so) = _state(d), _state(off)
    assert all(torch.equal(x, y) for x, y in zip(pd, po))
    assert all(x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]) for x, y in zip(sd, so))
    assert [(r[0], r[1]) for r in d.ledger.rows] == [(r[0], r[1]) for r in off.ledger.rows]


def test_recovery_checkpoints_the_ladder_the_note_budget_and_the_breaker_and_a_rollback_keeps_its_own(tmp_path):
    """``Recovery`` owns the answers' history (issue 63); the trainer checkpoints it under
    the keys checkpoints always had (``ledger_ladder`` ...), and the steps the prover found
    the model spiking on its own (issue 68). A resumed process takes all four; an
    in-process rollback's load keeps the ladder's, breaker's and model-made history (what
    this process saw) and takes the note budget's."""
    a = _Trainer(tmp_path / "a", flags={}, action="skip_update,rollback", breaker=(1, 50)).recovery
    a.ladder.on_spike(3)
    a.breaker.record(3)
    a.breaker.allows(4)  # past its limit: paused
    for _ in range(8):
        a.note_budget.spend(5)
    a.prover.model_made = [31]
    state = a.state_dict()
    assert set(state) == {"ladder", "note_budget", "breaker", "model_made"}
    assert all(isinstance(v, str) for v in state.values())

    b = _Trainer(tmp_path / "b", flags={}, action="skip_update,rollback", breaker=(1, 50)).recovery
    fresh = b.state_dict()
    assert fresh != state
    b.load_state_dict(state)
    assert b.state_dict() == state and b.breaker.paused and not b.note_budget.allows(5)
    assert b.prover.model_made == [31]

    c = _Trainer(tmp_path / "c", flags={}, action="skip_update,rollback", breaker=(1, 50)).recovery
    with c._keeping_history():
        c.load_state_dict(state)
    assert c.state_dict()["ladder"] == fresh["ladder"] and c.state_dict()["breaker"] == fresh["breaker"]
    assert c.state_dict()["note_budget"] == state["note_budget"] and c.prover.model_made == []
    c.load_state_dict({})  # a checkpoint from before these existed: as built
    assert c.state_dict()["ladder"] == fresh["ladder"]


def test_the_ledger_is_drained_before_every_checkpoint_torchtitan_saves_the_first_step_included(tmp_path):
    """One checkpoint-due rule (issue 69), torchtitan's own ``_should_save``, asked by the
    trainer's drain and the response's deferral: with ``enable_first_step_checkpoint`` a
    flagged step 1 is decided in the step and its row is on disk before step-1's checkpoint
    (the drain used to miss the first step); so are the interval's and the last step's."""
    t, _ = _run(tmp_path, "first", flags={1: (True, False), 6: (True, False)}, action="skip_update", ckpt=4,
                first_ckpt=True, steps=10)
    assert sorted(t.saved) == [1, 4, 8, 10]
    assert all(t.rows_at_save[s][-1] == s for s in t.saved), t.rows_at_save
    assert [s for s in range(1, 11) if t.checkpoint_due(s)] == [1, 4, 8, 10]
    t.checkpointer.load_only = True  # torchtitan's load_only saves nothing: nothing is due
    assert not any(t.checkpoint_due(s) for s in range(1, 11))
