"""titan_ledger.format.answers.health: the model's health from the signals every run records.

A run an LR broke in its first steps is read as broken from the step its loss rose above its
first steps' level and its update moved the weights too far, before any spike rule could
fire; its healthy twin (the same run at a tenth of the LR) and a memorised plateau are not;
one odd step is not a broken model; a model whose damage clears recovers; the reading
resumes from its state exactly. No processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from titan_ledger.format.answers import health

SIGNALS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "readme_lr_signals.json").read_text())


def _rows(losses, logits, pn=None):
    pn = pn or [100.0 + 0.001 * i for i in range(len(losses))]
    return [{"step": i + 1, "loss": a, "max_logit": b, "param_norm": c} for i, (a, b, c) in
            enumerate(zip(losses, logits, pn))]


def test_the_readme_run_at_lr_005_broke_at_step_3_and_its_lr_0005_twin_did_not():
    """The README's first command at --optimizer.lr 0.05 (recorded): the loss 8.06 -> 9.6 by step
    4, the param norm moving 0.5-1.5% a step, the max logit 0.66 -> 520 by step 5; no spike rule
    fired in its 60 steps. At 0.005 the max logit ends at 35 and the loss at 5.70: healthy."""
    (span,) = health.read(SIGNALS["lr0.05"])
    assert span.onset == 3 and span.last is None and span.names == ("loss", "update", "logits")
    assert "above its first steps' 8.06" in span.words() and "the LR's fingerprint" in span.words()
    assert health.read(SIGNALS["lr0.005"]) == []


def test_a_plateau_one_odd_step_and_a_slow_rise_of_the_logits_are_healthy():
    n = 400
    plateau = _rows([0.007 + 0.001 * (i % 3) for i in range(n)], [3 + 4 * i / n for i in range(n)])
    assert health.read(plateau) == []
    blip = _rows([8 - i * 0.01 for i in range(n)], [1.0 + (5000 if i == 50 else 0) for i in range(n)])
    assert health.read(blip) == []  # one step past every bar: not a broken model (hold 3)
    slow = _rows([8 - i * 0.005 for i in range(n)], [0.7 * (1 + i / 8) for i in range(n)])  # 0.7 -> 35: x50
    assert health.read(slow) == []


def test_a_model_whose_damage_clears_recovers_and_a_resumed_reading_is_the_same():
    n = 300
    logits = [1.0] * 3 + [1000.0] * 40 + [5.0] * (n - 43)
    rows = _rows([8 - i * 0.001 for i in range(n)], logits)
    (span,) = health.read(rows)
    assert span.onset == 4 and span.names == ("logits",) and span.last == 43  # the last damaged step
    live = health.Health()
    broken = [live.observe(r) is not None or live.broken_since is not None for r in rows]
    assert broken.index(True) == 5 and broken[43 + health.Bars().recover - 2] and not broken[43 + health.Bars().recover]
    h = health.Health()
    for r in rows[:20]:
        h.observe(r)
    again = health.Health()
    again.load_state_dict(json.loads(json.dumps(h.state_dict())))
    for r in rows[20:]:
        again.observe(r)
    assert again.current() == [span]


def test_a_non_finite_or_skipped_row_is_not_read():
    """A non-finite loss or a skipped window is no reading: a model broken by its logits stays
    broken across them, and they do not count as steps of a healthy stretch."""
    rows = _rows([8.0] * 3 + [8.0, math.nan, 8.0, 8.0, math.nan], [1.0] * 3 + [1000.0] * 5)
    rows.append({"step": 9, "skipped": True, "loss": None})
    h = health.Health()
    opened = [h.observe(r) for r in rows]
    assert [s is not None for s in opened] == [False] * 6 + [True, False, False]  # steps 4, 6, 7: three readings
    assert h.broken_since == 4 and [k for k, _ in h.changes()] == ["opened"]


def test_a_loss_that_rose_alone_is_new_data_not_a_broken_model():
    """docstrings then tables (bench/adversarial.py's shift_tables, DP 2): the loss 2.0 -> 8.8
    in one step, 4.4x its best window, the logits and the weights' steps as before: healthy."""
    n = 500
    rows = _rows([2.0] * 400 + [8.8] * 40 + [6.0] * (n - 440), [10.0] * n)
    assert health.read(rows) == []
    # the same jump beside an update moving the weights 1% a step: broken, from where the update began
    pn = [100.0 * (1.01 ** max(0, i - 395)) for i in range(n)]
    (span,) = health.read(_rows([2.0] * 400 + [8.8] * 40 + [6.0] * (n - 440), [10.0] * n, pn))
    assert span.names == ("loss", "update") and span.onset == 397


def test_the_spans_a_trainer_recorded_are_read_from_its_events_on_the_current_timeline():
    """The trainer records every change -- a stretch opened, a sign joined it, it closed -- and
    the views read those: the last word for an onset stands, one never closed runs to the end;
    a launch that resumed after step R (a rollback, a relaunch from a checkpoint) rolled the
    reading back to R: a stretch that opened after R never happened, one that closed after R
    is open again."""
    h = health.Health()
    events = []
    for r in SIGNALS["lr0.05"]:
        h.observe(r)
        events += [{"step": r["step"], "health": s.to_json(), **({"recovered": True} if k == "recovered" else {})}
                   for k, s in h.changes()]
    assert [e["step"] for e in events] == [6, 7]  # opened with the loss and the update; the logits joined
    assert health.from_segments([(0, events)]) == h.current() and h.current()[0].names == ("loss", "update", "logits")
    early = health.Span(3, None, h.current()[0].signs)
    closed = {"step": 140, "health": health.Span(40, 90, early.signs).to_json(), "recovered": True}
    later = {"step": 300, "health": health.Span(250, None, early.signs).to_json()}
    assert health.from_segments([(0, events + [closed, later]), (100, [])]) == [early, health.Span(40, None,
                                                                                                  early.signs)]
