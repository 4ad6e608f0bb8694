"""titan_ledger.summary: the end-of-run summary's sections, from files alone (no processes)."""

from titan_ledger import summary
from titan_ledger.format.records import DATA, SIGNALS, SPIKES, RecordWriter


def _write(path, schema, rows, **header):
    w = RecordWriter(path, {"schema": schema, "run_id": "r1", "resumed_from": 0, "seq": 1, **header})
    for r in rows:
        w.write(r)
    w.close()


def _tiny_ledger(dump, *, spike_at=None, dp=2, steps=3):
    led = dump / "ledger"
    _write(led / "signals.jsonl", SIGNALS.id,
           [{"step": s, "loss": 8.0, "spike": s == spike_at} for s in range(1, steps + 1)])
    for r in range(dp):
        _write(led / f"data_dp{r}.jsonl", DATA.id,
               [{"step": s, "skipped": False, "rows": [[s * 10 + r, 0, [[1, 0, 5]]]]}
                for s in range(1, steps + 1)], dp_rank=r)
    if spike_at is not None:
        _write(led / "spikes.jsonl", SPIKES.id, [{"step": spike_at, "rules": ["zscore"]}])
    return led


def test_run_summary_counts_rows_spikes_checkpoints_and_names_commands(tmp_path):
    _tiny_ledger(tmp_path, spike_at=2)
    for step in (2, 3):
        (tmp_path / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").write_text("")
    (tmp_path / "checkpoint" / "step-9").mkdir()  # no .metadata: incomplete, not listed
    text = summary.run_summary(tmp_path, "ledger")
    assert f"the ledger is in {tmp_path / 'ledger'}" in text
    assert "signals      3 rows, steps 1-3" in text
    assert "1 flagged: steps 2" in text
    assert "data ledger  steps 1-3 on each of 2 DP ranks" in text
    _tiny_ledger(tmp_path / "one", dp=1)
    assert "data ledger  steps 1-3 (data_dp0.jsonl)" in summary.run_summary(tmp_path / "one")
    assert "step-2, step-3" in text and "step-9" not in text
    assert f"python -m titan_ledger.plot {tmp_path} -o {tmp_path / 'signals.png'}" in text  # into the dump folder
    assert f"python -m titan_ledger.diagnose {tmp_path}" in text
    assert f"python -m titan_ledger.lookup {tmp_path} --step 2" in text  # the spike
    assert f"python -m titan_ledger.report {tmp_path} --step 2 -o {tmp_path / 'incident-step2.html'}" in text
    assert f"python -m titan_ledger.export {tmp_path} -o {tmp_path / 'export'}" in text


def test_run_summary_counts_notes_proofs_and_what_the_response_held_back(tmp_path):
    """Under the default policy (observe) a proof's verdict changes nothing: the summary
    says how many proofs would have acted, beside the notes and the response's events."""
    led = _tiny_ledger(tmp_path)
    _write(led / "spikes.jsonl", SPIKES.id, [
        {"step": 2, "rules": ["ratio"], "proof": {"verdict": "bad_data", "applied": "original",
                                                   "would_apply": "masked", "held_back": "observe"}},
        {"step": 3, "notes": ["doc_low"], "proof": {"verdict": "outlier", "applied": "original"}},
        {"step": 3, "notes": ["grad_jump"], "proof": {"verdict": "optimizer_state", "applied": "original"}},
        {"step": 4, "no_tokens": True, "masked": ["quarantine"]},
        {"step": 5, "response_failure": {"where": "snapshot", "error": "MemoryError"}}])
    text = summary.run_summary(tmp_path, "ledger")
    assert "  notes        2 recorded, never acted on" in text
    assert ("  proofs       3: 1 bad_data, 1 outlier, 1 optimizer_state; 1 held back (would have acted: "
            "--ledger.response.policy observe)") in text
    assert ("  response     1 failure(s) inside the response, training went on; 1 step(s) consumed untrained "
            "(every label masked)") in text


def test_run_summary_without_spikes_or_checkpoints_and_uneven_ranks(tmp_path):
    led = _tiny_ledger(tmp_path, steps=4)
    _write(led / "data_dp2.jsonl", DATA.id, [{"step": 1, "skipped": False, "rows": []}], dp_rank=2)
    text = summary.run_summary(tmp_path, "ledger")
    assert "spikes       none flagged" in text
    assert "checkpoints  none" in text
    assert "dp0: 4, dp1: 4, dp2: 1" in text
    assert f"titan_ledger.lookup {tmp_path} --step 4" in text  # the last step
    assert "--ledger-folder" not in text


def test_run_summary_of_an_empty_folder_and_another_ledger_folder(tmp_path):
    text = summary.run_summary(tmp_path, "led2")
    assert "signals      none" in text and "data ledger  none" in text
    assert "--ledger-folder led2" in text


def test_printed_commands_name_the_interpreter_that_runs(monkeypatch, tmp_path):
    """The summary's next commands run as printed: ``python`` when it is this interpreter,
    else this interpreter's path (relative below the working directory)."""
    import sys

    from titan_ledger.errors import python_command

    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert python_command() == ".venv/bin/python"
    assert ".venv/bin/python -m titan_ledger.diagnose" in summary.run_summary(tmp_path)
    monkeypatch.setenv("PATH", str(venv))  # the venv activated
    assert python_command() == "python"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # not below: the absolute path
    monkeypatch.setenv("PATH", "/nonexistent")
    assert python_command() == str(venv / "python")


def test_the_summary_leads_with_the_runs_episodes(tmp_path):
    """The run's answer first (issue 77): a run whose loss rose above its first steps with its
    weights moving 1.5% a step -- no spike rule fired -- is one episode from step 3, its LR a
    candidate the summary tells how to prove; a spike's run, its one burst."""
    import json
    from pathlib import Path

    fixture = Path(__file__).resolve().parent / "fixtures" / "readme_lr_signals.json"
    rows = json.loads(fixture.read_text())["lr0.05"]
    _write(tmp_path / "broken" / "ledger" / "signals.jsonl", SIGNALS.id, rows)
    text = summary.run_summary(tmp_path / "broken", "ledger").splitlines()
    assert text[1:3] == ["  episodes: 1", "    episode 1, steps 3-60: the model left its healthy regime at step 3 (no "
                                          "spike rule fired): the learning rate -- not proven: the model's health "
                                          "dates it, its signs name a candidate"]
    assert any("diagnose" in x and "--rerun" in x for x in text[3:6])
    _tiny_ledger(tmp_path / "spike", spike_at=2)
    assert summary.run_summary(tmp_path / "spike", "ledger").splitlines()[2].startswith("    episode 1, step 2:")
