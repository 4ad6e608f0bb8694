"""bench/false_alarms.py, bench/corpora.py and bench/warm_base.py: the pure parts, without training.

Counting (every rule separately, flags per 10^4 clean steps), the offline replay's
input (the detector's ``doc`` matrix rebuilt from data-ledger rows) and the replay
over a hand-written ledger, the corpus manifest hash (deterministic, sensitive to
every document and parameter), the numeric tables, the unigram entropy.
"""

import json
import math
import random

import pytest
from helpers import load_bench


@pytest.fixture(scope="module")
def fa():
    return load_bench("false_alarms")


@pytest.fixture(scope="module")
def corpora():
    return load_bench("corpora")


def test_rules_match_the_detector(fa):
    from titan_ledger.components.detection.spike_rules import RULES

    assert fa.RULES == RULES


def test_per_1e4(fa):
    assert fa.per_1e4(3, 20_000) == 1.5
    assert fa.per_1e4(0, 1234) == 0.0
    assert fa.per_1e4(1, 3) == 3333.33
    assert math.isnan(fa.per_1e4(1, 0))


def test_count_every_rule_separately_and_each_tier(fa):
    runs = [{"name": "a", "clean_steps": 6000, "events": [{"step": 12, "rules": ["doc_high"], "notes": []},
                                                          {"step": 40, "rules": ["zscore_loss", "ratio"],
                                                           "notes": ["doc_low"]},
                                                          {"step": 41, "rules": [], "notes": ["doc_low"]}]},
            {"name": "b", "clean_steps": 4000, "events": [{"step": 7, "rules": ["doc_high"], "notes": []}]},
            {"name": "c", "clean_steps": 0, "events": []}]
    res = fa.count(runs)
    assert res["clean_steps"] == 10_000
    assert res["acting_flags"] == 3  # steps with an acting rule, not rule firings; not the note-only step
    assert res["per_1e4"] == 3.0
    assert res["note_steps"] == 1 and res["notes_per_1e4"] == 1.0
    assert res["flags_by_rule"] == {"zscore_loss": 1, "zscore_grad_norm": 0, "ratio": 1, "non_finite": 0,
                                    "rank_separation": 0, "doc_high": 2, "doc_low": 0, "grad_jump": 0,
                                    "grad_move": 0, "rank_loss": 0}
    assert res["notes_by_rule"]["doc_low"] == 2 and res["noted_by_rule"] == {"doc_low": ["a@40", "a@41"]}
    assert res["per_1e4_by_rule"]["doc_high"] == 2.0
    assert res["flagged_by_rule"] == {"zscore_loss": ["a@40"], "ratio": ["a@40"], "doc_high": ["a@12", "b@7"]}
    assert res["steps"][1] == {"run": "a", "step": 40, "rules": ["zscore_loss", "ratio"], "notes": ["doc_low"]}
    assert fa.count([])["acting_flags"] == 0
    assert any("doc_high" in line and "a@12, b@7" in line for line in fa.table(res))
    assert any(line.split()[0] == "doc_low" and line.split()[3] == "2" for line in fa.table(res)[2:])


def test_recorded_runs_are_found_by_name(fa, tmp_path):
    for name in ("text_dp2_cold_s0_300st_4x256", "hetero_dp4_warm_s1_500st_2x128", "notarun", "x.log"):
        (tmp_path / name).mkdir()
    runs = fa.recorded_runs(tmp_path)
    assert [r.name for r in runs] == ["hetero_dp4_warm_s1_500st_2x128", "text_dp2_cold_s0_300st_4x256"]
    assert runs[0] == fa.Run("hetero", 4, "warm", 1, 500, 2, 128)


def test_grid_and_quick_plan(fa):
    g = fa.grid(["text", "hetero", "copy"], [2, 4], ["cold", "warm"], [0, 1], 850)
    assert len(g) == 24 and sum(r.steps for r in g) >= 20_000
    assert len({r.name for r in g}) == 24
    for warm in (True, False):
        plan = fa.quick_plan(warm)
        assert sum(r.steps for r in plan) >= 1000
        assert {r.corpus for r in plan} == {"text", "hetero", "copy"} and {r.dp for r in plan} == {2, 4}
        assert ("warm" in {r.start for r in plan}) == warm


def test_doc_matrix_from_data_rows(fa):
    rows = [{"step": 3, "doc_loss": {"n": 5, "n_valid": 4, "median": 2.5, "top": [[0, 0, 40.0, 10], [1, 0, 30.0, 10]],
                                     "bottom": [[2, 1, 10.0, 20]]}},
            {"step": 3},  # no tracked loss
            {"step": 3, "doc_loss": {"n": 1, "n_valid": 0, "median": None, "top": [], "bottom": []}}]
    m = fa.doc_matrix(rows + [None]).tolist()
    assert m[0][:4] == [2.5, 4.0, 0.5, 4.0] and math.isnan(m[0][4])  # no document count recorded
    assert all(math.isnan(x) for x in m[1] + m[3])
    assert all(math.isnan(x) for x in m[2][:3]) and m[2][3] == 0.0
    # the trainer's count (``doc_loss.docs``); or, for a ledger from before it, counted from
    # the rows' sample ids on request (segments of 16+ tokens, as the tracker ranks them)
    counted = {**rows[0], "doc_loss": {**rows[0]["doc_loss"], "docs": 2}}
    assert fa.doc_matrix([counted])[0, 4] == 2.0
    sliced = {**rows[0], "rows": [[0, "c4", [[7, 0, 256]]], [1, "c4", [[7, 256, 512]]], [2, "c4", [[8, 0, 9]]]]}
    assert math.isnan(fa.doc_matrix([sliced])[0, 4]) and fa.doc_matrix([sliced], infer_docs=True)[0, 4] == 1.0


def _ledger(tmp_path, rows, data, rules, events=()):
    led = tmp_path / "ledger"
    led.mkdir(parents=True)
    (led / "signals.jsonl").write_text("\n".join(json.dumps(x) for x in [{"schema": "signals"}, *rows]) + "\n")
    for k, d in enumerate(data):
        (led / f"data_dp{k}.jsonl").write_text("\n".join(json.dumps(x) for x in [{"schema": "data"}, *d]) + "\n")
    (led / "spikes.jsonl").write_text("\n".join(json.dumps(x) for x in [{"schema": "spikes", "rules": rules},
                                                                       *events]) + "\n")
    return tmp_path


def test_replay_over_a_written_ledger_matches_the_detector(fa, tmp_path):
    """The replay feeds the detector exactly what the rows hold: a grad-norm jump at
    step 30 and a document far above its batch at step 25 flag those steps, and a
    ledger whose online record agrees passes the step-by-step check."""
    import dataclasses

    from titan_ledger.components.detection.spikes import SpikeDetector

    rules = {f.name: getattr(SpikeDetector.Config(), f.name) for f in dataclasses.fields(SpikeDetector.Config)}
    rnd = random.Random(0)
    rows, data = [], [[], []]
    for s in range(1, 41):
        gn = 10.0 if s == 30 else 1.0 + 0.05 * rnd.random()
        rows.append({"step": s, "loss": 5.0 - 0.01 * s + 0.01 * rnd.random(), "grad_norm": gn, "skipped": False})
        for k in range(2):
            hi = 5.0 * (3.0 if (s == 25 and k == 1) else 1.1 + 0.05 * rnd.random())
            data[k].append({"step": s, "doc_loss": {"n": 6, "n_valid": 6, "median": 5.0,
                                                    "top": [[0, 0, hi * 100, 100]],
                                                    "bottom": [[1, 0, 4.5 * 100, 100]]}})
    dump = _ledger(tmp_path, rows, data, rules)
    ev = fa.replay(dump)
    # the document is a note (the default tiers), the grad jump acts
    assert [(e["step"], e["rules"], e["notes"]) for e in ev] == [(25, [], ["doc_high"]), (30, ["grad_jump"], [])]
    assert ev[0]["doc_high_rank"] == 1
    before = fa.replay(dump, {**rules, **fa.BEFORE_TIERS})
    assert [(e["step"], e["rules"]) for e in before] == [(25, ["doc_high"]), (30, ["grad_jump"])]
    # an online record that says the same passes; one that does not, fails
    for r in rows:
        r["spike"] = r["step"] == 30
    online = [{"step": e["step"], "loss": 1.0, **{k: v for k, v in e.items() if k != "rules" or v}} for e in ev]
    assert "rules" not in online[0]  # a note-only event as the guard writes it
    good = _ledger(tmp_path / "good", rows, data, rules, online)
    chk = fa.check_replay(good)
    assert chk["identical"] and chk["steps"] == 40 and chk["mismatches"] == [], chk
    bad = _ledger(tmp_path / "bad", rows, data, rules, [online[0]])
    chk = fa.check_replay(bad)
    assert not chk["identical"] and {m["step"] for m in chk["mismatches"]} == {30}
    # a ledger from before the tiers (no notes, no separation_gate in its header) replays
    # with the detector it ran: both steps act
    old = {k: v for k, v in rules.items() if k not in fa.BEFORE_TIERS}
    for r in rows:
        r["spike"] = r["step"] in (25, 30)
    legacy = _ledger(tmp_path / "legacy", rows, data, old,
                     [{"step": e["step"], "loss": 1.0, **{k: v for k, v in e.items() if k != "notes"}}
                      for e in before])
    assert fa.check_replay(legacy)["identical"]


def test_manifest_hash_is_deterministic_and_sensitive(corpora):
    docs = [{"text": "a" * 300, "kind": "source", "source": "stdlib:x.py"},
            {"text": "1,2\n", "kind": "table", "source": "table:24:0"}]
    m = corpora.manifest("hetero", docs)
    h = corpora.manifest_hash(m)
    assert len(h) == 12 and h == corpora.manifest_hash(corpora.manifest("hetero", [dict(d) for d in docs]))
    assert h == corpora.manifest_hash(json.loads(json.dumps(m)))  # survives a round trip through manifest.json
    changed = [dict(docs[0], text="a" * 299 + "b"), docs[1]]
    assert corpora.manifest_hash(corpora.manifest("hetero", changed)) != h
    assert corpora.manifest_hash(corpora.manifest("hetero", docs[::-1])) != h  # order is an input
    assert corpora.manifest_hash(corpora.manifest("text", docs)) != h
    assert corpora.summary(m) == {"source": {"documents": 1, "chars": 300}, "table": {"documents": 1, "chars": 4}}


def test_tables_and_cut(corpora):
    a, b = corpora.table_documents(8, seed=24), corpora.table_documents(8, seed=24)
    assert a == b and corpora.table_documents(8, seed=25) != a
    for d in a:
        lines = d["text"].splitlines()
        width = len(lines[0].split(","))
        assert 20 < len(lines) <= 61 and all(len(x.split(",")) == width for x in lines)
    assert corpora.cut("ab\ncd\nef", 7) == "ab\ncd\n"
    assert corpora.cut("short", 100) == "short"


def test_source_and_licence_selection_is_sorted_and_deduplicated(corpora, tmp_path):
    lib = tmp_path / "lib"
    for rel in ("a.py", "pkg/b.py", "test/t.py", "pkg/tests/u.py", "c.py"):
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(f"# {rel}\n" + "x = 1\n" * 60)
    docs = corpora.source_documents(budget=10**6, root=lib)
    got = [d["source"] for d in docs]
    assert sorted(got) == ["stdlib:a.py", "stdlib:c.py", "stdlib:pkg/b.py"]  # no test packages
    assert got == [d["source"] for d in corpora.source_documents(budget=10**6, root=lib)]
    assert len(corpora.source_documents(budget=1, root=lib)) == 1
    site = tmp_path / "site"
    text = "Permission is hereby granted, free of charge. " * 10
    for rel, t in (("x-1.0.dist-info/LICENSE", text), ("y-2.0.dist-info/LICENSE.txt", text + "\n"),
                   ("z/COPYING", "GPL " * 100), ("z/licensing.py", "not a licence " * 50),
                   ("pytest_xdist-3.8.0.dist-info/licenses/LICENSE", "MIT " * 100),  # the dev extra's runner:
                   ("execnet-2.1.2.dist-info/licenses/LICENSE", "MIT, too " * 100)):  # left out
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(t)
    (lib / "LICENSE.txt").write_text("PSF " * 100)
    lic = corpora.licence_documents(stdlib=lib, site=site)
    assert [d["source"] for d in lic] == ["stdlib:LICENSE.txt", "site:x-1.0.dist-info/LICENSE", "site:z/COPYING"]


def test_entropy(corpora):
    assert corpora.entropy([5, 5]) == pytest.approx(math.log(2))
    assert corpora.entropy([7, 0, 0]) == 0.0
    assert corpora.entropy([1] * 2048) == pytest.approx(math.log(2048))


def test_warm_base_start_flags_and_hash(tmp_path):
    wb = load_bench("warm_base")
    flags = wb.start_flags({"checkpoint": "/x/run/checkpoint/step-1500"})
    assert flags == ["--checkpoint.enable", "--checkpoint.initial_load_path", "/x/run/checkpoint/step-1500",
                     "--checkpoint.initial_load_model_only", "--checkpoint.load_only"]
    inp = {"corpus": "abc", "steps": 10, "flags": ["--a"], "code": {"torch": "2"}}
    assert wb.inputs_hash(inp) == wb.inputs_hash(json.loads(json.dumps(inp)))
    assert wb.inputs_hash({**inp, "steps": 11}) != wb.inputs_hash(inp)
    code = wb.code_version()
    assert set(code) == {"torch", "torchtitan", "debug_cpu", "debug_cpu.toml"} and len(code["debug_cpu"]) == 16
    p = tmp_path / "s.jsonl"
    p.write_text('{"schema":"x"}\n{"step":1,"loss":2.0}\n{"step":2,"loss":1.5}\n{"schema":"x"}\n{"step":2,"loss":1.4}\n')
    assert wb.read_rows(p) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.4}]


def test_parse_rules(fa):
    assert fa.parse_rules(["doc_outlier_floor=1.0", "min_docs=4"]) == {"doc_outlier_floor": 1.0, "min_docs": 4}
    assert fa.parse_rules(["notes=", "separation_gate=0", "zscore_min_ratio=0", "doc_tail_spread=false",
                           "grad_novelty=0", "one_doc_spread=false"]) \
        == fa.BEFORE_TIERS
    assert fa.parse_rules([]) == {}
    with pytest.raises(SystemExit):
        fa.parse_rules(["nonsense=1"])
    import dataclasses

    from titan_ledger.components.detection.spikes import SpikeDetector

    fields = {f.name for f in dataclasses.fields(SpikeDetector.Config)}
    assert set(fa._float_fields()) | set(fa._int_fields()) | {"notes", *fa._BOOLS} == fields - {"enable"}
    assert {"window", "min_docs", "readmit_after"} <= set(fa._int_fields())
    assert fa.parse_rules(["readmit_after=0"]) == {"readmit_after": 0}


def test_count_proofs_on_clean_runs(fa):
    row = lambda step, tier, v, promoted=False: {"step": step, "tier": tier, "promoted": promoted,  # noqa: E731
                                                 "verdict": v, "applied": "same", "dp_rank": 0,
                                                 "dp_ranks": None, "documents": None}
    runs = [{"name": "a", "clean_steps": 100, "events": [], "proofs": [row(12, "note", "outlier"),
                                                                       row(40, "note", "not_data"),
                                                                       row(41, "note", "outlier")]},
            {"name": "b", "clean_steps": 100, "events": [{"step": 7, "rules": [], "notes": ["doc_low"]}],
             "proofs": [row(7, "note", "bad_data", promoted=True), row(9, "acting", "not_data")]},
            {"name": "c", "clean_steps": 100, "events": []}]  # recorded without proofs
    res = fa.count_proofs(runs)
    assert res == {"proofs": 5, "proofs_by_verdict": {"note": {"outlier": 2, "not_data": 1, "bad_data": 1},
                                                      "acting": {"not_data": 1}},
                   "proofs_found_cause": ["b@7: bad_data"], "promoted_notes": ["b@7"]}
    full = fa.count(runs)
    assert full["proofs"] == 5 and full["acting_flags"] == 0 and full["note_steps"] == 1
    assert any("found a cause: b@7: bad_data" in line for line in fa.table(full))
    assert fa.count_proofs([])["proofs"] == 0 and not any("proofs at" in x for x in fa.table(fa.count([])))


def test_a_note_promoted_by_its_proof_stays_a_note(fa, tmp_path):
    """A note proven harmful becomes an alarm (its notes are its rules in spikes.jsonl);
    the detector's decision, which the counts and the replay check are about, was a note."""
    (tmp_path / "ledger").mkdir()
    lines = [{"schema": "spikes", "rules": {}},
             {"step": 5, "rules": ["doc_low"], "notes": ["doc_low"], "promoted_by_proof": True,
              "proof": {"verdict": "bad_data"}},
             {"step": 6, "rules": ["ratio"], "notes": []}, {"step": 6, "ladder": True, "rules": ["ratio"]},
             {"step": 8, "notes": ["doc_high"]}]
    (tmp_path / "ledger" / "spikes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ev = fa.spike_events(tmp_path)
    assert [(e["step"], e["rules"], e["notes"], e["promoted"]) for e in ev] == [
        (5, [], ["doc_low"], True), (6, ["ratio"], [], False), (8, [], ["doc_high"], False)]
