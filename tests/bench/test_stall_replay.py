"""bench/stall_replay.py: the stall rule replayed over written ledgers finds what the rule
finds on the rows, in every run of a folder of runs, and says so when there is none."""

from __future__ import annotations

import json

from helpers import load_bench

from titan_ledger.format import records

#: the real set's logit stall, seed 0 (window medians of the loss and the max attention logit)
STALL = [(6.668, 235), (6.515, 668), (6.277, 2.08e3), (6.351, 5.66e3), (6.466, 1.12e4), (6.411, 1.46e4),
         (6.341, 2.29e4), (6.343, 3.18e4), (6.35, 4.33e4), (6.40, 5.06e4)]


def _run(folder, windows):
    led = folder / "ledger"
    led.mkdir(parents=True)
    w = records.RecordWriter(led / records.SIGNALS_FILE,
                             {"schema": records.SIGNALS.id, "run_id": folder.name, "resumed_from": 0, "seq": 1})
    step = 0
    for med, logit in windows:
        for i in range(50):
            step += 1
            w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": step, "skipped": False,
                     "loss": med + (0.01 if i % 2 else -0.01), "max_logit": logit})
    w.close()


def test_a_folder_of_runs_is_replayed_run_by_run(tmp_path, capsys):
    bench = load_bench("stall_replay")
    _run(tmp_path / "runs" / "stalled", STALL)
    _run(tmp_path / "runs" / "learning", [(6.0 - 0.2 * i, 50.0) for i in range(10)])
    assert bench.main([str(tmp_path / "runs"), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    by = {r["run"].rsplit("/", 1)[-1]: r for r in lines[:-1]}
    assert by["stalled"]["flags"] == [[350, "stalled", 6.277, 22900.0]] and by["learning"]["flags"] == []
    assert lines[-1] == {"runs": 2, "steps": 1000, "flags": 1, "least_steps_to_flag": 250}


def test_a_folder_without_ledgers_is_an_error_naming_it(tmp_path, capsys):
    assert load_bench("stall_replay").main([str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
