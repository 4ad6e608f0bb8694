"""Host snapshots (``components.response.snapshots``) and the window proof's decision
(``verdict.window_verdict``): no processes.

The snapshot's promise is bit-equality: a model and its AdamW trained k steps from a
restored snapshot end where the uninterrupted run ended, and the state at the alarm,
restored after a replay that changed the optimizer's settings, continues as if the
replay never ran."""

from __future__ import annotations

import pytest
import torch
from doubles import HostDouble, LedgerDouble
from helpers import proof_record, run_facts
from torch import nn

from titan_ledger.components.detection.stall import StallConfig
from titan_ledger.components.ledger.sections import RehearsalConfig
from titan_ledger.components.response.config import SnapshotsConfig, WindowConfig
from titan_ledger.components.response.snapshots import HostState, SnapshotRing
from titan_ledger.components.response.verdict import window_verdict
from titan_ledger.components.response.window_proof import WindowProof
from titan_ledger.errors import ConfigError
from titan_ledger.format.answers.causes import WINDOW_CAUSE


def model_and_adam(seed: int = 0, fused: bool = False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-15, fused=fused)
    return model, opt


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def train(model, opt, data) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def state_bits(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out.extend(v.clone() for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor))
    return out


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fused", [False, True])
def test_a_restored_snapshot_trains_to_the_same_bits_as_the_uninterrupted_run(fused):
    data = batches(12)
    model, opt = model_and_adam(fused=fused)
    train(model, opt, data[:5])
    snap = HostState().capture(list(model.parameters()), [opt])
    losses = train(model, opt, data[5:])
    end = state_bits(model, opt)
    snap.restore(list(model.parameters()), [opt])
    assert train(model, opt, data[5:]) == losses
    assert same_bits(state_bits(model, opt), end)


def test_a_snapshot_is_a_copy_not_a_view_and_the_tensors_keep_their_identity():
    model, opt = model_and_adam()
    train(model, opt, batches(2))
    params = list(model.parameters())
    ids = [id(p) for p in params] + [id(v) for p in params for v in opt.state[p].values()]
    snap = HostState().capture(params, [opt])
    before = state_bits(model, opt)
    train(model, opt, batches(3, seed=7))
    opt.param_groups[0]["lr"], opt.param_groups[0]["betas"] = 0.5, (0.9, 0.95)  # a scheduler, a variant
    assert not same_bits(state_bits(model, opt), before)
    snap.restore(params, [opt])
    assert same_bits(state_bits(model, opt), before)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert ids == [id(p) for p in params] + [id(v) for p in params for v in opt.state[p].values()]
    n_state = sum(v.numel() * v.element_size() for p in params for v in opt.state[p].values())
    assert snap.nbytes == sum(p.numel() * p.element_size() for p in params) + n_state


def test_a_snapshot_from_before_the_first_step_restores_what_lazy_initialisation_creates():
    """A run's first snapshot (the init, before Adam has state): restoring it zeroes the
    moments and the step count, and the next steps equal a fresh optimizer's bit for bit."""
    data = batches(6)
    model, opt = model_and_adam()
    snap = HostState().capture(list(model.parameters()), [opt])
    assert snap.opt == [None] * len(list(model.parameters()))
    fresh = train(model, opt, data)
    end = state_bits(model, opt)
    snap.restore(list(model.parameters()), [opt])
    assert train(model, opt, data) == fresh
    assert same_bits(state_bits(model, opt), end)


def test_a_buffer_set_is_reused_when_the_shapes_match():
    model, opt = model_and_adam()
    train(model, opt, batches(1))
    snap = HostState().capture(list(model.parameters()), [opt])
    buffers = [id(b) for b in snap.params]
    train(model, opt, batches(2, seed=3))
    snap.capture(list(model.parameters()), [opt])
    assert [id(b) for b in snap.params] == buffers
    assert all(torch.equal(b, p.detach()) for b, p in zip(snap.params, model.parameters()))


def test_restoring_state_a_parameter_never_had_is_refused():
    model, opt = model_and_adam()
    train(model, opt, batches(1))
    snap = HostState().capture(list(model.parameters()), [opt])
    with pytest.raises(RuntimeError, match="backwards in time"):
        snap.restore(list(model.parameters()), [torch.optim.AdamW(model.parameters())])


# --------------------------------------------------------------------------- the decision
def test_one_variant_alone_removing_the_spike_proves_its_cause():
    cause, why, fixes = window_verdict(False, {"lr": True, "adam": False}, {"lr": 0.4, "adam": 0.0})
    assert cause == "lr" and "not by adam" in why and "loss +0.4 over the window's last steps" in why
    assert fixes == [{"variant": "lr", "cause": "lr", "cost": 0.4}]
    assert WINDOW_CAUSE[cause] == "lr" and WINDOW_CAUSE["adam"] == "optimizer_state"


def test_an_unreproduced_window_proves_nothing_even_when_a_variant_is_normal():
    cause, why, fixes = window_verdict(True, {"lr": True})
    assert cause is None and "did not reproduce" in why and fixes == []


def test_where_several_fixes_remove_it_the_cheapest_names_the_cause_and_the_others_are_said():
    """Issue 61: "QK-clip removes it at no loss cost; LR x 0.3 also does, +0.4 loss" --
    the truth may be LR-driven logit growth; the cheapest fix is the one a user wants."""
    cause, why, fixes = window_verdict(False, {"lr": True, "logit_cap": True, "eps": False, "zloss": True},
                                       {"lr": 0.4, "logit_cap": 0.01, "eps": 0.0, "zloss": None})
    assert cause == "logit_cap" and [f["variant"] for f in fixes] == ["logit_cap", "lr", "zloss"]
    assert [f["cause"] for f in fixes] == ["logit_growth", "lr", "output_logits"]
    assert "also removed by lr (loss +0.4 over the window's last steps), zloss (cost unknown)" in why
    assert why.endswith("not by eps")


def test_no_variant_removing_it_is_unproven():
    cause, why, fixes = window_verdict(False, {"lr": False, "adam": False})
    assert cause is None and "no variant" in why and fixes == []


# --------------------------------------------------------------------------- the ring
def _Cfg(every: int, keep: int) -> SnapshotsConfig:
    return SnapshotsConfig(every=every, keep=keep)


def _ring(t) -> SnapshotRing:
    """The ring as ``Recovery`` builds it: the run's ``[ledger.snapshots]``, batches kept
    while a window proof can run (``[ledger.proof] scope`` not off)."""
    return SnapshotRing(t, t.ledger, run_facts(t), t.config.ledger.snapshots, replays=t.prove != "off")


class _Rec:
    def __init__(self, step: int) -> None:
        self.step, self.batches, self.proof, self.update_skipped = step, [[step]], None, False


class _Trainer(HostDouble):
    """What ``SnapshotRing`` reads of a ``LedgerTrainer``: a model, its optimizers, the
    state dicts a rollback restores."""

    class _Sched:
        def state_dict(self):
            return {"last_epoch": 3}

        def load_state_dict(self, sd):
            pass

    class _Loader:
        def __init__(self) -> None:
            self.position = 96

        def state_dict(self):
            return {"position": torch.tensor(self.position)}

        def load_state_dict(self, sd):
            self.position = int(sd["position"])

    def __init__(self, every: int, keep: int, prove: str = "all", exclude: tuple = ()) -> None:
        super().__init__()
        self.model, opt = model_and_adam()
        self.model_parts = [self.model]
        self.optimizers = type("Opts", (), {"optimizers": [opt]})()
        self.lr_schedulers, self.dataloader = self._Sched(), self._Loader()
        self.device = torch.device("cpu")
        self.step = 1
        self.prove = prove
        ledger = type("L", (), {"snapshots": _Cfg(every, keep), "rehearsal": RehearsalConfig(),
                                "stall": StallConfig()})()
        self.ledger = LedgerDouble()  # (its ``onset``: the stall rule's, History.stall_onset)
        checkpoint = type("K", (), {"exclude_from_loading": list(exclude)})()
        self.config = type("C", (), {"ledger": ledger, "checkpoint": checkpoint})()
        self.ready()

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def _steps(t, ring, first: int, last: int, proofs: dict | None = None) -> None:
    """Steps ``first..last`` as ``Recovery`` drives the ring: at each step's start (a
    snapshot due after the previous step is taken there), before its update, after its
    decision (``proofs``: a step's proof record)."""
    for step in range(first, last + 1):
        t.step = step
        ring.at_start()
        rec = _Rec(step)
        rec.proof = (proofs or {}).get(step)
        ring.log_step(rec)
        ring.after_decision(rec)


def test_the_ring_keeps_keep_snapshots_and_the_steps_since_the_oldest():
    t = _Trainer(every=10, keep=3)
    ring = _ring(t)
    ring.at_start()
    _steps(t, ring, 1, 35)
    t.step = 36
    ring.at_start()
    assert [s.step for s in ring.ring] == [10, 20, 30]
    assert sorted(ring.log) == list(range(11, 36))
    assert ring.window(35).step == 10 and ring.window(12).step == 10
    assert ring.window(11) is None  # no update between the snapshot and the step: nothing a variant changes
    assert ring.covering(25, checkpoint=20).step == 20 and ring.covering(25, checkpoint=21) is None
    assert ring.covering(9, checkpoint=None) is None
    assert ring.ring[0].run["dataloader"]["position"].item() == 96  # a host copy for a rollback


def test_a_stall_anchor_keeps_the_snapshot_at_the_stall_rules_onset_while_a_stall_proof_can_run():
    """A stall builds over hundreds of steps: its window proof re-runs from the snapshot at
    the stall rule's onset (``--ledger.snapshots.stall_anchor``), which outlives the ring."""
    t = _Trainer(every=10, keep=2)
    ring = _ring(t)

    ring.at_start()
    t.ledger.onset = 15  # the best window ended at step 15 (its row written)
    _steps(t, ring, 1, 16)
    assert ring.anchor.step == 10 and [s.step for s in ring.ring] == [0, 10]
    _steps(t, ring, 17, 55)
    assert [s.step for s in ring.ring] == [40, 50] and ring.anchor.step == 10 and not ring.failures
    assert sorted(ring.log) == list(range(11, 56))  # the batches since the anchor
    assert ring.window(56, stall=True).step == 10 and ring.window(56).step == 40
    assert ring.nbytes == 3 * ring.ring[0].tensors.nbytes
    pinned = ring.anchor.tensors
    t.ledger.onset = 45  # the loss improved again: the newest snapshot at or before the new onset
    _steps(t, ring, 56, 56)
    assert ring.anchor.step == 40 and sorted(ring.log)[0] == 41
    assert pinned not in ring._spare and ring.nbytes == 2 * ring.ring[0].tensors.nbytes  # the old copy freed
    bound = (t.config.ledger.stall.patience + 2) * t.config.ledger.stall.window
    t.ledger.onset = 56 - bound - 1
    _steps(t, ring, 57, 57)  # an onset no snapshot of the ring is at or before: nothing pinned
    assert ring.anchor is None and ring.window(58, stall=True).step == 40  # the ring's oldest
    t.ledger.onset = 55
    _steps(t, ring, 58, 58)
    assert ring.anchor.step == 50
    ring.stall_proofs = 1  # --ledger.window.max_stall_proofs spent: no stall proof will read it
    _steps(t, ring, 59, 59)
    assert ring.anchor is None
    ring.stall_proofs, t.ledger.onset = 0, 58
    _steps(t, ring, 60, 61)
    assert ring.anchor.step == 50
    _steps(t, ring, 62, 50 + bound)  # the loss never improves again: the anchor is kept up to the bound ...
    assert ring.anchor.step == 50 and sorted(ring.log)[0] == 51
    _steps(t, ring, 51 + bound, 51 + bound)  # ... counted from the snapshot's step, then dropped
    assert ring.anchor is None and sorted(ring.log)[0] > 51
    t.ledger.onset = 345
    _steps(t, ring, 52 + bound, 52 + bound)
    assert ring.anchor.step == 340
    ring.clear()  # what the replay cannot repeat releases the anchor with the ring
    assert ring.anchor is None and ring.nbytes == 0
    t.config.ledger.snapshots.stall_anchor = False
    t.ledger.onset = 360
    _steps(t, ring, 53 + bound, 53 + bound + 20)
    assert ring.anchor is None


def test_a_step_whose_applied_update_the_replay_cannot_repeat_resets_the_ring():
    t = _Trainer(every=10, keep=2)
    ring = _ring(t)
    ring.at_start()
    _steps(t, ring, 1, 15, proofs={14: proof_record("bad_data", "masked")})
    assert [s.step for s in ring.ring] == [14] and sorted(ring.log) == [15]
    assert ring.window(16).step == 14 and ring.window(14) is None
    assert ring.ring[0].run["trainer"]["step"] == 14  # what a checkpoint of step 14 holds
    rec = _Rec(16)
    rec.proof = proof_record("hardware", "same")
    ring.after_decision(rec, late=True)  # decided a step late: nothing to snapshot, the ring is cleared
    assert ring.ring == [] and ring.window(17) is None


def test_a_buffer_an_optimizer_step_hook_moves_is_in_the_snapshot():
    """MoE load balancing: ``expert_bias`` (a persistent buffer) is moved by a hook on
    ``optimizers.step()``, from counts a forward fills; a replay runs both, so it must
    start from the buffers' bits as well as the parameters'."""
    t = _Trainer(every=10, keep=2)
    model, opt = t.model, t.optimizers.optimizers[0]
    model.register_buffer("expert_bias", torch.zeros(4))
    model.register_buffer("tokens_per_expert", torch.zeros(4), persistent=False)
    opt.register_step_post_hook(lambda o, *_: (model.expert_bias.add_(model.tokens_per_expert.sign()),
                                               model.tokens_per_expert.zero_()))

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        model.tokens_per_expert.add_(out.detach().sum(0))
        ((out - y) ** 2).mean().backward()
        opt.step()

    data = batches(6)
    for x, y in data[:2]:
        step(x, y)
    ring = _ring(t)
    ring.capture(2)
    for x, y in data[2:]:
        step(x, y)
    end = [b.clone() for b in model.buffers()] + state_bits(model, opt)
    assert model.expert_bias.abs().sum() > 0
    ring.restore_run(ring.ring[0])
    for x, y in data[2:]:
        step(x, y)
    assert same_bits([b.clone() for b in model.buffers()] + state_bits(model, opt), end)


def test_a_rollback_from_the_ring_restores_what_the_checkpoint_load_would():
    t = _Trainer(every=10, keep=2, exclude=("dataloader", "optimizer"))
    model, opt = t.model, t.optimizers.optimizers[0]
    train(model, opt, batches(2))
    ring = _ring(t)
    ring.capture(2)
    params = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    train(model, opt, batches(3, seed=9))
    t.dataloader.position, t.step = 160, 5
    ring.restore_run(ring.ring[0])
    assert same_bits([p.detach() for p in model.parameters()], params)  # the model: always
    assert t.step == 2  # the train state: not excluded
    assert t.dataloader.position == 160  # --checkpoint.exclude_from_loading dataloader
    assert not same_bits([opt.state[p]["exp_avg"] for p in model.parameters()], moments)  # ... optimizer


def test_a_ring_only_a_rollback_reads_keeps_no_batches():
    t = _Trainer(every=10, keep=2, prove="off")
    ring = _ring(t)
    ring.at_start()
    _steps(t, ring, 1, 14)
    assert [s.step for s in ring.ring] == [0, 10] and ring.log == {}


def test_the_window_proof_runs_on_an_acting_not_data_proof_within_its_budget():
    t = _Trainer(every=10, keep=2)
    ring = _ring(t)
    proof = WindowProof(t, t.ledger, run_facts(t), ring)
    assert proof.wanted(proof_record("not_data", acting=True))
    assert not proof.wanted(proof_record("not_data", acting=False))  # a note
    assert proof.wanted(proof_record("bad_data", acting=False))  # data convicted: does the LR remove it too?
    assert not proof.wanted(proof_record("hardware", acting=True))
    assert not proof.wanted(proof_record("outlier", acting=False))
    assert proof.wanted(proof_record("outlier", acting=False), forced=True)  # --ledger.rehearsal.prove_at
    ring.proofs = 2
    assert not proof.wanted(proof_record("not_data", acting=True))
    # a stall has a budget of its own: the spikes before it have not spent it
    assert proof.wanted(proof_record("outlier", acting=False), forced=True, stall=True)
    ring.stall_proofs = 1
    assert not proof.wanted(proof_record("outlier", acting=False), forced=True, stall=True)


def test_the_config_names_the_flag_to_fix():
    from titan_ledger.components.response.config import SnapshotsConfig

    with pytest.raises(ConfigError, match="--ledger.window.causes"):
        WindowConfig(causes=["lr", "logits"])
    with pytest.raises(ConfigError, match="--ledger.snapshots.every"):
        SnapshotsConfig(every=-1)
    with pytest.raises(ConfigError, match="lr_factor"):
        WindowConfig(lr_factor=2.0)
