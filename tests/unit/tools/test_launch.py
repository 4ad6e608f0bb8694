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


def _summary(*failures: tuple[int, str, str], root: int) -> str:
    """torchrun 2.14.1's summary (``ChildFailedError.format_msg``) of ``(rank, exitcode
    field, traceback lines)`` failures, ``root`` the one it observed first."""
    def block(i, rank, code, tb):
        return [f"[{i}]:", "  time      : 2026-12-06_05:32:11", "  host      : localhost",
                f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code}",
                "  error_file: /tmp/torchelastic_x/0/error.json", f"  traceback : {tb[0]}", *("  " + x for x in tb[1:])]
    others = [x for i, f in enumerate(failures) if f[0] != root for x in block(i, *f)]
    first = next(block(i, *f) for i, f in enumerate(failures) if f[0] == root)
    return "\n".join(["", "=" * 60, "titan_ledger.train FAILED", "-" * 60, "Failures:", *others, "-" * 60,
                      "Root Cause (first observed failure):", *first, "=" * 60])


KILLED = (1, "-9 (pid: 6076)  (SIGKILL)", ["Signal 9 (SIGKILL) received by PID 6076"])
RESET = (0, "1 (pid: 6075)", ["Traceback (most recent call last):", '  File "train.py", line 15, in main',
                              "RuntimeError: [../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:32641: "
                              "Connection reset by peer. This is typically caused by a remote worker hanging"])
OOM = (1, "1 (pid: 6076)", ["Traceback (most recent call last):", '  File "train.py", line 9, in step',
                            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"])
STOPPED = (1, "-15 (pid: 6076)  (SIGTERM)", ["Signal 15 (SIGTERM) received by PID 6076"])


def test_the_cause_is_the_rank_that_died_first_whichever_order_torchrun_lists_them():
    """issue 60 item 7: torchrun's root cause is the earliest by whole seconds, a SIGKILLed
    rank's time being when torchrun noticed it, so either rank can be listed first; the
    ranks' own evidence decides: a signal, then an exit on its own error, then an exit on a
    lost peer (its peer's socket reset), torchrun's stop (SIGTERM) left out."""
    for cause, bystander in [(KILLED, RESET), (OOM, RESET)]:
        for listed in [(cause, bystander), (bystander, cause)]:
            for root in (0, 1):
                fs = parse_failures(_summary(*listed, root=root).splitlines())
                assert sorted(f.rank for f in fs) == [0, 1] and fs[0].rank == root  # torchrun's root cause first
                assert cause_of(fs) == next(f for f in fs if f.rank == 1), (listed, root, fs)
                assert cause_of(fs[::-1]) == cause_of(fs)  # the rule, in either order
    fs = parse_failures(_summary(KILLED, RESET, root=0).splitlines())
    assert fs[0].lost_peer == "Connection reset by peer" and fs[1].lost_peer is None  # a signal is no exit
    assert fs[0].error.splitlines()[0] == "Traceback (most recent call last):" and fs[0].error.endswith("hanging")
    assert fs[1].error == "Signal 9 (SIGKILL) received by PID 6076"
    # rank 0's own error, torchrun then stopped rank 1: rank 0, in either order
    own = (0, "1 (pid: 6075)", ["Traceback (most recent call last):", "ValueError: bad batch"])
    for listed in [(own, STOPPED), (STOPPED, own)]:
        fs = parse_failures(_summary(*listed, root=1).splitlines())
        assert cause_of(fs).rank == 0 and cause_of(fs).exitcode == 1


def test_a_bystander_alone_is_not_named_as_the_cause():
    """torchrun's summary holds only the rank whose peer vanished (the dead rank on another
    node; or torchrun's fork start method, which reports one failed rank): it is named as
    what it is, never as the rank that died."""
    fs = parse_failures(_summary(RESET, root=0).splitlines())
    assert fs == [RankFailure(0, 0, 1, "localhost")] and cause_of(fs) == fs[0]
    line = lost_rank_lines(cause_of(fs), 1, 4, 3, True, "CMD")[0]
    assert line == ("titan_ledger.launch: rank 0 (local rank 0 on localhost) exited with code 1 on a lost peer "
                    "(Connection reset by peer): another rank died first, and torchrun's summary does not name it "
                    "(another node's?); torchrun stopped the other ranks"), line
    assert RankFailure(0, 0, -6, error="NCCL: remote process exited").lost_peer is None  # a signal stays a signal


def test_every_failure_is_read_from_a_long_summary(capsys):
    """Eight ranks' 80-line tracebacks: the summary alone is 700 lines, the killed rank's
    block at its top (``Failures:``, before the root cause). The launcher keeps enough of
    torchrun's stderr to read it (it kept 400 lines: the killed rank fell out)."""
    import sys

    from titan_ledger.tools.launch import supervise

    tb = ["Traceback (most recent call last):", *[f'  File "x.py", line {i}, in f' for i in range(78)],
          "RuntimeError: Connection closed by peer"]
    text = _summary(KILLED, *[(r, "1 (pid: 1)", tb) for r in (0, 2, 3, 4, 5, 6, 7)], root=0)
    assert len(text.splitlines()) > 600
    script = f"import sys; sys.stderr.write('noise\\n' * 3000 + {text!r} + '\\n'); sys.exit(1)"
    code, tail, held = supervise([sys.executable, "-c", script])
    assert code == 1 and capsys.readouterr().err.count("\n") >= 3600  # all of it passed through
    fs = parse_failures(tail)
    assert len(fs) == 8 and fs[0].rank == 0 and cause_of(fs) == RankFailure(1, 1, -9, "localhost")
    assert all(f.lost_peer == "Connection closed by peer" for f in fs if f.rank != 1)
    # two summaries (a restarted job's first, then its last): the last is read
    again = parse_failures([*text.splitlines(), *_summary(OOM, RESET, root=0).splitlines()])
    assert [(f.rank, f.exitcode) for f in again] == [(0, 1), (1, 1)] and cause_of(again).error.endswith("2.00 GiB")


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
