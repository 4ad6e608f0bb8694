"""bench/adversarial.py's pure parts, without training or ``prepare``.

Each corpus builder's property, measured with the bundled tokenizer (short documents
<= 16 tokens, one long document > 20 steps' tokens placed at about step 100, a ~10x
shift of the mean document length half-way, the plateau's identical documents, the
duplicated licence), the training flags of each run, and the counting of what the
response did over a hand-written ledger folder (flags, notes, proofs by verdict,
actions, would-act, quarantine, masked tokens).
"""

import json

import pytest
from helpers import load_bench

from titan_ledger.format import records


@pytest.fixture(scope="module")
def adv():
    return load_bench("adversarial")


@pytest.fixture(scope="module")
def tok(adv):
    return adv.tokenizer()


def encode(tok, text: str) -> int:
    return len(tok.encode(text, add_bos=True, add_eos=True))


def test_short_docs_fit_16_tokens(adv, tok):
    docs, params = adv.short_docs(tok, n=3000)
    assert len(docs) == 3000 and params["max_tokens"] == 16
    lengths = [encode(tok, d["text"]) for d in docs]
    assert max(lengths) <= 16 and min(lengths) >= 3  # at least one word
    assert sum(lengths) / len(lengths) > 8  # the targets, not single words
    assert len({d["text"] for d in docs}) > 2000  # the docstrings' words in order, not one phrase
    assert adv.short_docs(tok, n=50)[0] == docs[:50]  # deterministic
    p = adv.measure("short_docs", docs, tok)
    assert p["max_doc_tokens"] <= 16 and p["docs"] == 3000
    assert adv.SHORT_DOCS >= 3000


def test_long_doc_is_one_and_placed_at_step_100(adv, tok):
    docs, params = adv.long_doc_docs(tok, steps=60)
    long = [i for i, d in enumerate(docs) if d["kind"] == "long"]
    assert len(long) == 1
    lengths = [encode(tok, d["text"]) for d in docs]
    assert lengths[long[0]] > 20 * 8 * 128
    assert sorted(lengths)[-2] <= adv.BACKGROUND_MAX  # nothing else is long
    start = sum(n - 1 for n in lengths[:long[0]])  # its first trained token in the ordered stream
    assert abs(start - (adv.LONG_STEP - 1) * adv.TOKENS_PER_STEP) <= adv.BACKGROUND_MAX // 2
    p = adv.measure("long_doc", docs, tok)
    first, last = p["long_doc_steps"]
    assert abs(first - adv.LONG_STEP) <= 2 and last - first + 1 >= 21
    assert p["long_doc_tokens"] == lengths[long[0]] and p["others_max_tokens"] == sorted(lengths)[-2]
    assert p["steps_per_epoch"] > last  # the run reaches past it without wrapping
    assert "--dataloader.no_shuffle" in adv.FLAGS["long_doc"]


def test_split_text_keeps_the_text(adv, tok):
    text = "\n".join(f"line {i} " + "word " * (i % 7) for i in range(400))
    pieces = adv.split_text(tok, text, 200)
    assert len(pieces) > 1 and all(encode(tok, p) <= 200 for p in pieces)
    assert "".join(pieces) == text


def test_length_shift_is_10x_half_way(adv, tok):
    steps = 60
    docs, _ = adv.length_shift_docs(tok, steps)
    kinds = [d["kind"] for d in docs]
    first_long = kinds.index("long")
    assert set(kinds[:first_long]) == {"short"} and set(kinds[first_long:]) == {"long"}  # one shift
    lengths = [encode(tok, d["text"]) for d in docs]
    short, long = lengths[:first_long], lengths[first_long:]
    assert max(short) <= adv.SHIFT_MAX and max(long) <= adv.SHIFT_FACTOR * adv.SHIFT_MAX
    ratio = (sum(long) / len(long)) / (sum(short) / len(short))
    assert 8.5 < ratio < 11.5
    p = adv.measure("length_shift", docs, tok)
    assert p["shift_step"] == steps // 2 + 1 and p["mean_ratio"] == round(ratio, 2)
    assert sum(n - 1 for n in lengths) >= (steps + 1) * adv.TOKENS_PER_STEP  # one epoch covers the run
    assert "--dataloader.no_shuffle" in adv.FLAGS["length_shift"]


def test_plateau_is_1500_identical_docs(adv, tok):
    docs, _ = adv.plateau_docs()
    assert len(docs) == 1500 and {d["text"] for d in docs} == {" the end." * 400}
    p = adv.measure("plateau", docs, tok)
    assert p["distinct_docs"] == 1 and p["max_doc_tokens"] == encode(tok, " the end." * 400)
    flags = " ".join(adv.FLAGS["plateau"])
    for f in ("--dataloader.no_shuffle", "--optimizer.lr 1e-2", "--lr_scheduler.warmup_steps 20",
              "--lr_scheduler.min_lr_factor 1.0", "--optimizer.weight_decay 0", "--model.qk_norm"):
        assert f in flags


def test_duplication_is_half_one_licence(adv, tok):
    docs, params = adv.duplication_docs()
    lic = [d for d in docs[1::2]]
    assert len(docs) % 2 == 0 and all(d["kind"] == "licence" for d in lic)
    assert len({d["text"] for d in lic}) == 1 and len(lic[0]["text"]) > 1000
    bundled = [d["text"] for d in adv.corpora.bundled_documents()]
    assert [d["text"] for d in docs[0::2]] == bundled  # the other half: the docstrings, in order
    p = adv.measure("duplication", docs, tok)
    assert p["licence_doc_share"] == 0.5 and p["licence_tokens"] == encode(tok, lic[0]["text"])


def test_code_tables_are_source_and_tables(adv):
    docs, params = adv.code_tables_docs()
    kinds = {d["kind"] for d in docs}
    assert kinds == {"source", "table"}
    assert sum(d["kind"] == "table" for d in docs) == adv.corpora.N_TABLES
    assert all(d["source"].startswith("stdlib:") and d["source"].endswith(".py") for d in docs
               if d["kind"] == "source")
    assert params["table_seed"] == adv.corpora.TABLE_SEED


def test_train_args(adv, tmp_path):
    run = adv.Run("plateau", 1, "act", 800)
    args = " ".join(adv.train_args(run, tmp_path / "c"))
    assert "--training.steps 800" in args and "--debug.seed 1" in args and "--dataloader.seed 1" in args
    assert "--metrics.log_freq 100" in args and "--ledger.response.policy act" in args
    assert "--model.qk_norm" in args and f"--dataloader.paths {tmp_path / 'c'}" in args
    args = adv.train_args(adv.Run("short_docs", 0, "observe", 60), tmp_path / "c")
    assert "--ledger.response.policy" not in args and "--dataloader.no_shuffle" not in args
    assert [r.name for r in adv.grid(["short_docs"], [0, 1], ["observe", "act"], 60)] == [
        "short_docs_s0_observe_60st", "short_docs_s0_act_60st", "short_docs_s1_observe_60st",
        "short_docs_s1_act_60st"]


EVENTS = [
    # an acting flag whose proof observe held back (bad_data: would have masked)
    {"step": 10, "rules": ["zscore_loss"], "notes": [], "action": "proof: bad_data",
     "proof": {"verdict": "bad_data", "applied": "original", "would_apply": "masked", "held_back": "observe"}},
    # a note proven an outlier
    {"step": 11, "notes": ["doc_high"], "proof": {"verdict": "outlier", "applied": "original"}},
    # a note past the budget, unproven
    {"step": 12, "notes": ["doc_low"], "unproven": "budget"},
    # an acted conviction (act): masked update
    {"step": 20, "rules": ["ratio"], "notes": [], "proof": {"verdict": "bad_data", "applied": "masked"}},
    # a forced proof: hardware, the recomputed update applied
    {"step": 21, "proof": {"verdict": "hardware", "applied": "same"}, "forced": True},
    # not_data, then the ladder: none (no action), skip_update (an action), one the breaker held back
    {"step": 30, "rules": ["grad_jump"], "notes": [], "proof": {"verdict": "not_data", "applied": "original"},
     "proof_failed": {"where": "window", "error": "x"}},
    {"step": 30, "rung": 0, "action": "none", "attempt": 1, "repeat_within_horizon": False, "ladder": True},
    {"step": 31, "rung": 0, "action": "skip_update", "attempt": 1, "repeat_within_horizon": False, "ladder": True},
    {"step": 32, "rung": 0, "action": "skip_update", "attempt": 2, "repeat_within_horizon": True, "ladder": True,
     "held_back": "breaker"},
    {"step": 33, "rung": 1, "action": "exhausted", "repeat_within_horizon": True, "ladder": True},
    {"step": 34, "rewind_to": 20, "skip_window": [34, 40], "action": "rollback"},
    {"step": 35, "breaker": "paused", "actions": [20, 21, 31], "window": 100, "limit": 3},
    {"step": 36, "no_tokens": True},
    {"step": 37, "response_failure": {"where": "snapshot", "error": "y"}},
    # a bound held a conviction back
    {"step": 40, "rules": ["doc_high"], "notes": [], "proof": {"verdict": "bad_data", "applied": "original",
                                                               "would_apply": "control",
                                                               "held_back": "quarantine_bound"}},
]


def test_count_events(adv):
    c = adv.count_events(EVENTS)
    assert c["flags"] == 4 and c["notes"] == 2
    assert c["proofs"] == 6
    assert c["proofs_by_verdict"] == {"bad_data": 3, "hardware": 1, "not_data": 1, "outlier": 1}
    # masked (20), same (21), the ladder's skip_update (31), the rewind (34)
    assert c["actions"] == 4 and c["masked_updates"] == 1
    assert [s[0] for s in c["action_steps"]] == [20, 21, 31, 34]
    assert c["would_act"] == 2 and c["would_act_by"] == {"observe": 1, "quarantine_bound": 1}
    assert c["no_token_steps"] == 1 and c["breaker"] == 1 and c["response_failures"] == 2
    assert c["flag_steps"] == [10, 20, 30, 40]
    empty = adv.count_events([])
    assert empty["flags"] == empty["actions"] == empty["would_act"] == 0 and empty["proofs_by_verdict"] == {}


def _ledger(dump, steps=12, events=EVENTS, proven=2):
    led = dump / "ledger"
    w = records.RecordWriter(led / records.SIGNALS_FILE,
                             {"schema": records.SIGNALS.id, "run_id": "a", "resumed_from": 0, "seq": 1})
    for s in range(1, steps + 1):
        row = {k: None for k in records.SIGNAL_KEYS}
        row.update(step=s, loss=8.0 - s / 10, grad_norm=1.0, lr=1e-3, skipped=False,
                   masked_tokens=100 if s in (5, 6) else 0)
        w.write(row)
    w.close()
    w = records.RecordWriter(led / records.SPIKES_FILE, {"schema": records.SPIKES.id, "run_id": "a", "seq": 1})
    for e in events:
        w.write(e)
    w.close()
    if proven:
        (led / records.PROVEN_FILE).write_text("".join(
            json.dumps({"source": "corpus", "doc": d, "step": 20}) + "\n" for d in range(proven)))
    return dump


def test_read_run_on_a_written_ledger(adv, tmp_path):
    r = adv.read_run(_ledger(tmp_path / "run"))
    assert r["steps_done"] == 12 and r["quarantined"] == 2 and r["tokens_masked"] == 200
    assert r["flags"] == 4 and r["actions"] == 4 and r["masked_updates"] == 1
    assert r["loss_first"] == 7.9 and "read_error" not in r
    clean = adv.read_run(_ledger(tmp_path / "clean", steps=5, events=[], proven=0))
    assert clean["steps_done"] == 5 and clean["quarantined"] == 0 and clean["flags"] == 0
    gone = adv.read_run(tmp_path / "never_trained")  # a run that died before its ledger
    assert gone["steps_done"] == 0 and "read_error" in gone


def _result(adv, policy, completed=True, **over):
    r = {"corpus": "short_docs", "seed": 0, "policy": policy, "steps": 60, "steps_target": 60,
         "steps_done": 60 if completed else 30, "rc": 0 if completed else 1, "completed": completed,
         "seconds": 12.3, "quarantined": 0, "tokens_masked": 0, **adv.count_events([])}
    r.update(over)
    return r


def test_summary_goal_and_table(adv):
    ok = [_result(adv, "observe", would_act=1, would_act_by={"observe": 1}), _result(adv, "act")]
    s = adv.summarize(ok)
    assert s["goal"]["met"] and s["by_policy"]["observe"]["would_act"] == 1
    assert s["by_policy"]["act"]["runs"] == 1 and s["by_policy"]["act"]["completed"] == 1
    assert adv.goal_line(s).startswith("goal MET: 2/2 runs complete, 0 documents quarantined, 0 masked updates")
    bad = ok + [_result(adv, "act", quarantined=3, masked_updates=1, actions=1)]
    assert not adv.summarize(bad)["goal"]["met"]
    assert not adv.summarize([_result(adv, "act", completed=False)])["goal"]["met"]
    assert not adv.summarize([])["goal"]["met"]
    rows = adv.table(bad)
    assert rows[0].startswith("| corpus | seed | policy |") and len(rows) == 2 + len(bad)
    assert all(r.count("|") == rows[0].count("|") for r in rows)
    assert "1 (observe 1)" in rows[2]
