"""SpikeGuard in-process: a flagged row becomes an event in both event logs; rewinds
are recorded; events survive a later segment."""

from __future__ import annotations

import torch

from titan_ledger.components.detection.guard import SpikeGuard
from titan_ledger.components.detection.spikes import SpikeDetector
from titan_ledger.components.signals.recorder import Reduced
from titan_ledger.components.signals.topology import Topology
from titan_ledger.format import records
from titan_ledger.format.reader import RunLedger


def _row(step, loss, gn):
    return {"step": step, "loss": loss, "grad_norm": gn, "loss_max": loss, "loss_max_rank": 1, "max_logit": 1.0}


def test_flags_become_events_and_rewinds_are_recorded(tmp_path):
    led = tmp_path / "ledger"
    g = SpikeGuard(Topology.single(), SpikeDetector.Config(window=8), "rollback")
    g.open(led, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
    for step in range(1, 10):
        loss, gn = (2.0, 1.0 + 0.01 * (step % 3)) if step < 9 else (5.0, 40.0)
        red = Reduced(None, torch.tensor(loss, dtype=torch.float64), torch.tensor([loss, loss]), None)
        stats = g.observe(red, torch.tensor(gn, dtype=torch.float64))
        assert bool(stats[0]) == (step == 9)  # the acting flag the update guard reads
        g.on_row(_row(step, loss, gn), stats.tolist())
    g.record_rewind(from_step=9, to_step=4, window=(5, 9))
    g.close()
    g2 = SpikeGuard(Topology.single(), SpikeDetector.Config(window=8), "rollback")
    g2.open(led, records.Header(schema="", run_id="r.r1", seq=2, resumed_from=4))
    g2.close()
    run = RunLedger(tmp_path)
    ev = run.spike_events()
    assert [e["step"] for e in ev] == [9] and ev[0]["action"] == "rollback" and ev[0]["loss_max_rank"] == 1
    assert "ratio" in ev[0]["rules"] and g.flagged == 1
    assert run.rejected_steps() == [9]
    assert run.rewinds() == [{"step": 9, "rewind_to": 4, "skip_window": [5, 9], "action": "rollback"}]


def test_a_note_is_recorded_and_charted_but_never_acted_on(tmp_path):
    """A document outlier (a note by default) at step 12: an event without ``rules`` in
    spikes.jsonl, no rejected step, no flag for the update guard, ``note/*`` scalars and
    no W&B alert; the same step with every rule acting is a spike."""
    from tests.unit.components.ledger.test_dashboards import _container, _wandb
    from titan_ledger.components.ledger.dashboards import log_note, log_spike

    def run(cfg, folder):
        g = SpikeGuard(Topology(world=2, rank=0, dp_size=2, dp_rank=0, dp_rank_of=(0, 1)), cfg, "skip_update")
        g.open(folder, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
        w, fake = _wandb(folder)
        flags = []
        for step in range(1, 15):
            doc = torch.tensor([[3.0, 3.3, 2.7, 5], [3.0, 3.3 if step != 12 else 30.0, 2.7, 5]], dtype=torch.float64)
            red = Reduced(None, torch.tensor(3.0, dtype=torch.float64), torch.tensor([3.0, 3.0]), doc)
            stats = g.observe(red, torch.tensor(1.0, dtype=torch.float64))
            flags.append(bool(stats[0]))
            row = _row(step, 3.0, 1.0)
            event = g.on_row(row, stats.tolist())
            if event is not None:  # the ledger charts what the guard returns (Ledger.drain)
                (log_spike if event[0] == "spike" else log_note)(_container(w), row, event[1])
        g.close()
        return g, flags, fake, RunLedger(folder.parent)

    g, flags, fake, led = run(SpikeDetector.Config(window=8), tmp_path / "tiers" / "ledger")
    assert not any(flags) and g.flagged == 0 and g.noted == 1
    assert led.spike_events() == [] and led.rejected_steps() == []
    (note,) = led.note_events()
    assert note["step"] == 12 and note["notes"] == ["doc_high"] and "rules" not in note
    assert note["suspect_dp_rank"] == 1 and "action" not in note
    assert fake.run.alerts == []
    assert any(r.get("note/flag") == 1.0 and r.get("note/doc_high") == 1.0 for _, r in fake.rows)
    assert not any("spike/flag" in r for _, r in fake.rows)
    g, flags, fake, led = run(SpikeDetector.Config(window=8, notes=""), tmp_path / "all" / "ledger")
    assert flags[11] and g.flagged == 1 and led.rejected_steps() == [12] and fake.run.alerts[0][0] == "WARN"


def test_other_ranks_write_no_event_files(tmp_path):
    g = SpikeGuard(Topology(world=2, rank=1, dp_size=2, dp_rank=1, dp_rank_of=(0, 1)), SpikeDetector.Config(), "none")
    g.open(tmp_path, records.Header(schema="", run_id="r", seq=1, resumed_from=0))
    g.close()
    assert not any(tmp_path.iterdir())


def test_ladder_parsing_and_escalation():
    import pytest

    from titan_ledger.components.response.ladder import Ladder, Rung, parse_ladder
    from titan_ledger.errors import ConfigError

    assert parse_ladder("rollback") == [Rung("rollback", 0)]  # one action: no limit
    rungs = parse_ladder("skip_update*2, rollback, rollback_lr:0.5, stop")
    assert [r.name for r in rungs] == ["skip_update*2", "rollback", "rollback_lr:0.5", "stop"]
    for bad in ("panic", "stop,rollback", "rollback_lr", "rollback_lr:2", "skip_update*x", "stop*2", ""):
        with pytest.raises(ConfigError, match="--ledger.response.action"):
            parse_ladder(bad)
    lad = Ladder(rungs, horizon=10)
    got = [lad.on_spike(s)[1]["action"] for s in (5, 8, 12, 14, 40, 41, 43, 44, 45, 46)]
    assert got == ["skip_update*2", "skip_update*2", "rollback", "rollback_lr:0.5",  # repeats escalate
                   "skip_update*2", "skip_update*2", "rollback", "rollback_lr:0.5", "stop",  # quiet: restart
                   "exhausted"]
    again = Ladder(rungs, horizon=10)
    again.load_state_dict(lad.state_dict())
    assert again.on_spike(47)[0] is None and len(again.history) == len(lad.history) + 1


def test_would_act_answers_for_the_next_flag_without_recording_it():
    from titan_ledger.components.response.ladder import Ladder, parse_ladder

    lad = Ladder(parse_ladder("none,skip_update,none,rollback"), horizon=10)
    answers = []
    for step in (5, 8, 9, 12, 13, 40):
        before = lad.state_dict()
        asked = lad.would_act(step)
        assert lad.state_dict() == before  # asking changes nothing
        rung, _ = lad.on_spike(step)
        answers.append(asked)
        assert asked == (rung is None or rung.action != "none"), step
    # none; skip_update; none; rollback; exhausted (acts: the run stops); quiet horizon: none again
    assert answers == [False, True, False, True, True, False]
