"""titan_ledger.components.response.prover: the flagged step re-executed before its
update, on a fake trainer around a real model (one process, world size 1; the verdicts'
pure rules are test_verdict.py's, the multi-rank masks the e2e proofs').

Each outcome the prover can reach without a suspect rank -- ``not_data`` (reproducible,
abnormal or normal), ``hardware`` applying the repeats' update (the first execution was
faulty), ``hardware`` applying the first (a repeat was), ``hardware`` applying nothing
(no two agree, bit for bit) -- in the step (the applied gradients are left in place)
and deferred (from the first execution's checksum; ``load_update`` executes the step
once more when the gradients are gone), with what the proof touched put back.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from doubles import HostDouble, LedgerDouble
from helpers import run_facts

from titan_ledger.components.detection.spikes import SpikeDetector
from titan_ledger.components.ledger.sections import RehearsalConfig
from titan_ledger.components.response.config import ConvictionConfig, ProofConfig
from titan_ledger.components.response.first_execution import FirstExecution
from titan_ledger.components.response.prover import Prover
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.sums import loss_sum


class _Trainer(HostDouble):
    """``execute`` trains a linear model on the step's batch; ``noise`` maps an execution
    number (0: the first) to a factor on its loss, a transient fault in that execution."""

    def __init__(self, noise: dict[int, float] | None = None, grad_norm: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.model_parts = [self.model]
        self.device = torch.device("cpu")
        self.executions = 0
        self.noise = noise or {}
        self.x, self.y = torch.randn(8, 4), torch.randn(8, 2)
        self.config = SimpleNamespace(
            training=SimpleNamespace(max_norm=1e9, seq_len=4),
            ledger=SimpleNamespace(proof=ProofConfig(scope="acting", bisect=False), conviction=ConvictionConfig(),
                                   rehearsal=RehearsalConfig(), spike=SpikeDetector.Config(doc_outlier_floor=0.7)))
        detector = SpikeDetector(SpikeDetector.Config(window=16), "cpu")
        for i in range(20):  # a calm history: loss ~2, grad norm ~grad_norm
            detector.step(torch.tensor(2.0 + 0.01 * (i % 3), dtype=torch.float64),
                          torch.tensor(grad_norm * (1 + 0.01 * (i % 2)), dtype=torch.float64))
        self.ledger = LedgerDouble(
            detector=detector, global_batch=8,
            # every document its own content, 4 tokens, of an unknown corpus size (a text source)
            loader=SimpleNamespace(document_facts=lambda s, d: (4, f"{s}{d}"), corpus_share=lambda s, n: None))
        self.quarantined = self.ledger.quarantined  # (docs, step) the proofs convicted
        self.ready()

    def execute(self, groups, need_loss=True):
        k = self.executions
        self.executions += 1
        self.ntokens_seen += 8
        loss = (self.model(self.x) - self.y).square().mean() * self.noise.get(k, 1.0)
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.model.parameters()]))
        return loss.detach(), norm, torch.tensor(8), torch.tensor(8)

    def first(self, rec):
        """The step's first execution, as ``_train_step`` and ``Ledger.record`` leave it."""
        loss, norm, tokens, global_tokens = self.execute(rec.batches)
        self.ledger.last_execution = (loss_sum(loss, global_tokens), int(tokens), norm)
        return [p.grad for p in self.model.parameters()]


def _prove(trainer, deferred: bool):
    rec = StepRecord(step=21, start=0.0, batches=[["the step's batch"]])
    grads = trainer.first(rec)
    first = FirstExecution.of(trainer.model_parts, trainer.device, trainer.ledger.last_execution) if deferred else None
    prover = Prover(trainer, trainer.ledger, run_facts(trainer), proof=trainer.config.ledger.proof, conviction=trainer.config.ledger.conviction)
    seen = trainer.ntokens_seen
    rec.proof = prover.prove(rec, acting=True, event={"rules": ["ratio"]}, first=first)
    proof = rec.proof.to_json()  # the record as written
    assert trainer.ntokens_seen == seen and trainer.step_record is None  # put back
    if not deferred:  # in the step, Recovery loads what it applies at once
        prover.load_update(rec, proof["applied"])
    return prover, rec, proof, grads


def _grads(trainer):
    return [p.grad.clone() for p in trainer.model.parameters()]


def _clean(trainer):
    """The gradients an execution without a fault leaves."""
    clean = _Trainer()
    clean.execute(None)
    return _grads(clean)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_reproducible_step_is_not_data_and_its_first_update_applied(deferred):
    t = _Trainer(grad_norm=0.01)  # the step's grad norm stands far above the history: abnormal
    prover, rec, proof, first = _prove(t, deferred)
    assert proof["verdict"] == "not_data" and proof["applied"] == "original"
    assert [e["variant"] for e in proof["executions"]] == ["original", "same"]
    assert proof["executions"][1]["bit_equal"] is True and proof["executions"][0]["normal"] is False
    assert prover.model_made == [21]  # the model made it abnormal, no data to blame: remembered
    if not deferred:  # in the step: the first execution's gradients are back, by reference
        assert all(p.grad is g for p, g in zip(t.model.parameters(), first))
    else:
        prover.load_update(rec, proof["applied"])  # the repeat's gradients are the first's: nothing to execute
        assert t.executions == 2 and rec.proof.update_recomputed is None


def test_a_normal_update_with_no_suspect_is_not_data_and_no_mask_runs():
    t = _Trainer(grad_norm=_Trainer().execute(None)[1].item())  # the history's grad norm is the step's
    _, _, proof, _ = _prove(t, False)
    assert proof["verdict"] == "not_data" and proof["executions"][0]["normal"] is True
    assert proof["why"] == "reproducible; the update is normal and no data is suspect"
    assert [e["variant"] for e in proof["executions"]] == ["original", "same"]


@pytest.mark.parametrize("deferred", [False, True])
def test_a_faulty_first_execution_is_hardware_and_the_repeats_update_is_applied(deferred):
    t = _Trainer(noise={0: 3.0})  # the first execution's loss tripled: its gradients too
    prover, rec, proof, first = _prove(t, deferred)
    assert proof["verdict"] == "hardware" and proof["applied"] == "same" and proof["ranks"] == [0]
    assert [e["variant"] for e in proof["executions"]] == ["original", "same", "same"]
    if deferred:
        prover.load_update(rec, "same")  # the last repeat's gradients are in place
        assert t.executions == 3 and rec.proof.update_recomputed is None
    clean = _clean(t)
    assert all(torch.equal(p.grad, g) for p, g in zip(t.model.parameters(), clean))


@pytest.mark.parametrize("deferred", [False, True])
def test_a_faulty_repeat_is_hardware_and_the_first_update_is_applied(deferred):
    t = _Trainer(noise={1: 3.0})  # the first repeat faulty; the second agrees with the first execution
    prover, rec, proof, first = _prove(t, deferred)
    assert proof["verdict"] == "hardware" and proof["applied"] == "original"
    if deferred:  # the first execution's gradients were overwritten: the step once more
        prover.load_update(rec, "original")
        assert rec.proof.to_json()["update_recomputed"] == "same" and t.executions == 4
    else:
        assert all(p.grad is g for p, g in zip(t.model.parameters(), first))
    assert all(torch.equal(p.grad, g) for p, g in zip(t.model.parameters(), _clean(t)))


def test_three_executions_that_differ_within_their_own_noise_reproduced_and_the_noise_is_recorded():
    """A machine without bit-for-bit execution: no execution stands 100x farther from the
    other two than the closest pair (the floor), so the step reproduced."""
    t = _Trainer(noise={0: 3.0, 1: 5.0, 2: 7.0})
    _, _, proof, _ = _prove(t, False)
    assert proof["verdict"] == "not_data" and proof["noise"]["factor"] == 100.0
    assert 0 < proof["noise"]["floor"] < 1


def test_no_two_executions_agreeing_beyond_any_noise_applies_nothing():
    t = _Trainer(noise={1: float("nan"), 2: float("inf")})  # every pair infinitely apart: no floor
    _, _, proof, _ = _prove(t, False)
    assert proof["verdict"] == "hardware" and proof["applied"] == "none"


# --------------------------------------------------------------------------- group testing
class _Documents(_Trainer):
    """Eight rows, one document each; document 5's targets are far off (bad data): its
    rows' labels decide which tokens count, so a mask removes a document's loss."""

    ROWS, SEQ, BAD = 8, 4, 5

    def __init__(self):
        super().__init__()
        self.config.ledger.proof.bisect = True
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(self.ROWS, 4, generator=g)
        self.y = torch.randn(self.ROWS, 2, generator=g)
        self.y[self.BAD] += 40.0
        detector = SpikeDetector(SpikeDetector.Config(window=16), "cpu")
        clean = self.execute(self.batches(mask={self.BAD}))[1].item()
        for p in self.model.parameters():
            p.grad = None
        self.executions = 0
        for i in range(20):  # the history: steps without the bad document
            detector.step(torch.tensor(2.0, dtype=torch.float64), torch.tensor(clean * (1 + 0.02 * (i % 3)),
                                                                                dtype=torch.float64))
        self.ledger.detector = detector

    def prover(self, rec, **kw) -> Prover:
        """A prover with an ordinary next step fetched (a deferred decision's control of the
        same novelty, issue 68): the step's documents again, the convicted one masked."""
        prover = Prover(self, self.ledger, run_facts(self), proof=self.config.ledger.proof, conviction=self.config.ledger.conviction)
        prover.next_rec = StepRecord(step=rec.step + 1, start=0.0, batches=self.batches(), tags=rec.tags or self.tags())
        for k, v in kw.items():
            setattr(prover, k, v)
        return prover

    def tags(self):
        from titan_ledger.data.layout import RowTag, Segment

        return [RowTag(r, "c", (Segment(r, 0, self.SEQ),)) for r in range(self.ROWS)]

    #: each row's token ids (its document's text): distinct documents, unless a test sets them equal
    tokens = torch.arange(ROWS * SEQ).view(ROWS, SEQ) * 7 + 3

    def batches(self, mask=()):
        labels = torch.ones(self.ROWS, self.SEQ, dtype=torch.long)
        for r in mask:
            labels[r] = -100
        return [[({"input": self.tokens}, labels)]]  # (execute trains the linear model on self.x)

    def execute(self, groups, need_loss=True):
        self.executions += 1
        labels = groups[0][0][1]
        keep = (labels != -100).float()  # (rows, tokens)
        err = (self.model(self.x) - self.y).square().sum(-1, keepdim=True)  # (rows, 1)
        tokens = keep.sum()
        loss = (err * keep).sum() / tokens
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.model.parameters()]))
        return loss.detach(), norm, tokens.long(), tokens.long()


@pytest.mark.parametrize("deferred", [False, True])
def test_group_testing_convicts_the_document_not_the_batch(deferred):
    t = _Documents()
    rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
    t.first(rec)
    first = FirstExecution.of(t.model_parts, t.device, t.ledger.last_execution) if deferred else None
    prover = t.prover(rec)
    rec.proof = prover.prove(rec, acting=True, event={"rules": ["ratio"]}, first=first)
    proof = rec.proof.to_json()  # the record as written
    assert proof["verdict"] == "bad_data" and proof["applied"] == "masked"
    assert proof["documents"] == [["c", t.BAD]] and proof["suspect"]["evidence"] == "bisection"
    rounds = proof["bisection"]
    assert len(rounds) == 3 and sum(e["variant"] == "bisect" for e in proof["executions"]) == 6  # log2(8) rounds
    # the convicted set's update, in place, recorded once, after the rounds; then the next step's control
    assert [e["variant"] for e in proof["executions"]][-8:] == ["bisect"] * 6 + ["masked", "novelty"]
    assert all(r["masked_normal"] != r["control_normal"] for r in rounds)
    assert "proof" not in rec.masked and not t.quarantined  # a proof decides nothing: Recovery acts
    prover.convict(rec, rec.proof)
    assert rec.masked["proof"] == [[t.BAD, 0]] and t.quarantined == [([("c", t.BAD)], 21)]
    prover.load_update(rec, "masked")  # the next step's control executed last: the convicted mask's update again
    assert rec.proof.update_recomputed == "masked"
    # the applied update is the step without the bad document
    ref = _Documents()
    ref.execute(ref.batches(mask={t.BAD}))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(t.model.parameters(), ref.model.parameters()))


def test_without_group_testing_the_step_is_not_data():
    t = _Documents()
    t.config.ledger.proof.bisect = False
    rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
    t.first(rec)
    proof = t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()
    assert proof["verdict"] == "not_data" and "bisection" not in proof


# --------------------------------------------------------------------------- Adam first, content, failures
def _adam_history(t, norms):
    """Real AdamW steps on gradients of these norms, the rows' levels fed the same norms
    (what a run's written rows give ``Ledger.adam_level``)."""
    from titan_ledger.components.signals.adam_level import AdamLevel

    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-6, betas=(0.9, 0.95))
    level = AdamLevel(0.95, 1000)
    g = torch.Generator().manual_seed(3)
    for n in norms:
        grads = [torch.randn(p.shape, generator=g) for p in t.model.parameters()]
        total = torch.linalg.vector_norm(torch.stack([x.norm() for x in grads]))
        for p, x in zip(t.model.parameters(), grads):
            p.grad = x * (n / total)
        opt.step()
        level.observe({"grad_norm_clipped": n})
    for p in t.model.parameters():
        p.grad = None
    t.optimizers = SimpleNamespace(optimizers=[opt])
    t.ledger.owned_params = list(t.model.parameters())
    t.ledger.adam_level = level


def test_adam_first_a_decayed_second_moment_is_optimizer_state_and_no_data_is_masked():
    """components.response.optimizer_state: after a plateau (gradients 1e-3 for 200 steps
    after 50 at 100) the step's Adam update recomputed with v restored to its long-run
    level is far smaller: ``optimizer_state``, and the masks never run (group testing
    would have convicted the document). After a healthy history at the step's own
    gradient scale, the same step convicts the document."""
    t = _Documents()
    _adam_history(t, [100.0] * 50 + [1e-3] * 200)
    rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
    t.first(rec)
    proof = t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()
    assert proof["verdict"] == "optimizer_state" and proof["applied"] == "original"
    assert proof["optimizer"]["amplification"] >= 2.0 and proof["optimizer"]["restore"] > 1e3
    assert [e["variant"] for e in proof["executions"]] == ["original", "same"] and "documents" not in proof
    t = _Documents()
    _adam_history(t, [20.0] * 250)
    rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
    t.first(rec)
    proof = t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()
    assert proof["verdict"] == "bad_data" and proof["optimizer"]["amplification"] == pytest.approx(1.0)


def test_a_convicted_document_whose_copy_the_step_also_trained_is_not_convicted():
    """The control must be other content: every document the same text (the memorisation
    plateau's corpus), so masking one explains nothing a mask of its copy would not -- by
    the tokens' shingles, not by ids or digests: a near-copy of another length counts."""
    t = _Documents()
    t.tokens = torch.full((t.ROWS, t.SEQ), 9)  # runs of one token (a tab run beside another)
    rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
    t.first(rec)
    proof = t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()
    assert proof["verdict"] == "not_data" and "near-copy of 1 of the 1 convicted documents" in proof["why"]
    assert proof["content"]["near_copies"] == {f"c:{t.BAD}": 1.0} and "would_apply" not in proof


def test_a_conviction_records_how_much_of_the_data_its_quarantine_would_mask():
    t = _Documents()
    t.ledger.loader = SimpleNamespace(document_facts=lambda s, d: (40 if d == t.BAD else 4, f"{d}"),
                                      corpus_share=lambda s, n: n / 1000)
    rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
    t.first(rec)
    proof = t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()
    # 8 rows x 4 tokens a step: a 40-token document could fill a whole step
    assert proof["verdict"] == "bad_data" and proof["coverage"]["tokens"] == 40
    assert proof["coverage"]["share"] == 0.04 and "whole step" in proof["coverage"]["refused"]


@pytest.mark.parametrize("fault", ["proof:raise", "proof:oom", "proof:timeout", "proof:nan", "bisect:raise"])
def test_a_proof_that_fails_raises_and_abandon_puts_the_first_gradients_back(fault):
    from titan_ledger.errors import ProofFailure
    from titan_ledger.rehearsal.faults import ResponseFault

    t = _Documents()
    t.config.ledger.rehearsal.response_fault = fault
    rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
    first = t.first(rec)
    prover = Prover(t, t.ledger, run_facts(t), proof=t.config.ledger.proof, conviction=t.config.ledger.conviction)
    seen = t.ntokens_seen
    with pytest.raises((ProofFailure, ResponseFault, torch.OutOfMemoryError)):
        prover.prove(rec, acting=True, event={"rules": ["ratio"]})
    assert t.ntokens_seen == seen and t.step_record is None  # the re-execution context put back
    prover.abandon(rec)
    assert all(p.grad is g for p, g in zip(t.model.parameters(), first)) and not prover._hits


def test_a_document_that_trained_before_without_a_flag_is_not_convicted():
    """Read back in the corpus's order: the convicted document trained 2 x 4 tokens in
    earlier steps. Both flagged: they prove nothing, the document is convicted. Neither
    flagged: it trained, twice as much of it as this step holds, without a flag -- what
    made this step abnormal is not its content (an ordinary code file convicted by group
    testing in ``bench/adversarial.py``'s code_tables run before this rule)."""
    from titan_ledger.data.layout import RowTag, Segment

    t = _Documents()
    t.config.training.local_batch_size = 8
    t.ledger.global_batch = 8
    tags = [RowTag(80 + r, "c", (Segment(r, 0, t.SEQ),)) for r in range(t.ROWS)]  # step 11: samples 80-87

    def scan(docs, first, steps, gb, max_rows=200_000):
        if first == 80:  # the flagged step and after: nothing emptied
            return {"steps": steps, "rows": steps * gb, "tokens": 4, "total": 10_000, "empty": [], "with": [[0, 4]]}
        assert (first, steps) == (0, 10)  # the ten steps before it
        return {"steps": 10, "rows": 80, "tokens": 8, "total": 320, "empty": [], "with": [[2, 4], [6, 4]]}

    t.ledger.loader = SimpleNamespace(document_facts=lambda s, d: (4, f"{d}"), corpus_share=lambda s, n: None, scan=scan)
    t.ledger.flagged_at = {16, 48}  # steps 3 and 7 (offsets 2 and 6) were flagged: they prove nothing
    rec = StepRecord(step=11, start=0.0, batches=t.batches(), tags=tags)
    t.first(rec)
    proof = t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()
    assert proof["verdict"] == "bad_data" and proof["coverage"]["ahead"]["before_clean"] == 0
    t.ledger.flagged_at = set()
    for p in t.model.parameters():
        p.grad = None
    rec = StepRecord(step=11, start=0.0, batches=t.batches(), tags=tags)
    t.first(rec)
    proof = t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()
    assert proof["verdict"] == "not_data" and "trained 8 tokens in earlier steps without a flag (4 here)" in proof["why"]


def test_a_run_that_flags_step_after_step_convicts_no_document():
    """The LR-1.0 divergence of the real set: from step 123 on, group testing convicted a
    document at 14 steps, each with 5-21 flags in the 64 steps before it (every planted
    document of the zoo: 0). With ``unstable_flags`` (4) flagged rows among the 64
    written before the step, the verdict is ``not_data``, saying why; 3 convict."""
    def proof_with(flags: int) -> dict:
        t = _Documents()
        t.ledger.recent = [{"step": s, "spike": s >= 20 - flags} for s in range(1, 20)]
        rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
        t.first(rec)
        return t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()

    assert proof_with(3)["verdict"] == "bad_data"
    p = proof_with(4)
    assert p["verdict"] == "not_data" and "the run flagged 4 of the 64 steps before this one" in p["why"]


def test_data_in_a_run_the_lr_made_fragile_is_not_convicted_unless_asked():
    """The real set's LR runs: documents convicted at steps where every update moved the
    weights 1.3-10% of their norm (F2), none planted. Where the rows before the step show
    the LR's fingerprint (the update >= 1% of the weights' norm), the verdict is
    ``not_data``, the documents kept as the suspect's and the reading as ``fragile``;
    ``quarantine_fragile`` convicts them anyway; a healthy LR's rows change nothing."""
    def proof_with(relative_update: float, quarantine_fragile: bool = False) -> dict:
        t = _Documents()
        t.config.ledger.conviction.fragile = quarantine_fragile
        t.ledger.recent = [{"step": s, "update_norm": relative_update * 100.0, "param_norm": 100.0}
                           for s in range(1, 20)]
        rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
        t.first(rec)
        return t.prover(rec).prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()

    assert proof_with(0.0003)["verdict"] == "bad_data"  # the same model at LR 3e-3: 0.03%
    p = proof_with(0.05)
    assert p["verdict"] == "not_data" and p["applied"] == "original" and p["documents"], p
    assert "the LR's fingerprint holds (the updates moved the weights 5.0% of their norm a step)" in p["why"]
    assert p["fragile"]["cause"] == "lr" and p["fragile"]["relative_update_pre_median"] == 0.05
    assert proof_with(0.05, quarantine_fragile=True)["verdict"] == "bad_data"


# --------------------------------------------------------------------------- harmful, not new (issue 68)
def _convicting(t=None, **kw):
    """The bad document of ``_Documents`` proven; ``kw`` on the prover (``next_rec``)."""
    t = t or _Documents()
    rec = StepRecord(step=21, start=0.0, batches=t.batches(), tags=t.tags())
    t.first(rec)
    prover = (Prover(t, t.ledger, run_facts(t), proof=t.config.ledger.proof, conviction=t.config.ledger.conviction)
              if kw.pop("in_step", False) else t.prover(rec))
    for k, v in kw.items():
        setattr(prover, k, v)
    return t, prover.prove(rec, acting=True, event={"rules": ["ratio"]}).to_json()


def _next_step(t, bad: bool):
    """The step after the flagged one, fetched (a deferred decision): eight other documents,
    ordinary (``bad`` False) or -- the next step of a distribution shift -- every row as far
    off as the convicted one."""
    from titan_ledger.data.layout import RowTag, Segment

    nxt = _Documents()
    nxt.tokens = t.tokens + 1000  # other documents, other text
    nxt.y = t.y.clone()
    nxt.y[t.BAD] -= 40.0  # the bad document's row, ordinary again...
    if bad:
        nxt.y += 40.0  # ...or every row as far off as it was (the new kind of data)
    tags = [RowTag(100 + r, "c", (Segment(100 + r, 0, t.SEQ),)) for r in range(t.ROWS)]
    return nxt, StepRecord(step=22, start=0.0, batches=nxt.batches(), tags=tags)


@pytest.mark.parametrize("next_bad", [False, True])
def test_the_data_of_the_same_novelty_decides_new_from_harmful(next_bad):
    """The control of the same novelty: the next step's data (fetched before a deferred
    decision), the convicted content masked, on the same weights. Ordinary: the conviction
    stands; as abnormal: the flagged step was new data, not bad data (a distribution shift
    inside a step convicted the first document of the new kind)."""
    t = _Documents()
    nxt_trainer, nxt = _next_step(t, next_bad)
    original_execute = t.execute

    def execute(groups, need_loss=True):  # the next step's batch trains on its own targets
        if groups is not None and groups[0][0][0]["input"] is nxt_trainer.tokens:
            saved = t.y
            t.y = nxt_trainer.y
            try:
                return original_execute(groups, need_loss)
            finally:
                t.y = saved
        return original_execute(groups, need_loss)

    t.execute = execute
    _, proof = _convicting(t, next_rec=nxt)
    novelty = proof["content"]["novelty"]
    assert novelty["available"] and novelty["step"] == 22 and novelty["normal"] is (not next_bad)
    assert [e["variant"] for e in proof["executions"]][-1] == "novelty"
    if next_bad:
        assert proof["verdict"] == "not_data" and "new data, not bad data" in proof["why"]
    else:
        assert proof["verdict"] == "bad_data" and proof["documents"] == [["c", t.BAD]]


def test_without_a_next_step_harder_data_is_not_convicted_and_easier_data_is(monkeypatch):
    """Decided in the step (no next batch fetched), there is no control of the same novelty:
    documents harder than the rest of their step -- a new kind of text is, and so is garbage
    -- are not convicted, saying why; documents easier than the rest (repeated, degenerate:
    no shift makes text easier) are; where neither can be measured the conviction stands
    and ``Recovery`` holds it back (``novelty``)."""
    from titan_ledger.components.response import conviction as prover_module  # where stands_out is read

    _, proof = _convicting(in_step=True)  # the bad document's loss is ~e^3 the rest's
    assert proof["verdict"] == "not_data" and proof["content"]["novelty"]["available"] is False
    assert "documents are harder than the rest" in proof["why"] and proof["content"]["stands_out"]["log_ratio"] > 3
    monkeypatch.setattr(prover_module, "stands_out", lambda first, applied: (1.0, 2.0, math.log(0.5)))
    _, proof = _convicting(in_step=True)
    assert proof["verdict"] == "bad_data" and proof["content"]["novelty"]["available"] is False
    monkeypatch.setattr(prover_module, "stands_out", lambda first, applied: (None, None, None))
    _, proof = _convicting(in_step=True)
    assert proof["verdict"] == "bad_data" and proof["content"]["stands_out"]["log_ratio"] is None


@pytest.mark.parametrize("made,ratio,verdict", [
    (10, 1.05, "not_data"),  # the model spiked on its own at 10; the documents' loss ordinary
    (10, 0.5, "bad_data"),  # ...the documents half the rest's loss (a repeat): they stand out
    (None, 1.05, "bad_data"),  # no step the model made abnormal on its own
    (-990, 1.05, "bad_data"),  # one, beyond the look-back (1,000 steps)
])
def test_a_model_that_spikes_on_its_own_convicts_no_ordinary_data(monkeypatch, made, ratio, verdict):
    """A model a high LR broke (bench/adversarial.py's broken_lr_text): group testing
    convicted ordinary docstrings whose loss was 1.03-1.09x the rest of their step, in runs
    whose proofs had found the model's update abnormal with no data to blame earlier. Where
    such a step lies within the look-back, documents whose loss does not stand out (within
    ``ORDINARY_LOSS``) are ``not_data``, saying why; documents that stand out are convicted."""
    from titan_ledger.components.response import conviction as prover_module  # where stands_out is read

    monkeypatch.setattr(prover_module, "stands_out", lambda first, applied: (ratio, 1.0, math.log(ratio)))
    _, proof = _convicting(model_made=[] if made is None else [made])
    assert proof["verdict"] == verdict, proof["why"]
    assert proof["content"].get("model_made") == (None if made in (None, -990) else {"step": made})
    if verdict == "not_data":
        assert "the model made an abnormal update with no data to blame at step 10" in proof["why"]
        assert "ordinary (1.05x the rest's)" in proof["why"]


def test_a_conviction_records_how_the_convicted_documents_loss_stood_against_the_rest():
    """verdict.stands_out: the convicted documents' own loss against the rest of the step's,
    exactly, from the first execution and the one with them masked (the same forward: every
    other token's loss unchanged); recorded with the proof (not a bar: a cold model gives
    every document one loss, the tour's injected batch of one token included)."""
    from titan_ledger.components.response.verdict import Execution, stands_out

    first = Execution("original", 0.0, 9.0, [[210.0, 0.0, 100], [190.0, 0.0, 100]])
    masked = Execution("masked", 0.0, 0.5, [[189.0, 0.0, 90], [190.0, 0.0, 100]])
    theirs, rest, y = stands_out(first, masked)
    assert theirs == pytest.approx(2.1) and rest == pytest.approx(379 / 190) and abs(y) < 0.7
    assert stands_out(first, first) == (None, None, None)  # nothing masked: no side to compare
    _, proof = _convicting()
    check = proof["content"]["stands_out"]
    assert proof["verdict"] == "bad_data" and check["log_ratio"] > 3.0 and check["loss"] > 20 * check["rest"]


def test_content_like_it_that_trained_before_without_a_flag_clears_it():
    """The look-back by content (the ledger's memory of what trained): the convicted
    document's shingles fetched at an earlier unflagged step -- under another document id --
    clear it; fetched only at a flagged step, they do not."""
    from titan_ledger.data.content import ContentMemory, window_hashes

    for flagged, verdict in (((), "not_data"), ((7,), "bad_data")):
        t = _Documents()
        t.ledger.content = ContentMemory(1 << 12, window=100)
        t.ledger.content.record(7, window_hashes(t.tokens[t.BAD]))  # the same text, at step 7
        t.ledger.flagged = set(flagged)
        _, proof = _convicting(t)
        assert proof["verdict"] == verdict, (flagged, proof["why"])
        assert proof["content"]["seen_before"] == {f"c:{t.BAD}": 1.0 if not flagged else 0.0}


def test_the_next_steps_control_masks_the_convicted_document_and_its_near_copies():
    """components.response.content_checks.masked_next: in the next step's batch the convicted
    document's own rest (by id) and a near-copy of it under another id (by shingles) are
    masked; other text is not."""
    from titan_ledger.components.response import content_checks
    from titan_ledger.data.content import shingles
    from titan_ledger.data.layout import RowTag, Segment

    tokens = torch.tensor([[9] * 16, [9] * 16, list(range(16))])
    tags = [RowTag(0, "c", (Segment(5, 16, 32),)), RowTag(1, "c", (Segment(77, 0, 16),)),
            RowTag(2, "c", (Segment(3, 0, 16),))]
    groups = [[({"input": tokens}, torch.ones(3, 16, dtype=torch.long))]]
    masked, hits = content_checks.masked_next(groups, tags, {("c", 5)}, {("c", 5): shingles([9] * 30)}, -100)
    labels = masked[0][0][1]
    assert hits == 2 and (labels[:2] == -100).all() and (labels[2] == 1).all()
    assert (groups[0][0][1] == 1).all()  # new label tensors: the fetched batch is untouched
