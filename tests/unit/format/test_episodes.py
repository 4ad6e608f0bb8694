"""titan_ledger.format.answers.episodes: a run's incidents as episodes with one root cause.

A model its LR broke early is one episode from the step its health left the regime, and every
later incident is a symptom -- a conviction of data on it is not believed, a bit flip stays
hardware; incidents close together are one burst, far apart two; a fix proven over the
episode's horizon is the episode's fix, with a command that runs once per flag; the console
raises one alarm per episode. No processes."""

from __future__ import annotations

import shlex

from titan_ledger.format.answers import Answer, Context, Fix, Knobs, episodes, render
from titan_ledger.format.answers.command import once
from titan_ledger.format.answers.episodes import HorizonProof, Live, episode_of
from titan_ledger.format.answers.health import Sign, Span

KNOBS = Knobs(lr=0.05, eps=1e-8, betas=(0.9, 0.95), qk_norm=False, z_loss=0.0)
ARGV = ("--job.config_file", "train_configs/debug_cpu.toml", "--optimizer.lr", "0.05", "--checkpoint.enable",
        "--checkpoint.interval", "5", "--checkpoint.enable", "--checkpoint.interval", "50")
CTX = Context(knobs=KNOBS, dump="/runs/a", argv=ARGV, cwd="/src", python="/venv/bin/python", world_size=2,
              checkpoints=(50, 100, 150, 200, 250, 300))
EPS = Fix("eps", "optimizer_state", ("--optimizer.eps", "1e-6"), "--optimizer.eps 1e-6 (now 1e-8)", "not measured")


def answer(step, cause="", established="none", title="grad-norm jump (the loss unmoved)", fix=None, driver=None):
    return Answer(step=step, kind="spike", title=title, cause=cause, driver=driver, established=established, how="",
                  not_proven=None, separates=None, fixes=(), fix=fix, candidates=(), start=None, command=None,
                  new_dump=None, did="nothing", acting=None, onset=step - 1)


SPAN = Span(3, None, (Sign("loss", 4, 9.6, 8.9, "the loss 9.63 at step 4, above its first steps' 8.06"),
                      Sign("update", 3, 0.005, 0.002, "the param norm moving 0.5% ... (the LR's fingerprint)")))


def test_a_model_broken_early_is_one_episode_and_its_late_symptoms_are_not_bad_data():
    """The issue's held-out run: broken in its first steps, nothing flags for 350 steps, then a
    grad-norm jump on an ordinary document is convicted in step. The episode holds it as a
    symptom (its conviction noted, not believed); a bit flip in the middle stays hardware."""
    got = episodes.episodes([answer(350, "bad_data", "in_step"), answer(120, "hardware", "in_step"), answer(60)],
                            [SPAN], {}, 400, CTX)
    assert [(e.kind, e.onset, e.last, e.incidents) for e in got] == [("broken", 3, 400, (60, 350)),
                                                                    ("hardware", 120, 120, (120,))]
    broken = got[0]
    assert broken.cause == "lr" and broken.established == "health" and broken.fix is None and broken.command is None
    assert broken.candidates[0].change == "--optimizer.lr 0.005 (now 0.05)"  # a candidate: the horizon proof decides
    assert "not believed" in broken.notes[0] and episode_of(got, 350) is broken


def test_incidents_close_together_are_one_burst_far_apart_two_and_a_cause_splits_them():
    got = episodes.episodes([answer(741, "optimizer_state", "in_step", fix=EPS), answer(752), answer(420),
                             answer(790, "lr", "window")], [], {}, 800, CTX)
    assert [(e.onset, e.incidents, e.cause) for e in got] == [(420, (420,), ""), (741, (741, 752), "optimizer_state"),
                                                              (790, (790,), "lr")]
    assert got[1].fix == EPS and got[1].start == "checkpoint step-300" and got[1].command.count("--optimizer.eps") == 1


def test_a_fix_proven_over_the_horizon_is_the_episodes_and_its_command_runs_each_flag_once():
    proof = HorizonProof(onset=3, horizon=(1, 60), start=None, chosen=0, steps=120, control={"final_loss": 6.6},
                         variants=({"variant": "lr", "cause": "lr", "flags": ["--optimizer.lr", "0.005"],
                                    "change": "--optimizer.lr 0.005 (now 0.05)", "effect": "lowered",
                                    "detail": "over steps 1-60: the loss at the end 5.70 against 6.60"},))
    (ep,) = episodes.episodes([], [SPAN], {}, 60, CTX, {3: proof})
    assert (ep.cause, ep.established, ep.fix.change) == ("lr", "horizon", "--optimizer.lr 0.005 (now 0.05)")
    argv = shlex.split(ep.command.split(" && ", 1)[1])
    flags = [a for a in argv[argv.index("--") + 1:] if a.startswith("--")]
    assert len(flags) == len(set(flags)) and argv[argv.index("--optimizer.lr") + 1] == "0.005"
    assert argv[argv.index("--checkpoint.interval") + 1] == "50" and ep.start.startswith("scratch")
    lines = render.episodes_block([ep])
    assert lines[0] == "episodes: 1" and "proven by its fix over the episode's horizon" in lines[1]
    assert "fix: --optimizer.lr 0.005 (now 0.05): lowered" in lines[2] and any("run it (scratch" in x for x in lines)
    assert ep == episodes.Episode.of(ep.to_json())


def test_once_keeps_each_flag_where_it_first_stood_with_its_last_value():
    assert once(["--a", "1", "--b", "--c", "x", "y", "--a=2", "--model.no_qk_norm", "--model.qk_norm", "--c", "z"]) \
        == ["--a", "2", "--b", "--c", "z", "--model.qk_norm"]


def test_the_console_raises_one_alarm_per_episode():
    """The trainer's console (``Live``): a symptom of a broken model and a later flag of the same
    burst are one INFO line each; a new burst, a hardware fault and data convicted on a healthy
    model are alarms."""
    live = Live()
    said = [live.see(answer(s, c, e), b)[0] for s, c, e, b in (
        (10, "", "none", None), (12, "", "none", None), (30, "", "none", None), (200, "", "none", None),
        (205, "hardware", "in_step", None), (300, "", "none", 250), (310, "", "none", 250),
        (320, "bad_data", "in_step", None))]
    assert said == [True, False, False, True, True, False, False, True]


def test_a_change_of_data_is_one_episode_with_nothing_to_fix():
    """A burst of loss flags no rule pinned on a rank or a document, nothing established, where
    the loss's level changed (its median after the onset 3x the median before): one shift
    episode, however many flags; the same burst where the loss came back is a burst."""
    flags = [answer(s, title="loss spike") for s in range(402, 466)]
    events = {s: {"rules": ["zscore_loss"]} for s in range(402, 466)}
    (shift,) = episodes.episodes(flags, [], events, 800, CTX, level=lambda s: 3.06)
    assert (shift.kind, shift.onset, shift.last, len(shift.incidents), shift.fix) == ("shift", 402, 465, 64, None)
    assert render.episode_fix_line(shift).startswith("fix: none needed") and shift.title == "the data changed at step 402"
    (burst,) = episodes.episodes(flags, [], events, 800, CTX, level=lambda s: 1.01)
    assert burst.kind == "burst"
    pinned = {s: {"rules": ["zscore_loss", "rank_separation"]} for s in range(402, 466)}
    assert episodes.episodes(flags, [], pinned, 800, CTX, level=lambda s: 3.06)[0].kind == "burst"


def test_over_the_horizon_a_cause_stands_where_its_own_fix_worked_too_and_the_lrs_cut_drives_it():
    """Adam's state proven in step; over the horizon both ε 1e-6 and the LR's cut removed it, the
    cut ending lower: the cause stays Adam's state, the LR its driver, the cut the fix. Where
    its own fix did not work over the horizon, the fix that did names the cause."""
    def proof(eps_effect):
        return HorizonProof(onset=420, horizon=(341, 470), start=340, chosen=1, steps=390, control={}, variants=(
            {"variant": "eps", "cause": "optimizer_state", "flags": ["--optimizer.eps", "1e-6"],
             "change": "--optimizer.eps 1e-6 (now 1e-8)", "effect": eps_effect, "final_loss": 0.00585},
            {"variant": "lr", "cause": "lr", "flags": ["--optimizer.lr", "0.015"],
             "change": "--optimizer.lr 0.015 (now 0.05)", "effect": "removed", "final_loss": 0.00579}))
    adam = answer(420, "optimizer_state", "in_step", fix=EPS)
    (ep,) = episodes.episodes([adam], [], {}, 800, CTX, {420: proof("removed")})
    assert (ep.cause, ep.driver, ep.fix.variant, ep.established) == ("optimizer_state", "lr", "lr", "horizon")
    assert ep.cause_text.startswith("LR-driven Adam's state")
    (ep,) = episodes.episodes([adam], [], {}, 800, CTX, {420: proof("not removed")})
    assert (ep.cause, ep.driver, ep.fix.variant) == ("lr", None, "lr")


def test_a_burst_nothing_in_the_configuration_removes_is_a_change_of_data():
    """Docstrings, then Russian, at DP 2 (bench/adversarial.py's shift_language, held out): the
    loss 5.7 -> 11.5 at the shift and 3-5 fifty steps on (the new text learned fast: no change of
    level), 8 flags no rule pinned on a rank or a document. Its horizon proof tried the LR's cuts
    and neither removed it: not the configuration -- one shift episode, nothing to fix. A fix that
    worked would have named the configuration instead."""
    flags = [answer(s, title="loss spike") for s in (203, 204, 205, 206, 207, 211, 212, 213)]
    events = {a.step: {"rules": ["zscore_loss", "ratio"]} for a in flags}
    tried = ({"variant": "lr", "cause": "lr", "flags": ["--optimizer.lr", "0.0009"],
              "change": "--optimizer.lr 0.0009 (now 0.003)", "effect": "not removed"},)
    none = HorizonProof(onset=203, horizon=(201, 263), start=200, variants=tried, control={}, chosen=None, steps=63)
    (ep,) = episodes.episodes(flags, [], events, 800, CTX, {203: none}, level=lambda s: 0.91)
    assert ep.kind == "shift" and "not the configuration" in ep.how and ep.fix is None
    worked = HorizonProof(onset=203, horizon=(201, 263), start=200, control={}, chosen=0, steps=63,
                          variants=({**tried[0], "effect": "removed"},))
    (ep,) = episodes.episodes(flags, [], events, 800, CTX, {203: worked}, level=lambda s: 0.91)
    assert ep.kind == "burst" and ep.established == "horizon" and ep.cause == "lr"
