"""The run's answer end to end (issue 77): the README's first command at an LR that breaks the
model in its first steps, and no spike rule fires.

One real run (debug_cpu, DP 2, 12 steps, ``--optimizer.lr 0.05``): the trainer warns once that
the model left its healthy regime (dated step 3: the loss above its first steps', the weights
moving 0.5% a step), and every view leads with that episode; ``diagnose RUN --rerun`` states
its budget, relaunches the candidate fixes as their commands would (from scratch: no
checkpoint before the onset) over the run's horizon, records what it measured, and names the
LR with the value measured (``titan_ledger.tools.episode_proof``); that command, run as
printed, trains to a lower loss with a healthy model; the run page
(``titan_ledger.tools.run_page``) shows the episode's cause and command above the fold."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import CONFIGS, child_env, chromium_dom, cli, explain, headless_chromium, signals_rows, torchrun

from titan_ledger.format.answers import health
from titan_ledger.format.reader import RunLedger

pytestmark = pytest.mark.slow

STEPS = 12
FLAGS = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.local_batch_size", "2",
         "--training.seq_len", "128", "--optimizer.lr", "0.05", "--training.steps", str(STEPS)]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    d = tmp_path_factory.mktemp("episodes") / "lr005"
    p = torchrun([*FLAGS, "--job.dump_folder", str(d)])
    assert p.returncode == 0, explain(p)
    return d, p.stdout + p.stderr


def test_the_trainer_warns_once_the_model_left_its_healthy_regime_and_the_views_lead_with_it(broken, tmp_path):
    from titan_ledger.tools import diagnose, export

    d, out = broken
    warned = [x for x in out.splitlines() if "titan_ledger: the model left its healthy regime" in x]
    assert len(warned) == 1 and "at step 3:" in warned[0] and "the loss" in warned[0], warned
    assert not any("loss spike" in x and "WARNING" in x for x in out.splitlines())  # no spike rule fired
    rc, text, _ = cli(diagnose.main, [d])
    assert rc == 0 and text.startswith(f"episodes: 1\nepisode 1, steps 3-{STEPS}: the model left its healthy regime "
                                       "at step 3 (no spike rule fired): the learning rate"), text[:400]
    assert "--optimizer.lr 0.005 (now 0.05)" in text and "diagnose RUN --rerun proves them" in text
    rc, js, _ = cli(diagnose.main, [d, "--json"])
    (ep,) = json.loads(js)["episodes"]
    assert {k: ep[k] for k in ("onset", "last", "cause", "established", "incidents", "command")} == {
        "onset": 3, "last": STEPS, "cause": "lr", "established": "health", "incidents": [], "command": None}
    rc, _, _ = cli(export.main, [d, "-o", tmp_path / "x"])
    import pyarrow.parquet as pq

    assert rc == 0 and pq.read_table(tmp_path / "x" / "episodes.parquet").to_pylist()[0]["onset"] == 3


def test_diagnose_rerun_proves_the_lr_over_the_horizon_and_its_command_trains_lower_as_printed(broken, tmp_path):
    from titan_ledger.tools import diagnose, report

    d, _ = broken
    rc, text, _ = cli(diagnose.main, [d, "--rerun"])
    assert rc == 0, text
    budget = next(x for x in text.splitlines() if "proving" in x)
    assert f"to step {STEPS}" in budget and f"= {2 * STEPS} training steps" in budget, budget  # said first
    assert text.index(budget) < text.index("--optimizer.lr 0.005 (now 0.05): ")
    rows = [json.loads(x) for x in (d / "ledger" / "episodes.jsonl").read_text().splitlines()[1:]]
    assert rows[-1]["horizon"] == [1, STEPS]
    tried = {tuple(v["flags"]): v for v in rows[-1]["variants"]}
    assert set(tried) == {("--optimizer.lr", "0.015"), ("--optimizer.lr", "0.005")}  # x0.3, x0.1
    best = min((v for v in tried.values() if v["effect"] in ("removed", "lowered")), key=lambda v: v["final_loss"])
    assert rows[-1]["variants"][rows[-1]["chosen"]] == best
    head = text.split("\nepisode 1, ", 1)[1].splitlines()
    assert head[0].endswith("the learning rate -- proven by its fix over the episode's horizon"), head
    assert head[1].startswith(f"  fix: {best['change']}: lowered"), head  # the value measured, the best loss
    command = next(x for x in head if x.startswith("  run it (scratch")).split("): ", 1)[1]
    argv = shlex.split(command.split(" && ", 1)[1])
    flags = [a for a in argv[argv.index("--") + 1:] if a.startswith("--")]
    assert len(flags) == len(set(flags)) and argv[argv.index("--optimizer.lr") + 1] == best["flags"][1]  # once
    # proven once: a second --rerun relaunches nothing
    rc, again, _ = cli(diagnose.main, [d, "--rerun"])
    assert rc == 0 and "proving" not in again and "proven by its fix over the episode's horizon" in again
    # the command as printed
    new = Path(argv[argv.index("--job.dump_folder") + 1])
    p = subprocess.run(command, shell=True, cwd="/", env=child_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, explain(p)
    fixed, orig = signals_rows(new), signals_rows(d)
    tail = lambda rows: sum(rows[s]["loss"] for s in range(STEPS - 4, STEPS + 1)) / 5  # noqa: E731
    assert sorted(fixed) == list(range(1, STEPS + 1)) and tail(fixed) < 0.95 * tail(orig)
    assert health.read(RunLedger(new).trained_rows()) == []  # the fixed run stays healthy
    # the run's page: the episode's cause and command above the fold at 1280 x 900
    page = tmp_path / "run.html"
    rc, _, _ = cli(report.main, [d, "-o", page])
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    headless_chromium(tmp_path / "profile")  # (skips without chromium; fails in CI)
    dom = chromium_dom(probe, tmp_path / "profile", size="1280,900")
    at = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1))
    assert rc == 0 and at["inner"] >= 700 and at["cause"] < at["inner"] and at["command"] <= at["inner"], at
    assert "the learning rate" in dom and "--optimizer.lr 0.005" in dom


PROBE = """<script>addEventListener('load', () => {
  const box = document.querySelector('.ep'), r = e => e ? e.getBoundingClientRect().bottom : null;
  const pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify({box: r(box), cause: r(box && box.querySelector('.cause')),
                                    command: r(box && box.querySelector('pre')), inner: innerHeight});
  document.body.appendChild(pre); });</script>"""
