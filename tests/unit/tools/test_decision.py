"""titan_ledger.tools.decision: the decision tree is one table of questions (issue 63).

What each question answers on recorded rows is tested in ``test_diagnose.py`` (a
spike of each cause, the precision audit, the evidence rules); here, the table itself:
one entry per question, asked and reported in its order, each naming the cause the
tree's order (``CAUSE_ORDER``) gives it."""

from __future__ import annotations

from tests.unit.tools.test_diagnose import T, ledger
from titan_ledger.tools.decision import CAUSE_ORDER, QUESTIONS, Thresholds, classify


def test_every_question_is_one_row_of_the_table_and_names_the_cause_of_the_trees_order():
    ids = [q.id for q in QUESTIONS]
    assert ids == ["Q0", "F1", "F2", "F3", "Q1", "Q2", "Q3", "Q4", "Q5", "Q6"] and len(set(ids)) == len(ids)
    assert dict(CAUSE_ORDER) == {q.id: q.cause for q in QUESTIONS if q.id != "Q0"}
    assert all(q.text.startswith(f"{q.id} {q.cause}:") for q in QUESTIONS)


def test_classify_reports_every_question_in_the_tables_order_with_its_bars_filled_in():
    rows = ledger()
    rows[T - 1]["grad_norm"] = 40.0  # a grad-norm glitch that falls back, the loss unmoved
    got = classify(rows, T, param_dtype="float32")
    texts = [c["question"] for c in got["checks"]]
    assert [t.split()[0] for t in texts] == [q.id for q in QUESTIONS]
    bars = Thresholds().bars
    assert f">= {bars.rel_update:.0%} of their norm" in texts[2] and "{" not in "".join(texts)
    yes = [c["question"].split()[0] for c in got["checks"] if c["answer"]]
    assert got["cause"] == "hardware" and yes[0] == "Q6", yes
