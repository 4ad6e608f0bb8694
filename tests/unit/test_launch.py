"""``titan_ledger.tools.launch``'s last word on a failed job, pure: torchrun's root-cause
block read (the block below is torchrun 2.14.1's, from a real run whose rank 1 was
SIGKILLed), and the three lines the launcher prints from it. The real-process case:
``tests/e2e/test_resume.py`` (PP: rank 1 dies alone, the printed command resumes)."""

from titan_ledger.tools.launch import (
    HeldOutput,
    RankFailure,
    cause_of,
    lost_rank_lines,
    parse_failures,
    without_rehearsal_death,
)

SUMMARY = """\
  RuntimeError: [.../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:24982: Connection reset by peer.
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_19:59:39
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 9998)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 9998
============================================================
"""


# torchrun's "first observed failure" can be the peer: rank 0's collective broke (exit 1,
# with an error file, so an earlier timestamp) while rank 1 was the one SIGKILLed
PEER_FIRST = """\
============================================================
titan_ledger.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_20:21:07
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_20:21:06
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4241)
  error_file: /tmp/torchelastic_x/0/error.json
  traceback : Traceback (most recent call last):
    File "train.py", line 1, in <module>
  RuntimeError: Connection reset by peer
============================================================
"""


def test_the_failure_summary_is_read():
    fs = parse_failures(SUMMARY.splitlines())
    assert fs == [RankFailure(rank=1, local_rank=1, exitcode=-9, host="localhost")] and cause_of(fs) == fs[0]
    assert fs[0].what() == "was killed by SIGKILL (signal 9) (what the OOM killer sends)"
    exited = SUMMARY.replace("-9 (pid: 9998)  (SIGKILL)", "3 (pid: 9998)").replace("rank      : 1 (local_rank: 1)",
                                                                                   "rank      : 5 (local_rank: 1)")
    assert parse_failures(exited.splitlines()) == [RankFailure(5, 1, 3, "localhost")]
    assert parse_failures(["Traceback (most recent call last):", "RuntimeError: x"]) == [] and cause_of([]) is None
    assert parse_failures(SUMMARY.replace("exitcode", "exit").splitlines()) == []  # a block without its code


def test_the_rank_killed_by_a_signal_is_the_cause_not_the_first_observed_peer():
    fs = parse_failures(PEER_FIRST.splitlines())
    assert fs == [RankFailure(0, 0, 1, "localhost"), RankFailure(1, 1, -9, "localhost")]  # root cause first
    assert cause_of(fs) == RankFailure(1, 1, -9, "localhost")
    assert cause_of(fs[:1]) == fs[0]  # no signal death: torchrun's root cause
    # rank 0 exited 3 and torchrun stopped rank 1 (SIGTERM): rank 1 is not the cause
    stopped = [RankFailure(1, 1, -15, "localhost"), RankFailure(0, 0, 3, "localhost")]
    assert cause_of(stopped) == stopped[1] and cause_of(stopped[:1]) == stopped[0]


def test_the_launchers_lines():
    cmd = "python -m titan_ledger.launch --nproc 2 -- --job.config_file X.toml"
    dead = RankFailure(1, 1, -9, "node3")
    assert lost_rank_lines(dead, 1, 4, 3, True, cmd) == [
        "titan_ledger.launch: rank 1 (local rank 1 on node3) was killed by SIGKILL (signal 9) (what the OOM killer "
        "sends); torchrun stopped the other ranks",
        "titan_ledger.launch: the ledger's last complete step: 4; newest complete checkpoint: step 3",
        f"titan_ledger.launch: resume (the same command; it loads checkpoint step-3): {cmd}"]
    assert lost_rank_lines(dead, 1, 4, 3, True, cmd, others=1)[0].endswith(
        "torchrun stopped the other ranks; 1 other rank(s) failed after it (their tracebacks above follow from it)")
    lines = lost_rank_lines(RankFailure(0, 0, 7), 1, None, None, False, cmd)
    assert lines[0] == "titan_ledger.launch: rank 0 (local rank 0) exited with code 7; torchrun stopped the other ranks"
    assert lines[1] == "titan_ledger.launch: the ledger completed no step; checkpoints are off (--checkpoint.enable)"
    assert lines[2].startswith("titan_ledger.launch: train again (the same command; no checkpoint")
    assert lost_rank_lines(None, 1, 2, None, True, cmd)[:2] == [
        "titan_ledger.launch: torchrun exited with code 1 and named no failed rank (its output is above)",
        "titan_ledger.launch: the ledger's last complete step: 2; no complete checkpoint yet"]
    rank_line = "disk full: could not write /d/x (filesystem /d: 0 B free of 1 GB); free space there or move ..."
    assert lost_rank_lines(RankFailure(0, 0, 3), 1, 14, 10, True, cmd, disk_full=rank_line) == [  # one line in all
        "titan_ledger.launch: the run stopped, disk full: could not write /d/x (filesystem /d: 0 B free of 1 GB); "
        "the ledger's last complete step: 14; newest complete checkpoint: step 10; free space there or move "
        f"--job.dump_folder, then resume (the same command; it loads checkpoint step-10): {cmd}"]
    # a rank's bad input (exit 2) said why in its own line: nothing to resume
    assert lost_rank_lines(RankFailure(0, 0, 2), 1, 3, 3, True, cmd) == [
        "titan_ledger.launch: rank 0 stopped on bad input (its error line is above); fix it and launch again"]


def test_the_launcher_holds_back_what_follows_a_ranks_own_error_line():
    summary = ["Traceback (most recent call last):\n", "ChildFailedError:\n", "  exitcode  : 3 (pid: 1)\n"]
    full = "titan_ledger.train: error: disk full: could not write /d/a (filesystem /d: 0 B free of 1 GB); ...\n"
    out = HeldOutput()
    assert out.feed("[rank0]: step 5 loss 2.1\n") == "[rank0]: step 5 loss 2.1\n"  # before: passed on
    assert out.feed(full) is None and out.feed(full.replace("/d/a", "/d/b")) is None  # every rank's: held
    assert all(out.feed(x) is None for x in summary)
    assert out.disk_full.startswith("disk full: could not write /d/a ") and out.finish(3) == []
    assert out.finish(1) == [*summary, full]  # another cause after all: nothing is lost
    bad = "titan_ledger.train: error: --training.steps: expected an integer\n"
    out = HeldOutput()
    assert out.feed(bad) == bad and out.feed(bad) is None and out.feed(summary[0]) is None
    assert out.finish(2) == [] and out.finish(1) == [summary[0]]  # the duplicate line is said once
    quiet = HeldOutput()
    assert quiet.feed(summary[0]) == summary[0] and quiet.finish(1) == []  # no rank line: nothing held


def test_the_resume_command_leaves_a_rehearsed_death_out():
    argv = ["--nproc", "2", "--", "--ledger.rehearsal.die", "5:1:SIGKILL", "--training.steps", "6",
            "--ledger.rehearsal.die=2:0:exit3"]
    assert without_rehearsal_death(argv) == ["--nproc", "2", "--", "--training.steps", "6"]
