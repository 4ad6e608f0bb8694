"""titan_ledger.components.response.bounds: what bounds an automatic action -- the
quarantine's size (a share of the corpus, a whole step) and the circuit breaker (at most
K actions within M steps, paused until a window passes without one)."""

from __future__ import annotations

from titan_ledger.components.response.bounds import Breaker, quarantine_coverage

A, B = ("c", 1), ("c", 2)


def test_a_small_quarantine_is_applied_and_its_coverage_recorded():
    cov = quarantine_coverage([B, A], {A: 300, B: 100}, {A: 0.003, B: 0.001}, step_tokens=1024, max_share=0.01)
    assert cov.refused is None and cov.tokens == 400 and cov.longest == 300
    assert cov.documents == [["c", 1], ["c", 2]] and abs(cov.share - 0.004) < 1e-12
    assert cov.to_json()["share"] == 0.004 and "refused" not in cov.to_json()


def test_a_step_the_quarantine_would_empty_is_refused():
    """The memorisation plateau (issue 60), read ahead in the corpus's order: document 358
    (1,202 tokens) filled all of step 421 (1,024 tokens a step); its quarantine left that
    step with nothing and the run stopped on the NaN."""
    ahead = {"steps": 1000, "rows": 8000, "tokens": 1202, "total": 1_024_000, "empty": [1], "with": [[0, 1], [1, 1024]]}
    cov = quarantine_coverage([A], {A: 1202}, {A: 0.0007}, step_tokens=1024, max_share=0.01, ahead=ahead)
    assert cov.refused == "masking them would leave 1 of the next 1000 steps with nothing to train on"
    assert "c:1 (1202 tokens, 0.070% of the corpus, 0.117% of the next 1000 steps)" in cov.describe()
    assert cov.to_json()["ahead"]["empty"] == [1] and "with" not in cov.to_json()["ahead"]


def test_a_share_of_the_next_steps_past_the_bound_is_refused_though_the_corpus_share_is_small():
    """A corpus read in order: a document's share of the corpus says little about the
    stretch it sits in."""
    ahead = {"steps": 100, "rows": 800, "tokens": 3000, "total": 102_400, "empty": []}
    cov = quarantine_coverage([A], {A: 3000}, {A: 0.001}, 1024, 0.01, ahead=ahead)
    assert cov.refused and "2.930% of the next 100 steps' tokens" in cov.refused


def test_without_reading_ahead_one_document_as_long_as_a_dp1_step_is_refused():
    cov = quarantine_coverage([A], {A: 1202}, {A: None}, 1024, 0.01, lone_doc_step=1024)
    assert cov.refused and "could leave a step with nothing" in cov.refused
    # at DP >= 2 each rank streams its own documents: one cannot fill a step
    assert quarantine_coverage([A], {A: 1813}, {A: None}, 512, 0.01, lone_doc_step=None).refused is None


def test_the_breaker_pauses_at_the_action_past_its_limit_and_resumes_after_a_quiet_window():
    b = Breaker(limit=2, window=10)
    taken = []
    for step in (1, 3, 5, 7, 12, 16, 22):
        if b.allows(step):
            b.record(step)
            taken.append(step)
    # 1 and 3 taken; 5 would be the third within 10 steps: paused there; 7, 12 refused
    # (the last action, 3, is within 10 steps of 12); at 16 the window since 3 is quiet
    assert taken == [1, 3, 16, 22]
    ev = b.take_events()
    assert ev == [{"step": 5, "breaker": "paused", "actions": [1, 3], "limit": 2, "window": 10},
                  {"step": 16, "breaker": "resumed", "paused_at": 5}]
    assert not b.take_events() and not b.paused


def test_the_breaker_state_is_checkpointed():
    b = Breaker(limit=1, window=5)
    b.record(3)
    assert not b.allows(4) and b.paused
    c = Breaker(limit=1, window=5)
    c.load_state_dict(b.state_dict())
    assert c.paused and c.steps == [3] and not c.allows(6) and c.allows(8)


def test_a_pause_ends_at_the_first_step_a_window_after_the_last_action_even_with_no_action_asked():
    b = Breaker(limit=1, window=4)
    b.record(2)
    assert not b.allows(3)
    for step in (4, 5):
        b.tick(step)
    assert b.paused and b.take_events() == [{"step": 3, "breaker": "paused", "actions": [2], "limit": 1, "window": 4}]
    b.tick(6)
    assert not b.paused and b.take_events() == [{"step": 6, "breaker": "resumed", "paused_at": 3}]
