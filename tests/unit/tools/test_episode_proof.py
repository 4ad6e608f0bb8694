"""titan_ledger.tools.episode_proof: what an episode's horizon proof tries and how it judges.

The candidates are the episode's own (what its incidents measured), its cause's horizon fixes
and the LR's cut, each a change to this run, each once; the horizon covers the episode (a
broken model's: the run); a relaunch that removes every incident without ending higher is
"removed", one that only trains lower while the model stays healthy "lowered"; the fix is the
best effect, then the lowest loss. The relaunches themselves run in
tests/e2e/test_episodes_e2e.py. No processes."""

from __future__ import annotations

from titan_ledger.format import records
from titan_ledger.format.answers import Context, Fix, Knobs
from titan_ledger.format.answers.episodes import Episode
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools import episode_proof
from titan_ledger.tools.episode_proof import choose, horizon_of, judge, trials

CTX = Context(knobs=Knobs(lr=0.2, eps=1e-8, betas=(0.9, 0.95), qk_norm=False, z_loss=0.0), dump="/runs/a",
              argv=("--job.config_file", "x.toml"), world_size=1)
ZLOSS = Fix("zloss", "output_logits", ("--loss.z_loss_weight", "0.0001"), "--loss.z_loss_weight 0.0001 (now 0)",
            "removed")


def episode(**kw) -> Episode:
    base = dict(onset=1, last=1000, kind="broken", title="", cause="lr", driver=None, established="health", how="",
                incidents=(25, 31, 350))
    return Episode(**{**base, **kw})


def test_the_candidates_are_the_episodes_own_its_causes_and_the_lrs_each_once():
    got = trials(episode(candidates=(ZLOSS,)), CTX)
    assert [(t.variant, t.flags) for t in got] == [("lr", ("--optimizer.lr", "0.06")), ("lr", ("--optimizer.lr", "0.02")),
                                                   ("zloss", ("--loss.z_loss_weight", "0.0001"))]
    many = trials(episode(candidates=(ZLOSS, *[Fix("eps", "optimizer_state", ("--optimizer.eps", f"1e-{k}"), "", "")
                                                for k in (5, 6, 7)])), CTX)
    assert len(many) == episode_proof.MAX_TRIALS  # each relaunch trains the whole horizon: a bound
    adam = trials(episode(kind="burst", cause="optimizer_state", established="in_step"), CTX)
    assert [t.flags for t in adam] == [("--optimizer.eps", "1e-6"), ("--optimizer.lr", "0.06"),
                                       ("--optimizer.lr", "0.02")]
    assert horizon_of(episode(), 1000) == 1000  # a broken model's: the run
    assert horizon_of(episode(kind="burst", incidents=(25, 31)), 1000) == 31 + episode_proof.MARGIN


def _run(root, name: str, flags: list[int], losses: dict[int, float]):
    led = root / name / "ledger"
    w = records.RecordWriter(led / "signals.jsonl", {"schema": records.SIGNALS.id, "run_id": name, "resumed_from": 0,
                                                     "seq": 1})
    for s in range(1, 101):
        w.write({**{k: None for k in records.SIGNAL_KEYS}, "step": s, "loss": losses.get(s, 6.0), "lr": 1e-3,
                 "grad_norm": 1.0, "skipped": False})
    w.close()
    w = records.RecordWriter(led / records.SPIKES_FILE, {"schema": records.SPIKES.id, "run_id": name, "seq": 1})
    for s in flags:
        w.write({"step": s, "rules": ["grad_jump"], "loss": 6.0, "grad_norm": 9.0})
    w.close()
    return RunLedger(root / name)


def test_a_relaunch_is_judged_by_the_runs_rules_and_its_loss_and_the_best_is_the_fix(tmp_path):
    ep = episode(kind="burst", incidents=(40, 45), last=45, onset=40)
    orig = _run(tmp_path, "orig", [40, 45], {})
    gone = _run(tmp_path, "gone", [], {s: 5.9 for s in range(80, 101)})
    half = _run(tmp_path, "half", [44], {})
    worse = _run(tmp_path, "worse", [], {s: 7.0 for s in range(80, 101)})
    j = {n: judge(ep, orig, r, 1, 100) for n, r in (("gone", gone), ("half", half), ("worse", worse))}
    assert j["gone"]["effect"] == "removed" and j["gone"]["incidents_removed"] == [40, 45]
    assert j["half"]["effect"] == "lowered" and j["half"]["flags_in_horizon"] == 1
    assert j["worse"]["effect"] == "not removed"  # gone, but the run ends higher: no fix
    assert "2 of its 2 incident(s) gone" in j["gone"]["detail"]
    variants = [{"variant": n, **v} for n, v in j.items()]
    assert choose(variants) == 0 and choose([v for v in variants if v["variant"] == "worse"]) is None
    assert choose([{"effect": "lowered", "final_loss": 7.6}, {"effect": "lowered", "final_loss": 7.1}]) == 1
