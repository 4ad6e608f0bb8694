"""Spike rules (on-device code run on CPU) over synthetic ledgers."""

from __future__ import annotations

import math

import torch

from titan_ledger.spikes import STAT_KEYS, SpikeDetector, describe, detect_offline
from tests.unit.test_diagnose import ledger


def test_rules_flag_spikes_and_nan_and_keep_the_window_clean():
    rows = ledger(300)
    rows[200].update(loss=4.8, grad_norm=9.0)
    rows[250]["loss"] = float("nan")
    events = detect_offline(rows, SpikeDetector.Config())
    assert [e["step"] for e in events] == [201, 251]
    assert set(events[0]["rules"]) == {"zscore_loss", "zscore_grad_norm", "ratio"}
    assert events[1]["rules"] == ["non_finite"]
    # the flagged value never entered the window: the mean is unaffected
    assert abs(events[1]["grad_norm_mean"] - 1.0) < 0.02


def test_rules_wait_for_half_a_window_and_can_be_switched_off():
    det = SpikeDetector(SpikeDetector.Config(window=8))
    for i in range(3):
        assert det.step(torch.tensor(2.0), torch.tensor(1.0 + 0.01 * i))[0] == 0
    assert det.step(torch.tensor(50.0), torch.tensor(50.0))[0] == 0  # only 3 < 4 steps seen
    off = SpikeDetector(SpikeDetector.Config(window=8, zscore=0, ratio=0))
    for i in range(8):
        off.step(torch.tensor(2.0 + 0.01 * i), torch.tensor(1.0))
    stats = off.step(torch.tensor(50.0), torch.tensor(50.0)).tolist()
    assert stats[0] == 0 and len(stats) == len(STAT_KEYS)
    assert describe(off.step(torch.tensor(math.inf), torch.tensor(1.0)).tolist())["rules"] == ["non_finite"]


def test_detector_state_round_trip():
    a = SpikeDetector(SpikeDetector.Config(window=16))
    for i in range(10):
        a.step(torch.tensor(2.0 + 0.01 * i), torch.tensor(1.0))
    b = SpikeDetector(SpikeDetector.Config(window=16))
    b.load_state_dict(a.state_dict())
    x = (torch.tensor(3.0), torch.tensor(4.0))
    assert torch.equal(a.step(*x), b.step(*x))
