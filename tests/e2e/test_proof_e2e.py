"""Proof at the alarm, end to end (issue 35): six launches of the debug model, DP 2.

Three 12-step runs -- one with two rehearsal faults and ``action = rollback``: a
flipped gradient bit on DP rank 0 at step 6 (``hardware``: the recomputed update is
applied, and the run goes on exactly as the clean run) and a repeated batch on DP rank
1 at step 10 (``bad_data``: nothing rolls back, the step trains on the rest of the
batch and the documents are quarantined); and a clean run with ``[ledger.proof] scope = "all"`` and
every step from 2 on forced through a proof, once deciding in the step
(``--ledger.response.no_defer``) and once deferred (the default: each decision made at
the next step, behind its launched work) -- then the faulty run resumed from its step-8
checkpoint, which must train steps 9-12 exactly as it did (the proof at step 10 again,
its quarantine after it), and the same steps rerun by ``replay rerun`` (a fifth launch);
a sixth has one finite flip that moves the grad norm 2x (``bitflip@2``, issue 52). The faulty run defers too, so its comparisons with the clean
in-step run are deferred-against-in-step, bit for bit. A seventh trains a corpus with one
degenerate document planted across both DP ranks' batches of step 9 (issue 52): neither
rank's mask explains its update, group testing convicts the document.
"""

from __future__ import annotations

import json
import math
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import CONFIGS, cli, data_rows, explain, load_bench, rejected_steps, signals_rows, spike_events, torchrun

from titan_ledger.format.data_reader import DataLedger
from titan_ledger.format.proofs import HARMFUL
from titan_ledger.format.records import read_ledger
from titan_ledger.format.signal_columns import TIMING_KEYS

pytestmark = pytest.mark.slow

BASE = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "12",
        "--training.local_batch_size", "2", "--training.seq_len", "128", "--ledger.spike.window", "8"]
FLIP, REPEAT = 6, 10
FINITE = 10  # a finite flip (bitflip@2) on DP rank 1: the grad norm 2x, the loss unmoved
RUNS = {
    "faults": ["--ledger.rehearsal.inject", f"{FLIP}:0:bitflip,{REPEAT}:1:repeat",
               "--ledger.response.policy", "act", "--ledger.response.action", "rollback", "--checkpoint.enable", "--checkpoint.interval", "4",
               # after the quarantine: steps whose token counts are not a power of two, proven clean
               "--ledger.rehearsal.prove_at", f"{REPEAT + 1}-12"],
    # every note proven, and every step from 2 on forced through a proof: none may leave a trace
    "clean": ["--ledger.proof.scope", "all", "--ledger.rehearsal.prove_at", "2-12", "--ledger.response.no_defer"],
    "clean_deferred": ["--ledger.proof.scope", "all", "--ledger.rehearsal.prove_at", "2-12"],
    # issue 52: silent corruption below the grad-norm rules' bars, seen as a note and proven
    "finite": ["--ledger.proof.scope", "all", "--ledger.rehearsal.inject", f"{FINITE}:1:bitflip@2",
               "--ledger.response.policy", "act"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("proof")
    # a document starting in DP rank 0's batch of step 9 and ending 166 tokens into rank 1's
    split = load_bench("zoo").plant_across(root / "corpus", 9, 2, 2, 128, 166)
    args = {**RUNS, "split": ["--dataloader.source", "indexed", "--dataloader.paths", str(split.prefix),
                              "--dataloader.no_shuffle", "--ledger.response.policy", "act"]}

    def one(name):
        d = root / name
        return name, d, torchrun([*BASE, *args[name], "--job.dump_folder", str(d)])

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(one, args))
    for name, _, p in done:
        assert p.returncode == 0, (name, explain(p))
    return {name: (d, p.stdout + p.stderr) for name, d, p in done} | {"split_doc": split}


def proof_at(dump, step):
    """The last launch's event at ``step`` (event logs keep every launch's)."""
    ev = [e for e in spike_events(dump) if e["step"] == step][-1]
    return ev, ev["proof"]


def test_a_repeated_batch_is_proven_bad_data_and_trained_without_instead_of_rolled_back(runs):
    d, out = runs["faults"]
    ev, proof = proof_at(d, REPEAT)
    assert proof["verdict"] == "bad_data" and proof["suspect"]["dp_rank"] == 1, proof
    assert ev["action"] == "proof: bad_data" and "rolling back" not in out
    assert f"at step {REPEAT}: bad data -- proven in step" in out  # the answer's first line
    assert "done: trained without the convicted data and quarantined it" in out
    nov = proof["content"]["novelty"]  # the next step's data, the repeat masked, on the same weights: normal
    assert nov["available"] and nov["step"] == REPEAT + 1 and nov["normal"] is True, nov
    # the applied update is normal; the first one was not, nor the other rank's mask
    ex = {e["variant"]: e for e in proof["executions"]}
    assert ex["original"]["normal"] is False and ex["same"]["bit_equal"] is True
    assert ex["same"]["grad_norm"] == ex["original"]["grad_norm"] == ev["grad_norm"]  # the event: the flag's
    row = signals_rows(d)[REPEAT]  # the row: what trained (issue 68), the masked execution's numbers
    assert (row["grad_norm"], row["loss"]) == (ev["trained"]["grad_norm"], ev["trained"]["loss"]) != \
        (ev["grad_norm"], ev["loss"]) and row["masked_tokens"] > 0
    applied = [e for e in proof["executions"] if e["variant"] == proof["applied"]][-1]
    assert applied["normal"] is True and applied["grad_norm"] < ev["grad_norm_median"] * 3
    assert applied["per_rank"][1]["tokens"] == 0  # DP rank 1's whole batch masked
    # the documents: DP rank 1's rows at step 10, quarantined from step 11 on
    rows10 = data_rows(d, 1)[REPEAT]
    docs = sorted({(r[1], seg[0]) for r in rows10["rows"] for seg in r[2]})
    assert [tuple(x) for x in proof["documents"]] == docs
    assert rows10["masked"]["proof"] == [[i, j] for i, r in enumerate(rows10["rows"]) for j in range(len(r[2]))]
    proven = [json.loads(x) for x in (d / "ledger" / "proven_documents.jsonl").read_text().splitlines()]
    assert [(p["source"], p["doc"], p["step"]) for p in proven] == [(s, doc, REPEAT) for s, doc in docs]
    later = [(step, row) for r in (0, 1) for step, row in data_rows(d, r).items() if step > REPEAT]
    hit = [(step, row["masked"]["quarantine"]) for step, row in later
           if any((t[1], seg[0]) in docs for t in row["rows"] for seg in t[2])]
    assert hit and all(m for _, m in hit)  # wherever a convicted document came back, it was masked
    assert rejected_steps(d) == []  # resolved: not on the auto-skip list
    assert signals_rows(d)[REPEAT + 1]["grad_norm"] < 3 * ev["grad_norm_median"]
    # the clean steps after it, their tokens masked (the loss sums of the first execution and
    # of its repeats must round alike: they once differed in fp32 and fp64 and read as hardware)
    history = read_ledger(d / "ledger" / "spikes.jsonl").history
    after = {e["step"]: e["proof"] for e in history if "proof" in e and e["step"] > REPEAT}
    assert sorted(after) == [REPEAT + 1, 12] and signals_rows(d)[12]["masked_tokens"] > 0
    assert all(p["verdict"] not in HARMFUL and p["executions"][1]["bit_equal"] for p in after.values()), after
    # deferred: proven at the next step, its update held on the device until then
    assert proof["decided_at"] == REPEAT + 1 and f"decided at step {REPEAT + 1}, the update held until then" in out


def assert_hardware_names_what_its_first_execution_shows(proof) -> list[int]:
    """A bitflip on DP rank 0, proven ``hardware`` (``same`` applied): the DP ranks the proof
    must name, read from its first execution's record (never from its ``why``), and the
    ``why`` that says so. Rank 0 alone where the first execution's clip left it readable:
    its grad norm finite (rank 0's own gradients differ), or, behind a non-finite norm (the
    clip zeroes every finite gradient), rank 0's alone left non-finite. Otherwise (a flip
    that overflows the norm and is zeroed with the rest) every rank, and the why says the
    ranks cannot be told apart. Returns the named ranks."""
    first = proof["executions"][0]
    left = [r for r, x in enumerate(first["per_rank"]) if x["grad_sq"] is None]
    if first["grad_norm"] is not None:
        named, says = [0], None
    elif 0 < len(left) < len(first["per_rank"]):
        assert left == [0], first  # the flipped rank's gradients, not another's
        named, says = [0], "the faulty rank's were left non-finite"
    else:
        assert left or all(x["grad_sq"] == 0.0 for x in first["per_rank"]), first  # the clip zeroed them
        named, says = [0, 1], "the ranks it changed cannot be told apart"
    assert (proof["verdict"], proof["applied"], proof["dp_ranks"]) == ("hardware", "same", named), proof
    if says is None:
        assert "not finite" not in proof["why"], proof["why"]
    else:
        assert "the first execution's grad norm was not finite" in proof["why"] and says in proof["why"], proof["why"]
    return named


def test_a_bitflip_is_proven_hardware_and_the_run_continues_as_without_it(runs):
    d, out = runs["faults"]
    clean, _ = runs["clean"]
    ev, proof = proof_at(d, FLIP)
    ex = proof["executions"]
    named = assert_hardware_names_what_its_first_execution_shows(proof)
    assert [e["variant"] for e in ex] == ["original", "same", "same"]
    assert ex[1]["bit_equal"] is False and ex[1]["grad_norm"] == ex[2]["grad_norm"]
    assert ev["action"] == "proof: hardware" and f"rolling back from step {FLIP}" not in out
    a, b = signals_rows(d), signals_rows(clean)
    # the fault-free run, bit for bit, up to the repeated batch: every step but the
    # faulty execution's own record
    for step in range(1, REPEAT):
        assert a[step]["loss"] == b[step]["loss"], step
        if step != FLIP:
            assert a[step]["grad_norm"] == b[step]["grad_norm"], step
    assert ex[1]["grad_norm"] == b[FLIP]["grad_norm"]  # the recomputed update is the clean one
    assert f"at step {FLIP}: a hardware fault (the step did not reproduce) -- proven in step" in out
    assert "done: applied the recomputed update" in out and proof["dp_ranks"] == named
    assert FLIP not in rejected_steps(d)
    assert proof["decided_at"] == FLIP + 1  # deferred, against the clean run's in-step decisions


def test_a_finite_2x_bitflip_is_noted_proven_hardware_and_the_run_equals_the_fault_free_run(runs):
    """``bitflip@2`` at step 10 (issue 52): too small to act on (a note: its grad norm
    ~2x the recent median, under the acting bars), proven in step with ``[ledger.proof] scope = "all"``;
    the proof says ``hardware`` and applies the recomputed update, the note becomes an
    alarm, and every step equals the fault-free run's bit for bit -- the faulty execution's
    own grad norm excepted."""
    d, out = runs["finite"]
    clean, _ = runs["clean"]
    ev, proof = proof_at(d, FINITE)
    assert (proof["verdict"], proof["applied"], proof["dp_ranks"]) == ("hardware", "same", [1]), proof
    ex = proof["executions"]
    a, b = signals_rows(d), signals_rows(clean)
    assert 1.9 < ex[0]["grad_norm"] / b[FINITE]["grad_norm"] < 2.1  # the flip's size, as the ledger saw it
    assert ex[1]["grad_norm"] == b[FINITE]["grad_norm"] and ex[1]["bit_equal"] is False
    assert ev["rules"] and ev["action"] == "proof: hardware", ev  # promoted: a harmful note acts
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert a[step]["loss"] == b[step]["loss"], step
        if step != FINITE:
            assert a[step]["grad_norm"] == b[step]["grad_norm"], step
    # the detector's decision was a note (below the acting bars); the proof made it an alarm
    assert ev["promoted_by_proof"] is True and set(ev["notes"]) & {"grad_move", "zscore_grad_norm"}, ev
    assert f"a note its proof convicted at step {FINITE}: a hardware fault (the step did not reproduce) -- proven " \
           f"in step" in out


def test_a_document_split_across_dp_ranks_is_convicted_by_group_testing_not_a_rank(runs):
    """The planted document holds 90 of DP rank 0's 256 tokens at step 9 and 166 of rank
    1's. A rank's mask leaves the other rank's part of it, so neither mask brings the
    update back; group testing over the step's documents (on by default) convicts that one
    document on both ranks, trains the step without it and quarantines it -- every other
    document of both batches trains."""
    d, out = runs["split"]
    split = runs["split_doc"]
    assert (split.step, split.dp_ranks, split.tokens) == (9, (0, 1), (90, 166))
    ev, proof = proof_at(d, split.step)
    assert ev["action"] == "proof: bad_data", ev
    assert (proof["verdict"], proof["applied"]) == ("bad_data", "masked"), proof
    assert proof["documents"] == [["split", split.doc]] and proof["suspect"]["dp_ranks"] == [0, 1], proof
    ex = proof["executions"]
    # the rank masks (suspect, control) each left the update abnormal: a rank-level proof
    # could not convict (it would be not_data and take the action)
    ranks = [e for e in ex if e["variant"] in ("masked", "control")][:2]
    assert [e["normal"] for e in ranks] == [False, False] and \
        sorted(r for e in ranks for r, x in enumerate(e["per_rank"]) if x["tokens"] == 0) == [0, 1], ranks
    # the bisection: one round per halving, at most ceil(log2 k) for k documents, each round's
    # halves told apart; two executions a round
    rounds = proof["bisection"]
    searched = {tuple(x) for x in rounds[0]["masked"] + rounds[0]["control"]}
    assert 1 <= len(rounds) <= math.ceil(math.log2(len(searched))), rounds
    assert all(r["masked_normal"] != r["control_normal"] for r in rounds), rounds
    assert sum(e["variant"] == "bisect" for e in ex) == 2 * len(rounds)
    applied = [e for e in ex if e["variant"] == "masked"][-1]  # the convicted set's update, in place
    assert ex[-1]["variant"] == "novelty" and proof["content"]["novelty"]["normal"] is True  # then the next step's
    assert applied["normal"] is True
    assert [x["tokens"] for x in applied["per_rank"]] == [256 - 90, 256 - 166]
    # the data rows: exactly the planted document's segments masked, on each rank
    led = DataLedger(d / "ledger")
    for r in (0, 1):
        tags = led.at(split.step, r).tags
        planted = [[i, j] for i, t in enumerate(tags) for j, seg in enumerate(t.segments) if seg.doc == split.doc]
        assert sum(tags[i].segments[j].end - tags[i].segments[j].start for i, j in planted) == split.tokens[r]
        assert data_rows(d, r)[split.step]["masked"]["proof"] == planted, r
    proven = [json.loads(x) for x in (d / "ledger" / "proven_documents.jsonl").read_text().splitlines()]
    assert [(p["source"], p["doc"], p["step"]) for p in proven] == [("split", split.doc, split.step)]
    assert rejected_steps(d) == [] and "rolling back" not in out
    assert f"at step {split.step}: bad data -- proven in step" in out  # the answer: quarantined by the trainer
    assert "fix: the convicted data was quarantined by the trainer" in out


def test_deferred_decisions_train_exactly_the_run_in_step_decisions_train(runs):
    """Every step from 2 to 11 proven a step late (its update held on the device, applied
    at its own LR after the proof, the next step executed again): every row, data row and
    verdict equals the in-step run's, bit for bit."""
    d, _ = runs["clean_deferred"]
    ref, _ = runs["clean"]
    a, b = signals_rows(d), signals_rows(ref)
    timing = TIMING_KEYS  # (the table's wall-clock columns)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert {k: v for k, v in a[step].items() if k not in timing} == \
            {k: v for k, v in b[step].items() if k not in timing}, step
    for r in (0, 1):
        assert data_rows(d, r) == data_rows(ref, r)
    pa, pb = ({e["step"]: e["proof"] for e in read_ledger(x / "ledger" / "spikes.jsonl").history if "proof" in e}
              for x in (d, ref))
    assert {s: (p["verdict"], p["applied"]) for s, p in pa.items()} == \
        {s: (p["verdict"], p["applied"]) for s, p in pb.items()}
    assert {s: p.get("decided_at") for s, p in pa.items()} == {s: s + 1 for s in range(2, 12)} | {12: None}
    assert all("decided_at" not in p for p in pb.values())
    assert all(p["executions"][1]["bit_equal"] for p in pa.values())  # judged by the kept checksum


def test_clean_training_proven_at_every_step_acts_on_nothing_and_leaves_no_trace(runs):
    d, _ = runs["clean"]
    faults, _ = runs["faults"]
    events = [json.loads(x) for x in (d / "ledger" / "spikes.jsonl").read_text().splitlines()[1:]]
    assert not [e for e in events if e.get("rules")]  # no acting flag
    proofs = {e["step"]: e["proof"] for e in events if "proof" in e}
    assert sorted(proofs) == list(range(2, 13))  # forced or noted: every step from 2 on
    assert all(p["verdict"] not in HARMFUL and p["applied"] == "original" for p in proofs.values()), proofs
    assert all(p["executions"][1]["bit_equal"] for p in proofs.values())  # re-execution is exact
    assert not (d / "ledger" / "proven_documents.jsonl").exists()
    # the faulty run proved nothing before its bitflip: the proofs changed nothing
    a, b = signals_rows(d), signals_rows(faults)
    assert [(a[s]["loss"], a[s]["grad_norm"]) for s in range(1, FLIP)] == \
        [(b[s]["loss"], b[s]["grad_norm"]) for s in range(1, FLIP)]


def test_a_resume_before_the_proof_trains_the_same_steps_bit_for_bit(runs, tmp_path):
    d, _ = runs["faults"]
    dump = tmp_path / "resumed"
    shutil.copytree(d / "checkpoint" / "step-8", dump / "checkpoint" / "step-8")
    shutil.copytree(d / "ledger", dump / "ledger")
    p = torchrun([*BASE, *RUNS["faults"], "--job.dump_folder", str(dump)])
    assert p.returncode == 0, explain(p)
    a, b = signals_rows(d), signals_rows(dump)
    for step in range(9, 13):  # the proof at the repeated batch included
        assert (a[step]["loss"], a[step]["grad_norm"]) == (b[step]["loss"], b[step]["grad_norm"]), step
    assert data_rows(dump, 1)[11] == data_rows(d, 1)[11]  # the quarantine after the proof, again
    _, proof = proof_at(dump, REPEAT)
    assert proof["verdict"] == "bad_data"


def test_replay_rerun_reproduces_the_proof_and_its_quarantine_bit_for_bit(runs):
    """``replay rerun`` from the step-8 checkpoint (the run's own launch, its own folder):
    step 10 is proven bad data again, trained without the documents, and steps 11-12 train
    with them quarantined -- every step bit-equal to the run, the data equal."""
    from titan_ledger import replay

    d, _ = runs["faults"]
    rc, out, err = cli(replay.main, ["rerun", "--dump-folder", str(d), "--step", str(REPEAT), "--after", "2",
                                     "--variant", "same", "--json"])
    assert rc == 0, err
    rep = json.loads(out)
    (same,) = rep["variants"]
    assert rep["load_step"] == 8 and same["bit_equal_steps"] == [9, 10, 11, 12] and same["data_equal"], same
    log = (d / "rerun" / "same" / "rerun.log").read_text()
    assert "at step 10: bad data -- proven in step" in log


def test_on_a_machine_that_is_not_bit_reproducible_the_proof_measures_the_noise(tmp_path):
    """``--ledger.rehearsal.nondeterminism 1e-6`` (a GPU without --debug.deterministic,
    rehearsed): no re-execution is bit-equal, so every forced proof of a clean step runs a
    third execution, measures the noise floor and finds nothing (no hardware verdict, the
    first update applied); the flipped bit at step 5 stands out of that noise by orders of
    magnitude and is still proven ``hardware``, on its rank (observed: under the default
    policy what it would apply is recorded, nothing applied). tiny_cpu, DP 2."""
    d = tmp_path / "noisy"
    p = torchrun(["--job.config_file", str(CONFIGS / "tiny_cpu.toml"), "--training.steps", "8",
                  "--ledger.rehearsal.nondeterminism", "1e-6", "--ledger.rehearsal.prove_at", "2-8",
                  "--ledger.rehearsal.inject", "5:1:bitflip", "--job.dump_folder", str(d)])
    assert p.returncode == 0, explain(p)
    history = read_ledger(d / "ledger" / "spikes.jsonl").history  # forced proofs: events of their own
    proofs = {e["step"]: e["proof"] for e in history if "proof" in e}
    assert sorted(proofs) == list(range(2, 9))
    for step, proof in proofs.items():
        ex = proof["executions"]
        assert [e["variant"] for e in ex[:3]] == ["original", "same", "same"], (step, proof)
        assert ex[1]["bit_equal"] is False  # the rehearsed machine is not bit-reproducible
        floor = proof["noise"]["floor"]
        assert 0 < floor < 1e-4, (step, proof["noise"])  # the jitter's size, measured
        assert len(proof["noise"]["distances"]) == 2  # one row per rank
        if step == 5:
            # the faulty rank, or both where the flip overflowed the norm and the clip zeroed
            # every rank's gradients (as in the bitflip test above)
            named = [1] if ex[0]["grad_norm"] is not None else [0, 1]
            # the default policy observes: what the verdict would apply is recorded, the first update applied
            assert (proof["verdict"], proof["would_apply"], proof["dp_ranks"]) == ("hardware", "same", named), proof
            assert (proof["applied"], proof["held_back"]) == ("original", "observe"), proof
            gap = min(proof["noise"]["distances"][1][:2])
            assert gap > 1e4 * floor, proof["noise"]
        else:
            assert proof["verdict"] not in HARMFUL and proof["applied"] == "original", (step, proof)
