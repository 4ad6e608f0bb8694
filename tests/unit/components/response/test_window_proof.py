"""titan_ledger.components.response.window_proof: ``WindowProof.prove`` on a real model and
a real AdamW (no processes), through the real ``SnapshotRing`` and ``Reexecution``.

The run: a linear regression trained by AdamW at LR 1.0 (Adam's sign-like steps of size
~LR leave the weights oscillating about the target; the gradient is the distance from it),
against a detector whose history is a healthy LR's (grad norm ~0.11). The window re-run
unchanged reproduces the flagged step's large gradient; at 0.1x the LR the weights stay
within 0.1 of the target and the step is normal: ``lr`` proven, by intervention. Every
variant draws the same random numbers (the RNG rewound before each), and what the proof
touched -- weights, moments, step counts, gradients, LRs, the RNG -- is as before it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from doubles import HostDouble, LedgerDouble
from helpers import proof_record, run_facts

from titan_ledger.components.detection.spikes import SpikeDetector
from titan_ledger.components.detection.stall import StallConfig
from titan_ledger.components.ledger.sections import RehearsalConfig
from titan_ledger.components.response.config import SnapshotsConfig, WindowConfig
from titan_ledger.components.response.snapshots import SnapshotRing
from titan_ledger.components.response.window_proof import UNCHANGED, WindowProof

TARGET = torch.tensor([[0.3, -0.2, 0.5, 0.1], [-0.4, 0.2, 0.0, 0.6]])


class _Rec:
    def __init__(self, step: int) -> None:
        self.step, self.batches, self.proof, self.update_skipped = step, [[("rows", step)]], None, False


class _Trainer(HostDouble):
    """The ``Host`` surface the window proof and the ring use, around one real model."""

    def __init__(self, lr: float = 1.0, causes: tuple[str, ...] = ("lr", "adam", "eps")) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            self.model.weight.copy_(TARGET + 0.01)
        self.model_parts = [self.model]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=0.0)
        self.optimizers = SimpleNamespace(optimizers=[self.opt], step=self.opt.step)
        self.device = torch.device("cpu")
        self.step, self.ntokens_seen, self.step_record = 0, 0, None
        self.validator = self.checkpointer = self.metrics_processor = None
        self.gradient_accumulation_steps = self.num_pipeline_parallel_microbatches = 1
        self.loss_fn = None  # (not titan_ledger's loss: no z-loss variant)
        self.dataloader = SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda sd: None)
        self.lr_schedulers = SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda sd: None)
        self.config = SimpleNamespace(ledger=SimpleNamespace(
            snapshots=SnapshotsConfig(every=4, keep=3), window=WindowConfig(causes=list(causes)),
            rehearsal=RehearsalConfig(), stall=StallConfig()))
        detector = SpikeDetector(SpikeDetector.Config(window=16), "cpu")
        for i in range(20):  # a history of a healthy LR: loss ~0.006, grad norm ~0.11, +-30%
            detector.step(torch.tensor(0.006 * (1 + 0.3 * (i % 3 - 1)), dtype=torch.float64),
                          torch.tensor(0.11 * (1 + 0.3 * (i % 3 - 1)), dtype=torch.float64))
        self.ledger = LedgerDouble(detector=detector)
        self.draws: list[float] = []  # every random number an execution drew (dropout's stand-in)
        self.ready()

    def state_dict(self):
        return {"step": self.step}

    def execute(self, groups, need_loss=True):
        self.draws.append(float(torch.rand(())))
        self.ntokens_seen += 8
        loss = 0.5 * (self.model.weight - TARGET).square().sum()
        loss.backward()
        return loss.detach(), self.model.weight.grad.norm(), torch.tensor(8), torch.tensor(8)

    def train(self, steps: int, ring: SnapshotRing) -> _Rec:
        """``steps`` steps through the ring's protocol; the last one is held (not updated)."""
        for step in range(1, steps + 1):
            self.step = step
            ring.at_start()  # (at the first step: the state it starts from, step 0)
            rec = _Rec(step)
            self.model.weight.grad = None
            self.execute(rec.batches)
            if step == steps:
                return rec  # the flagged step: its update held, its gradients in place
            ring.log_step(rec)
            self.opt.step()
            ring.after_decision(rec)
        raise AssertionError("unreachable")


def _state(t: _Trainer):
    st = t.opt.state[t.model.weight]
    return (t.model.weight.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(), st["step"].clone(),
            t.model.weight.grad.clone(), [g["lr"] for g in t.opt.param_groups],
            [(g["betas"], g["eps"]) for g in t.opt.param_groups], torch.get_rng_state())


def test_the_lr_is_proven_by_its_own_fix_and_the_run_is_left_as_it_was():
    t = _Trainer()
    ring = SnapshotRing(t, t.ledger, run_facts(t), t.config.ledger.snapshots)
    rec = t.train(11, ring)
    assert [s.step for s in ring.ring] == [0, 4, 8] and ring.window(11).step == 0
    before = _state(t)
    w = WindowProof(t, t.ledger, run_facts(t), ring, t.config.ledger.window)
    assert w.wanted(proof_record("not_data"))
    out = w.prove(rec)
    runs = {r["variant"]: r for r in out["runs"]}
    # the unchanged re-run reproduces the flag; 0.1x the LR removes it; Adam's beta2 0.95 and
    # epsilon 1e-6 do not (the weights' oscillation is the LR's, not the second moment's)
    assert out["cause"] == "lr" and out["from_step"] == 0 and out["steps"] == 11, out["why"]
    assert not runs[UNCHANGED]["normal"] and runs["lr"]["normal"]
    assert not runs["adam"]["normal"] and not runs["eps"]["normal"]
    assert runs["lr"]["grad_norm"] < 0.1 * runs[UNCHANGED]["grad_norm"]
    assert runs[UNCHANGED]["cost"] == 0.0 and runs["lr"]["cost"] < 0  # the fix's loss against the unchanged run
    assert [f["variant"] for f in out["fixes"]] == ["lr"] and ring.proofs == 1
    assert "not by adam, eps" in out["why"]
    after = _state(t)
    for a, b in zip(before, after):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)


def test_every_variant_draws_the_same_random_numbers():
    t = _Trainer()
    ring = SnapshotRing(t, t.ledger, run_facts(t), t.config.ledger.snapshots)
    rec = t.train(11, ring)
    n = len(t.draws)
    out = WindowProof(t, t.ledger, run_facts(t), ring, t.config.ledger.window).prove(rec)
    per_variant = len(t.draws[n:]) // len(out["runs"])
    assert per_variant == 11  # steps 1-10 replayed, then the flagged step 11
    chunks = [t.draws[n + i * per_variant:n + (i + 1) * per_variant] for i in range(len(out["runs"]))]
    assert all(c == chunks[0] for c in chunks)  # rewound before each variant
    assert chunks[0] != t.draws[n - 11:n]  # (the run's own draws are not kept: not the run's numbers)


def test_a_stall_is_judged_by_the_loss_a_fix_lowers_and_has_its_own_budget():
    t = _Trainer()
    ring = SnapshotRing(t, t.ledger, run_facts(t), t.config.ledger.snapshots)
    rec = t.train(11, ring)
    ring.proofs = t.config.ledger.window.max_proofs  # the spikes spent theirs
    w = WindowProof(t, t.ledger, run_facts(t), ring, t.config.ledger.window)
    assert not w.wanted(proof_record("not_data"))
    assert w.wanted(proof_record("outlier", acting=False), forced=True, stall=True)
    out = w.prove(rec, stall=True)
    assert out["stall"] and ring.stall_proofs == 1 and ring.proofs == t.config.ledger.window.max_proofs
    runs = {r["variant"]: r for r in out["runs"]}
    # the window's last steps' loss is lower at 0.1x the LR: that fix "lowered the loss"
    assert runs["lr"]["cost"] < 0 and out["cause"] == "lr" and out["why"].startswith("the stall: ")
    assert "the lr variant lowered the loss" in out["why"] and "spike" not in out["why"], out["why"]


@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_a_variant_that_fails_puts_everything_back(kind):
    from titan_ledger.errors import ProofFailure

    t = _Trainer()
    t.config.ledger.rehearsal = RehearsalConfig(response_fault=f"window:{kind}")
    ring = SnapshotRing(t, t.ledger, run_facts(t), t.config.ledger.snapshots)
    rec = t.train(11, ring)
    before = _state(t)
    with pytest.raises((ProofFailure, RuntimeError)):
        WindowProof(t, t.ledger, run_facts(t), ring, t.config.ledger.window).prove(rec)
    for a, b in zip(before, _state(t)):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
