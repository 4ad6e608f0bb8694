"""Do no harm (issue 60), end to end: the response says what it may change, stays inside
that, and never stops the run it is there to save.

Nine launches, two at a time:

* ``plateau``: the memorisation plateau that stopped a default run at 878e121 -- one text
  (``" the end." * 400``) as 1,500 documents, the tiny model at a constant LR 1e-2, no
  weight decay, QK-norm, read in order -- with every response flag at its default, 440
  steps (20 past the step that stopped it). It must train all 440 (it convicted document
  358 at step 420, masked all of step
  421 and stopped on its NaN), convict no document, and name Adam's state at its spikes;
  ``plateau_off`` (``[ledger.proof] scope = "off"``, 430 steps) is the same run without any response:
  the default policy, ``observe``, trains it bit for bit.
* ``masked``: the same corpus with document 0 quarantined: step 1 holds nothing else, so
  every label of the step is masked -- the step is consumed whole (no update), its rows
  say why, and step 2 trains from the initial weights.
* ``faults_observe`` / ``faults_off`` / ``faults_failed``: the debug model, DP 2, a flipped
  gradient bit at step 6 and a repeated batch at step 10: under ``observe`` the proofs
  convict both (``hardware``, ``bad_data``) and change nothing (bit-equal to ``prove =
  "off"``; every proof says what it would have applied); under ``act`` with every proof
  failing (``--ledger.rehearsal.response_fault proof:raise``) and every host snapshot's
  copy failing (``snapshot:oom``) the run is again bit-equal to no response, the failures
  recorded.
* ``shift_act`` / ``shift_observe`` (issue 68): a distribution shift inside step 42 (docstrings,
  then the same texts in Cyrillic letters) under ``act`` and ``observe``: the new document the
  masks name is new, not bad (the next step's data is as abnormal): nothing acts.
* ``breaker``: ``act`` with two flipped bits two steps apart and a breaker of one action:
  the first proof's recomputed update is applied, the second is held back by the
  breaker (one ERROR line), and acting resumes after a quiet window.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import CONFIGS, data_rows, explain, load_bench, signals_rows, spike_events, torchrun

from titan_ledger.format.signal_columns import TIMING_KEYS

pytestmark = pytest.mark.slow

EASY = [{"text": " the end." * 400}] * 1500
#: issue 68's distribution shift inside a step, made small: the bundled docstrings in order, then the
#: same docstrings spelt in Cyrillic letters (a script the tokenizer splits into bytes: new text),
#: the first new document 206 tokens into step 42 (the tiny model, 1,024 tokens a step)
CYRILLIC = str.maketrans("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                         "абцдефгхийклмнопярстужвьызАБЦДЕФГХИЙКЛМНОПЯРСТУЖВЬЫЗ")
SHIFT_STEP = 42
#: under the shift: a fast LR (the model learns the docstrings by then) and a short spike window
SHIFT = ["--job.config_file", str(CONFIGS / "tiny_cpu.toml"), "--dataloader.source", "indexed",
         "--dataloader.no_shuffle", "--training.steps", "44", "--ledger.spike.window", "16", "--optimizer.lr", "1e-2",
         "--lr_scheduler.warmup_steps", "5", "--metrics.log_freq", "100"]


def shift_documents() -> list[dict]:
    """The docstrings until the stream reaches 206 tokens into step ``SHIFT_STEP``, then
    Cyrillic-spelt docstrings cut to 500 characters (documents shorter than a step: the next
    step holds other new documents, the control of the same novelty)."""
    from helpers import ROOT

    from titan_ledger.data.prepare import load_tokenizer

    tok = load_tokenizer(str(ROOT / "titan_ledger" / "assets" / "tokenizer"))
    text = [json.loads(x)["text"] for x in (ROOT / "titan_ledger" / "assets" / "corpus" / "data.jsonl").read_text()
            .splitlines() if x.strip()]
    docs, seen, i = [], 0, 0
    while seen < (SHIFT_STEP - 3) * 1024 + 300:
        docs.append({"text": text[i % len(text)]})
        seen += len(tok.encode(text[i % len(text)], add_bos=True, add_eos=True)) - 1
        i += 1
    return docs + [{"text": text[(i + j) % len(text)].translate(CYRILLIC)[:500]} for j in range(200)]
PLATEAU = ["--job.config_file", str(CONFIGS / "tiny_cpu.toml"), "--dataloader.source", "indexed",
           "--dataloader.no_shuffle", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "20",
           "--lr_scheduler.min_lr_factor", "1.0", "--optimizer.weight_decay", "0", "--model.qk_norm",
           "--metrics.log_freq", "100"]
#: the default run stopped on a NaN at step 421 (878e121); the 360 steps more it once trained (Adam's state
#: flagged again at 633 and 638) asked the same question again for 2-3 minutes of CI
PLATEAU_STEPS = 440
#: the plateau run checkpoints as a real run does: its fix relaunches from the last checkpoint before the
#: incident (trains ~30 steps to pass it), not from scratch (430 steps: a minute of CI)
PLATEAU_CKPT = ["--checkpoint.enable", "--checkpoint.interval", "400"]
DEBUG = ["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "12",
         "--training.local_batch_size", "2", "--training.seq_len", "128", "--ledger.spike.window", "8",
         "--ledger.rehearsal.inject", "6:0:bitflip,10:1:repeat"]
TIMING = TIMING_KEYS  # the table's wall-clock columns


def response_events(dump):
    from titan_ledger.format.reader import RunLedger

    return RunLedger(dump).response_events()


def proofs_of(dump) -> dict[int, dict]:
    """Every proof of the run -- spikes', notes' and forced ones' -- by step."""
    from titan_ledger.format.records import read_ledger

    return {e["step"]: e["proof"] for e in read_ledger(dump / "ledger" / "spikes.jsonl").history if "proof" in e}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("no_harm")
    prefix = load_bench("zoo").prepare_documents(root / "corpus", EASY, "easy")
    shift = load_bench("zoo").prepare_documents(root / "shift", shift_documents(), "shift")
    quarantine = root / "doc0.jsonl"
    quarantine.write_text(json.dumps({"source": "easy", "doc": 0}) + "\n")
    plateau = [*PLATEAU, "--dataloader.paths", str(prefix)]
    specs = {
        "plateau": ([*plateau, "--training.steps", str(PLATEAU_STEPS), *PLATEAU_CKPT], 1),
        "plateau_off": ([*plateau, "--training.steps", "430", "--ledger.proof.scope", "off"], 1),
        "masked": ([*plateau, "--training.steps", "4", "--ledger.filter.quarantine", str(quarantine)], 1),
        "faults_observe": (DEBUG, 2),
        "faults_off": ([*DEBUG, "--ledger.proof.scope", "off"], 2),
        "faults_failed": ([*DEBUG, "--ledger.response.policy", "act", "--ledger.rehearsal.response_fault",
                           "proof:raise,snapshot:oom", "--ledger.snapshots.every", "4"], 2),
        "shift_act": ([*SHIFT, "--dataloader.paths", str(shift), "--ledger.response.policy", "act"], 1),
        "shift_observe": ([*SHIFT, "--dataloader.paths", str(shift)], 1),
        "breaker": (["--job.config_file", str(CONFIGS / "debug_cpu.toml"), "--training.steps", "12",
                     "--training.local_batch_size", "2", "--training.seq_len", "128", "--ledger.spike.window", "8",
                     "--ledger.rehearsal.inject", "6:0:bitflip,8:1:bitflip", "--ledger.response.policy", "act",
                     "--ledger.breaker.actions", "1", "--ledger.breaker.window", "3"], 2),
    }

    def one(name):
        args, nproc = specs[name]
        d = root / name
        p = torchrun([*args, "--job.dump_folder", str(d)], nproc=nproc, timeout=900)
        (root / f"{name}.log").write_text(p.stdout + p.stderr)  # (kept: a failure's evidence)
        return name, d, p

    with ThreadPoolExecutor(2) as pool:  # the two long plateau runs first, side by side
        done = list(pool.map(one, specs))
    for name, _, p in done:
        assert p.returncode == 0, (name, explain(p))
    return {name: (d, p.stdout + p.stderr) for name, d, p in done}


def _same_rows(a, b, steps):
    """Every signals row of ``steps`` equal but for the host timings (NaN equal to NaN: a
    flipped bit's step has a non-finite grad norm)."""
    ra, rb = signals_rows(a), signals_rows(b)
    for s in steps:
        assert json.dumps({k: v for k, v in ra[s].items() if k not in TIMING}, sort_keys=True) == \
            json.dumps({k: v for k, v in rb[s].items() if k not in TIMING}, sort_keys=True), s


def test_the_plateau_with_the_defaults_trains_every_step_convicts_nothing_and_names_adams_state(runs):
    d, out = runs["plateau"]
    rows = signals_rows(d)
    assert sorted(rows) == list(range(1, PLATEAU_STEPS + 1)) and not any(r["update_skipped"] for r in rows.values())
    assert "Stopping training" not in out and not (d / "ledger" / "proven_documents.jsonl").exists()
    proofs = proofs_of(d)
    verdicts = {p["verdict"] for p in proofs.values()}
    assert "bad_data" not in verdicts and all(p["applied"] == "original" for p in proofs.values()), verdicts
    # the flag at 420 (where document 358 was convicted at 878e121; 421 on some CPUs: the plateau's
    # float sums differ by machine): Adam's second moment, hundreds of times below its long-run
    # level, inflated the updates that led there
    (t,) = [s for s in range(415, 426) if s in proofs and s in {e["step"] for e in spike_events(d) if e.get("rules")}]
    p420 = proofs[t]
    assert p420["verdict"] == "optimizer_state" and p420["optimizer"]["amplification"] >= 4, p420
    assert p420["optimizer"]["restore"] > 100
    assert f"loss spike at step {t}: Adam's state (its second moment lagging the gradients) -- proven in step" in out
    # the dips (the loss under its recent median, the grad norm up) are notes (dip_note), proven, not incidents
    assert not any(e.get("rules") and e["loss"] < 0.9 * e["loss_recent"] for e in spike_events(d))


#: a probe the page does not carry (it has no script): where the answer box, its cause and its
#: command lie in a 1280 x 900 window
ANSWER_PROBE = """<script>addEventListener('load', () => {
  const box = document.querySelector('.answer'), r = e => e ? e.getBoundingClientRect().bottom : null;
  const pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify({box: r(box), cause: r(box && box.querySelector('.cause')),
                                    command: r(box && box.querySelector('pre')), inner: innerHeight});
  document.body.appendChild(pre); });</script>"""


def test_the_plateaus_first_answer_is_one_cause_and_its_printed_fix_trains_past_the_spike(runs, tmp_path):
    """Issue 67: the plateau's first ``optimizer_state`` incident has one answer (the console,
    diagnose and the page render it); its fix changes this run (``--optimizer.eps 1e-6``, now
    1e-8), no quarantine is offered, and its printed command -- run as printed, in a shell,
    with only the horizon shortened -- relaunches into a new folder from the run's last
    checkpoint before the incident (step 400, loaded whole) and trains past the step
    without the spike; the page's first 1280 x 900 pixels hold the cause and the command."""
    import re
    import subprocess

    from helpers import child_env, chromium_dom, headless_chromium

    from titan_ledger.format.answers import Answer, of_run, render
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools import diagnose
    from titan_ledger.tools.report import report

    d, out = runs["plateau"]
    led = RunLedger(d)
    first = min(s for s, a in of_run.recorded(led).items() if a["cause"] == "optimizer_state")
    a = Answer.of(of_run.recorded(led)[first])
    assert a.established.startswith("in_step") and a.cause_text.startswith("Adam's state")
    fix = a.fix or a.candidates[0]
    assert fix.flags == ("--optimizer.eps", "1e-6") and "(now 1e-8)" in fix.change  # not the run's own value
    assert not a.quarantine and not a.documents and a.command and a.start == "checkpoint step-400", a.start
    assert "\n".join(render.lines(a)) in out  # the console said these three lines
    res = diagnose.judge(led, first)
    assert res["answer"] == a.to_json() and not diagnose.offers_documents(res)
    # the command as printed, shortened to 12 steps past the incident
    new = Path(a.new_dump)
    assert not new.exists() and new.parent == d.parent and new != d
    p = subprocess.run(f"{a.command} --training.steps {first + 12}", shell=True, cwd="/", env=child_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, explain(p)
    fixed = signals_rows(new)
    assert sorted(fixed) == list(range(401, first + 13))  # from the checkpoint: optimizer, data position, step
    flagged = {e["step"] for e in spike_events(new) if e.get("rules")}
    assert not flagged & set(range(first - 10, first + 13)), flagged  # the incident did not recur
    assert not (d / "ledger" / "proven_documents.jsonl").exists() and sorted(signals_rows(d)) == list(range(1, PLATEAU_STEPS + 1))
    # the page leads with the answer: above the fold at 1280 x 900
    page = tmp_path / "incident.html"
    report(d, first, page)
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", ANSWER_PROBE + "</body>"))
    headless_chromium(tmp_path / "profile")  # (skips without chromium; fails in CI)
    dom = chromium_dom(probe, tmp_path / "profile", size="1280,900")
    at = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1))
    # (a 1280 x 900 headless window shows about 760 px of page: the browser's own bars take the rest)
    assert at["inner"] >= 700 and at["cause"] < at["inner"] and at["command"] is not None, at
    assert at["box"] <= at["inner"], at  # the whole answer box, its command included, above the fold
    assert "None" not in re.sub(r"<[^>]+>", " ", dom.split("<h2>", 1)[0])  # no None cell above the sections


def test_a_shift_inside_a_step_convicts_nothing_under_act_and_trains_as_observe(runs):
    """Issue 68: the step that holds the end of the docstrings and the first new-script
    document is flagged, and its masks name the new document (before issue 68 it was
    convicted, masked and quarantined); the control of the same novelty -- the next step's
    data, the new document masked, on the same weights -- is abnormal too: new data, not bad
    data. Under ``act`` nothing acts, and the run equals ``observe``'s bit for bit."""
    d, out = runs["shift_act"]
    obs, _ = runs["shift_observe"]
    events = {e["step"]: e for e in spike_events(d)}
    p = events[SHIFT_STEP]["proof"]
    assert p["verdict"] == "not_data" and "new data, not bad data" in p["why"], p["why"]
    novelty = p["content"]["novelty"]
    assert novelty["available"] and novelty["step"] == SHIFT_STEP + 1 and not novelty["normal"]
    assert all(e["proof"]["applied"] == "original" for e in events.values() if e.get("proof"))
    assert not (d / "ledger" / "proven_documents.jsonl").exists()
    rows = signals_rows(d)
    assert sorted(rows) == list(range(1, 45)) and not any(r["update_skipped"] or r["masked_tokens"] for r in rows.values())
    _same_rows(d, obs, range(1, 45))
    assert data_rows(d, 0) == data_rows(obs, 0)


def test_observe_trains_the_plateau_bit_for_bit_as_no_response_does(runs):
    d, _ = runs["plateau"]
    off, _ = runs["plateau_off"]
    _same_rows(d, off, range(1, 431))
    assert [data_rows(d, 0)[s] for s in range(1, 431)] == [data_rows(off, 0)[s] for s in range(1, 431)]


def test_a_step_whose_every_label_is_masked_is_consumed_whole_not_trained_into_a_nan(runs):
    d, out = runs["masked"]
    ref, _ = runs["plateau_off"]
    rows, first = signals_rows(d), signals_rows(ref)
    assert rows[1]["skipped"] is True and rows[1]["loss"] is None and rows[1]["consumed_samples"] == 8
    # no update at step 1: step 2 starts from the initial weights, and trains
    assert rows[2]["param_norm"] == first[1]["param_norm"] and rows[2]["masked_tokens"] > 0
    assert all(rows[s]["loss"] is not None and rows[s]["loss"] == rows[s]["loss"] for s in (2, 3, 4))
    data = data_rows(d, 0)[1]
    assert data["skipped"] and data["why"] == "no_tokens" and data["masked"]["quarantine"], data
    assert response_events(d) == [{"step": 1, "no_tokens": True, "masked": ["quarantine"]}]
    assert "every label token of the step is masked (quarantine)" in out


def test_observe_convicts_and_records_what_it_would_do_and_changes_nothing(runs):
    d, out = runs["faults_observe"]
    off, _ = runs["faults_off"]
    _same_rows(d, off, range(1, 13))
    for r in (0, 1):
        assert data_rows(d, r) == data_rows(off, r)
    proofs = {e["step"]: e["proof"] for e in spike_events(d) if "proof" in e and e.get("rules")}
    assert (proofs[6]["verdict"], proofs[6]["would_apply"], proofs[6]["applied"]) == ("hardware", "same", "original")
    assert (proofs[10]["verdict"], proofs[10]["would_apply"]) == ("bad_data", "masked"), proofs[10]
    assert all(p["held_back"] == "observe" and p["policy"] == "observe" for p in proofs.values())
    assert not (d / "ledger" / "proven_documents.jsonl").exists()
    assert "held back by --ledger.response.policy observe); acting would have trained without the convicted data and " \
           "quarantined it" in out
    assert "held back by --ledger.response.policy observe); acting would have applied the recomputed update" in out


def test_failures_inside_the_response_never_stop_training_nor_change_it(runs):
    d, out = runs["faults_failed"]
    off, _ = runs["faults_off"]
    _same_rows(d, off, range(1, 13))
    events = spike_events(d)
    failed = {e["step"]: e["proof_failed"] for e in events if "proof_failed" in e}
    assert failed and all(f["where"] == "proof" and "response_fault proof:raise" in f["error"]
                          for f in failed.values()), failed
    assert 6 in failed and 10 in failed
    snaps = [e for e in response_events(d) if (e.get("response_failure") or {}).get("where") == "snapshot"]
    assert snaps and "MemoryError" in snaps[0]["response_failure"]["error"]
    assert "the proof failed" in out and "training goes on without it" in out


def test_the_breaker_pauses_acting_past_its_limit_and_records_when_it_resumed(runs):
    d, out = runs["breaker"]
    events = spike_events(d)
    proofs = {e["step"]: e["proof"] for e in events if "proof" in e and e.get("rules")}
    assert proofs[6]["verdict"] == "hardware" and proofs[6]["applied"] == "same"  # the first action: taken
    assert (proofs[8]["verdict"], proofs[8]["held_back"], proofs[8]["applied"]) == ("hardware", "breaker", "original")
    breaker = [e for e in response_events(d) if "breaker" in e]
    # paused at the second action; its window (3 steps after the last action, 6) has passed by the
    # first step that starts after the pause (9 in the step; 10 when step 8 was decided during 9)
    assert [(e["step"], e["breaker"]) for e in breaker][0] == (8, "paused"), breaker
    resumed = [e["step"] for e in breaker if e["breaker"] == "resumed"]
    assert len(breaker) == 2 and resumed and resumed[0] in (9, 10), breaker
    assert "the response is thrashing: 1 actions in 3 steps" in out and " - ERROR - " in out
    assert f"acting resumed at step {resumed[0]}" in out
