"""The postmortem of an automatic rollback, end to end on one real run (issue 24, item 5):
``diagnose`` with no ``--step`` covers the rolled-back step, ``report`` gives the same
verdict through the same code path, both say what was done; ``lookup``, ``rollback``
and ``replay rerun`` on that step work from the rows as they stood."""

from __future__ import annotations

import json

import pytest
from helpers import CONFIGS, cli, explain, torchrun

from titan_ledger.tools import diagnose, lookup, replay, report, rollback

pytestmark = pytest.mark.slow

# the reported run: step 10's batch on DP rank 1 replaced by a repeated token, flagged,
# rolled back to step-8 (checkpoints every 4), steps 9-10 skipped
FLAGS = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "14",
         "--training.local_batch_size", "2", "--training.seq_len", "128",  # a quarter of the TOML's rows
         "--ledger.spike.window", "8", "--checkpoint.enable", "--checkpoint.interval", "4",
         "--ledger.rehearsal.inject", "10:1:repeat", "--ledger.response.policy", "act", "--ledger.response.action", "rollback",
         "--ledger.proof.scope", "off",  # the postmortem of a rollback (a proof would fix it in step)
         "--ledger.rollback.back", "1", "--ledger.rollback.skip", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("postmortem") / "run"
    p = torchrun([*FLAGS, "--job.dump_folder", str(d)])
    assert p.returncode == 0, explain(p)
    assert "rolling back from step 10 to checkpoint step-8; skipping steps 9-10" in p.stdout + p.stderr
    return str(d)


def test_diagnose_and_report_agree_on_the_rolled_back_step_and_say_what_was_done(run, tmp_path):
    rc, out, err = cli(diagnose.main, [run, "--json"])  # no --step: the acted-on steps
    assert rc == 0, err
    (d,) = json.loads(out)["spikes"]
    assert d["step"] == 10 and d["rewound"] is True
    assert d["trainer"]["action"] == "rollback" and "zscore_grad_norm" in d["trainer"]["rules"]
    assert set(d["rank_losses"]) == {"0", "1"} and all(isinstance(v, float) for v in d["rank_losses"].values())
    assert d["param_dtype"] == "float32" and d["certainty"] in ("evidence", "guess")
    assert "rolled back to checkpoint step-8, skipped 9\u201310" in d["done"]
    assert "retrained as steps 11\u201314" in d["done"]
    # the injected batch: said, and no documents are named nor a quarantine proposed
    assert d["injected"] == {"1": "repeat"} and not d.get("documents") and "quarantine_command" not in d
    assert "batch replaced by an injection" in d["documents_note"]
    info = report.report(run, 10, tmp_path / "incident.html", around=5, back=1, skip=2)
    v = info["verdict"]
    assert (v["cause"], v["certainty"], v["done"]) == (d["cause"], d["certainty"], d["done"])
    assert json.dumps(v["checks"]) == json.dumps(d["checks"])  # NaN != NaN: compared as written
    assert v["trainer"] == d["trainer"] and v["rank_losses"] == d["rank_losses"]
    page = (tmp_path / "incident.html").read_text()
    tree = d["tree"]  # the decision tree's reading: a candidate on the page, never the answer
    assert "rolled back to checkpoint step-8" in page and f"<b>{tree['cause']}" in page and info["answer"] == d["answer"]
    rc, out, err = cli(diagnose.main, [run, "--step", "10"])
    assert rc == 0, err
    assert out.startswith(f"{d['answer']['title']} at step 10: ") and "recorded actions: flagged by the trainer" in out
    assert f"a candidate, never the answer): {tree['cause']}" in out and f"-- {tree['certainty']}" in out


def test_lookup_and_rollback_say_it_was_rolled_back(run):
    rc, out, err = cli(lookup.main, ["--dump-folder", run, "--step", "10"])
    assert rc == 0, err
    assert "rolled back to checkpoint step-8" in out and "batch replaced by an injection (repeat" in out
    assert "stdlib_docs  doc " in out and "c4_test" not in out  # the bundled corpus by its own name
    rc, out, err = cli(rollback.main, ["--dump-folder", run, "--step", "10", "--back", "1", "--skip", "2"])
    assert rc == 0, err
    assert "step 10: already rolled back in process" in out


def test_replay_rerun_of_the_rewound_step_compares_the_rows_as_they_stood(run):
    # no flags after `--`: the rerun reuses the launch the ledger recorded (flags, world size)
    rc, out, err = cli(replay.main, ["rerun", "--dump-folder", run, "--step", "10", "--variant", "same",
                                     "--json"])
    assert rc == 0, err
    rep = json.loads(out)
    (same,) = rep["variants"]
    assert rep["load_step"] == 8 and same["present"] and 10 in same["bit_equal_steps"], same
    assert "rolled back to checkpoint step-8" in rep["done"]
    # flags given anyway are checked against the recorded launch: one line naming the difference
    rc, out, err = cli(replay.main, ["rerun", "--dump-folder", run, "--step", "10", "--variant", "same", "--",
                                     *FLAGS[:3], "13", *FLAGS[4:]])
    assert rc == 2 and "--training.steps 13" in err and "had 14" in err, err
