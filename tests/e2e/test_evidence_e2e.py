"""Evidence and response, end to end: a quarantine added on resume after kill -9 (the
sample sequence unchanged, the documents' tokens masked), and the recovery ladder
escalating to a stop with its report."""

from __future__ import annotations

import json

import pytest
from conftest import PARALLELISMS
from helpers import (
    CONFIGS,
    cli,
    data_ids,
    data_rows,
    error_lines,
    explain,
    signals_ledger,
    signals_rows,
    spike_events,
    torchrun,
)

from titan_ledger.format.signal_columns import TIMING_KEYS
from titan_ledger.tools import replay
from titan_ledger.tools.runs import run_training

pytestmark = pytest.mark.slow


def test_quarantine_added_on_resume_masks_the_documents_and_keeps_the_samples(runs, tmp_path):
    straight = runs.straight("FSDP2")
    # quarantine a document that DP rank 1 trains at step 6 (after the checkpoint at 3)
    row = data_rows(straight, 1)[6]["rows"][0]
    source, doc = row[1], row[2][0][0]
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"source": source, "doc": doc}) + "\n")
    # the straight run's step-3 checkpoint and ledger, relaunched with the quarantine added
    # (a resume after a kill is test_resume.py's: the same load)
    dump = runs.copy_checkpoint(straight, 3, "quarantine-resume", with_ledger=True)
    args = ["--checkpoint.enable", *runs.args("FSDP2")]
    nproc = PARALLELISMS["FSDP2"].nproc
    again = run_training(nproc, dump, args + ["--ledger.filter.quarantine", str(q)], tmp_path / "log")
    assert again["returncode"] == 0, (tmp_path / "log").read_text()[-6000:]
    # the relaunch names the quarantine as an expected difference from the recorded launch, and nothing else
    said = [x.split(" - ", 3)[-1] for x in (tmp_path / "log").read_text().splitlines() if "titan_ledger: relaunch" in x]
    assert said == [f"titan_ledger: relaunch: expected differences from the run's recorded launch (segment 1 of "
                    f"{dump / 'ledger' / 'segments.jsonl'}): --ledger.filter.quarantine {q} (was none: a quarantine)"], said
    # the same samples as the straight run, step by step and rank by rank
    assert data_ids(dump) == data_ids(straight)
    rc, out, err = cli(replay.main, ["check", straight, dump])
    assert rc == 0 and "EQUAL" in out, out + err
    masked = data_rows(dump, 1)[6].get("masked", {}).get("quarantine")
    assert masked and [0, 0] in masked
    sig, ref = signals_rows(dump), signals_rows(straight)
    assert sig[6]["masked_tokens"] > 0 and ref[6]["masked_tokens"] == 0
    assert sig[6]["consumed_tokens"] - sig[5]["consumed_tokens"] == \
        ref[6]["consumed_tokens"] - ref[5]["consumed_tokens"] - sig[6]["masked_tokens"]
    timing = TIMING_KEYS  # (the table's wall-clock columns)
    assert {k: v for k, v in sig[3].items() if k not in timing} == \
        {k: v for k, v in ref[3].items() if k not in timing}  # before the quarantine: the same history
    hdr = signals_ledger(dump).segments[-1].header
    assert hdr["quarantine"]["documents"] == 1 and hdr["resumed_from"] == 3, hdr


def test_recovery_ladder_escalates_then_stops_with_a_report(tmp_path):
    dump = tmp_path / "ladder"
    # rules sensitive enough that the early steps flag again and again
    proc = torchrun(["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "12",
                     "--dump_folder", str(dump), "--checkpoint.enable", "--checkpoint.interval", "2",
                     "--ledger.spike.grad_jump", "1.1", "--ledger.spike.min_history", "2",
                     "--ledger.response.policy", "act", "--ledger.response.action", "skip_update,rollback,stop", "--ledger.rollback.back", "1",
                     "--ledger.rollback.skip", "1"])
    assert proc.returncode == 1, explain(proc)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "the recovery ladder stopped training" in lines[0], proc.stderr[-3000:]
    assert "what was tried" in proc.stderr and "spikes.jsonl" in proc.stderr
    decisions = [e for e in (json.loads(x) for x in (dump / "ledger" / "spikes.jsonl").read_text().splitlines())
                 if e.get("ladder")]
    assert [d["action"] for d in decisions] == ["skip_update", "rollback", "stop"]
    assert decisions[1]["repeat_within_horizon"] and decisions[2]["repeat_within_horizon"]
    flagged = [e["step"] for e in spike_events(dump)]
    assert flagged[-1] == decisions[-1]["step"]
