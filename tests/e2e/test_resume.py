"""kill -9 and resume, one run per parallelism, against the uninterrupted run.

``runs.resumed(case)`` (conftest.py) is ``titan_ledger.replay resume``: train with the
straight run's arguments, SIGKILL torchrun and every rank (workers and prefetched
batches included) when step 5 starts, relaunch (it resumes from the step-3
checkpoint), finish step 6. PP's is a rank that dies alone instead: under
``titan_ledger.launch``, rank 1 is SIGKILLed when step 5 starts (what the OOM killer
does), torchrun stops rank 0, and the resume command the launcher printed is run as
printed. The matrix (text and indexed, 0 and 2 workers, DP 2 and 1):

    parallelism  source   num_workers  fault
    FSDP2        text     2            kill -9 of the job
    TP 2         indexed  0            kill -9 of the job
    PP 2         text     2            rank 1 alone (launcher)
"""

from __future__ import annotations

import re

import pytest
from conftest import KILL_AT, PARALLELISMS, STEPS
from helpers import (
    TB_GRAD_NORM,
    cli,
    data_spans,
    explain,
    logged_losses,
    read_tb,
    signal_keys,
    signals_ledger,
    signals_rows,
    torchrun,
)

from titan_ledger.format.signal_columns import TIMING_KEYS
from titan_ledger.tools import replay

pytestmark = pytest.mark.slow

RESUMES = [c for c, p in PARALLELISMS.items() if p.resume]


@pytest.mark.parametrize("case", RESUMES)
def test_kill9_resume_trains_exactly_the_same_samples_and_losses(runs, case):
    a = runs.straight(case)
    b, report = runs.resumed(case)
    assert report["killed_at_step"] == KILL_AT
    assert report["resumed_from_checkpoint"] == 3 and report["checkpoints_before_kill"] == [3]
    if not PARALLELISMS[case].lost_rank:  # (the lost rank's resume: the header's resumed_from below)
        assert "Training starts at step 4" in (b / "replay_resume.log").read_text()
    # the samples: per DP rank and step the same ids, ranks disjoint (replay check, in process)
    import json

    rc, out, err = cli(replay.main, ["check", a, b, "--json"])
    assert rc == 0, out + err
    res = json.loads(out)
    assert res["equal"] and res["steps_compared"] == STEPS and not res["overlaps"], res
    # the signals: the killed run's rows after the checkpoint are superseded history,
    # never mixed in; the new rows equal the uninterrupted run's, bit for bit
    led, ref = signals_ledger(b), signals_rows(a)
    assert [r["step"] for r in led.history] == list(range(1, STEPS + 1))
    assert led.segments[-1].header["resumed_from"] == 3
    # the precision audit, read from the live objects, in every launch's header: all fp32
    audit = {r["check"]: r for r in led.segments[-1].header["precision"]}
    assert all(r["ok"] in (True, None) for r in audit.values()), audit
    assert audit["compute dtype"]["found"] == "float32" and audit["attention softmax / accumulation"]["found"] == "cpu"
    if PARALLELISMS[case].dp > 1:  # FSDP's policy, read from its parameter groups
        assert "FSDP MixedPrecisionPolicy" in audit["gradient reduction"]["how"], audit["gradient reduction"]
    if PARALLELISMS[case].lost_rank:  # exactly the rows the killed run wrote after the checkpoint (see below)
        killed = report["ledger_steps_before_resume"]
        assert {r["step"] for r in led.superseded} == set(killed) - {1, 2, 3} and led.torn_lines <= 1, killed
    else:
        assert {r["step"] for r in led.superseded} >= {4} and led.torn_lines <= 1
    gb = 4 * PARALLELISMS[case].dp  # 4 rows per DP rank
    for row in led.history:
        s = row["step"]
        assert row["consumed_samples"] == gb * s
        for key in signal_keys():
            if key not in TIMING_KEYS:  # (the table's wall-clock columns)
                assert row[key] == ref[s][key], (s, key, row[key], ref[s][key])
    # no document token trained twice (workers included), across ranks and steps
    spans = [span for _, _, span in data_spans(b, range(1, STEPS + 1))]
    assert len(spans) == len(set(spans))


def test_kill9_resume_dashboards_match(runs):
    """TensorBoard of the resumed FSDP2 run: loss and grad norm, bit-identical (as float32
    scalars) to the uninterrupted run's from the checkpoint on."""
    a = runs.straight("FSDP2")
    b, _ = runs.resumed("FSDP2")
    full, res = read_tb(a), read_tb(b)
    assert sorted(full) == list(range(1, STEPS + 1)) and {4, 5, 6} <= set(res)
    assert [res[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)], (full, res)
    gn_full, gn_res = read_tb(a, TB_GRAD_NORM), read_tb(b, TB_GRAD_NORM)
    assert [gn_res[s] for s in (4, 5, 6)] == [gn_full[s] for s in (4, 5, 6)]


def test_a_rank_that_dies_alone_is_named_with_the_last_step_and_the_resume_command(runs):
    """The launcher's last three lines after rank 1's SIGKILL at the start of step 5 (PP:
    rank 1 holds the last stage), and how soon the job ended (issue 37: within 60 s).

    The last complete step is the one the killed run's ledger holds: 3 or 4. Rows 1-3 are
    certain (step 3's checkpoint drained them); step 4's row waits for the decision rank 0
    makes behind step 5's launched work (or writes as it stands when its collective breaks),
    so it exists only if rank 0 got that far before torchrun's SIGTERM stopped it: a race
    no launcher rule decides (cold, rank 1's DataLoader workers hold its sockets open for
    seconds after the SIGKILL and rank 0 is stopped first: 3; issue 60 item 7)."""
    _, r = runs.resumed("PP")
    lines = r["lines"]
    # on failure: the launcher's whole stderr (the ranks' tracebacks, torchrun's summary)
    said = f"{lines}\n--- the launcher's stderr:\n{r['stderr'][-20000:]}"
    assert len(lines) == 3 and lines == r["last_lines"], said
    assert lines[0].startswith("titan_ledger.launch: rank 1 (local rank 1 on ") and (
        ") was killed by SIGKILL (signal 9) (what the OOM killer sends); torchrun stopped the other ranks" in lines[0]), said
    steps = r["ledger_steps_before_resume"]
    assert steps in ([1, 2, 3], [1, 2, 3, 4]), (steps, said)
    assert lines[1] == (f"titan_ledger.launch: the ledger's last complete step: {steps[-1]}; newest complete "
                        f"checkpoint: step 3"), said
    assert lines[2].startswith("titan_ledger.launch: resume (the same command; it loads checkpoint step-3): "), said
    assert "--ledger.rehearsal.die" not in r["resume"] and r["resume"][r["resume"].index("--") + 1:] == \
        runs.args("PP") + ["--job.dump_folder", r["resume"][-1]]
    assert 0 < r["ended_s"] < 60, r["ended_s"]


def test_a_full_disk_stops_with_one_line_keeps_the_record_and_resumes_exactly(runs, tmp_path):
    """The FSDP2 straight run's command on a 200 MB tmpfs holding 90 MB of ballast: the
    step-3 checkpoint (75 MB) fits, the step-6 one cannot. The run stops with exit 3 and
    one line per process at most, no logging-error flood, its ledger lines complete and
    the cut checkpoint unlisted; with the ballast gone the same command resumes from step
    3 and ``replay check`` against the uninterrupted run is EQUAL (issue 37)."""
    import json
    import os
    import subprocess
    from unittest import mock

    from helpers import child_env

    from titan_ledger.format.reader import checkpoints
    from titan_ledger.tools import launch

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs on this machine (needs root)")
    try:
        (mnt / "ballast").write_bytes(b"\0" * (90 << 20))
        dump = mnt / "run"
        argv = ["--nproc", "2", "--", *runs.args("FSDP2"), "--job.dump_folder", str(dump)]
        with mock.patch.dict(os.environ, child_env()):
            rc, out, err = cli(launch.main, argv)
            # before any rank starts, the launcher's estimate warned that the folder cannot hold
            # the run; then, through the launcher, ONE line in all for the full disk: the path,
            # its filesystem, the state, the command
            warned, *rest = err.splitlines()
            assert rc == 3 and len(rest) == 1, f"rc={rc}\n{err[-5000:]}"
            assert warned.startswith(f"titan_ledger.launch: warning: {dump} has ") and \
                "2 checkpoint(s) of 74.0 MB held at once" in warned, warned
            full = rest[0]
            assert full.startswith("titan_ledger.launch: the run stopped, disk full: could not write "), err
            assert f"(filesystem {mnt}: " in full and "newest complete checkpoint: step 3" in full, err
            assert checkpoints(dump) == [3]  # step-6 was cut: no .metadata, never listed
            led = signals_ledger(dump)
            assert led.torn_lines == 0 and [r["step"] for r in led.history][:5] == [1, 2, 3, 4, 5], led.torn_lines
            (mnt / "ballast").unlink()
            rc2, out2, err2 = cli(launch.main, argv)  # the same command
        assert rc2 == 0, err2[-5000:]
        rc3, out3, err3 = cli(replay.main, ["check", runs.straight("FSDP2"), dump, "--json"])
        res = json.loads(out3)
        assert rc3 == 0 and res["equal"] and res["steps_compared"] == STEPS, out3 + err3
        assert signals_ledger(dump).segments[-1].header["resumed_from"] == 3
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_finished_run_relaunched_with_a_changed_flag_says_so_and_trains_nothing(runs):
    """The FSDP2 straight run (its ledger and step-6 checkpoint, copied) relaunched with one
    flag changed (issue 70): rank 0 names the difference against the recorded launch
    (config/launch_diff.py's line) and, at the end, that the run had already reached its
    last step; exit 0, no step trained, no colour codes in the redirected output, no
    empty folder left behind."""
    dump = runs.copy_checkpoint(runs.straight("FSDP2"), STEPS, "relaunch-finished", with_ledger=True)
    proc = torchrun([*runs.args("FSDP2"), "--job.dump_folder", str(dump), "--ledger.spike.window", "9"],
                    nproc=PARALLELISMS["FSDP2"].nproc)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, explain(proc)
    ours = [line.split(" - ", 3)[-1] for line in out.splitlines() if " - titan_ledger.train - " in line]
    said = "\n".join(ours)
    relaunch = [x for x in ours if x.startswith("titan_ledger: relaunch")]
    assert len(relaunch) == 1 and re.fullmatch(
        r"titan_ledger: relaunch: 1 setting differs from the run's recorded launch \(segment 1 of "
        rf"{re.escape(str(dump / 'ledger' / 'segments.jsonl'))}\): --ledger\.spike\.window 9 \(was \d+\)",
        relaunch[0]), said
    assert ours[-1] == (f"titan_ledger: the run already reached step {STEPS} of {STEPS}; nothing trained; to train "
                        "again with these flags use a new --dump_folder, to go on raise --training.steps"), said
    assert f"Training starts at step {STEPS + 1}" in out and not logged_losses(out)
    assert "\x1b[" not in out
    assert not [p for p in dump.rglob("*") if p.is_dir() and not any(p.iterdir())]


def test_a_redirected_run_log_has_no_colour_codes_and_the_step_line_shows_resident_memory(runs):
    """The FSDP2 straight run's console, captured (not a terminal): no ANSI escape codes; on
    the CPU backend each step line's memory is the process's peak resident memory (issue
    70: it read ``-0.00GiB(-0.00%)``); no empty folder in its dump folder (comm_traces/)."""
    straight = runs.straight("FSDP2")
    log = (straight / "train.log").read_text()
    assert "\x1b[" not in log
    mem = [float(m) for m in re.findall(r" - INFO - step:\s+\d+ .* memory:\s+(-?[\d.]+)GiB", log)]
    assert len(mem) == STEPS and min(mem) > 0.1, mem  # (about 1.3 GiB a rank: torch and the model)
    assert not [p for p in straight.rglob("*") if p.is_dir() and not any(p.iterdir())]
