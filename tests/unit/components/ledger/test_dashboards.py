"""dashboards and dashboard_writers: W&B steps stay strictly increasing through a rewind and a relaunch,
torchtitan's duplicate series are dropped, spikes alert and fill a table, a stop
ends the run with exit code 1; TensorBoard gets its layout and a sub-run per rewind.
W&B itself is replaced by a recording fake (the e2e test reads a real offline run)."""

from __future__ import annotations

import re
import types

import pytest

from titan_ledger.components.ledger import dashboards
from titan_ledger.components.ledger.dashboard_writers import TB_LAYOUT, LedgerTensorBoard, LedgerWandB
from titan_ledger.components.ledger.dashboards import log_rewind, log_spike, log_stop


class FakeRun:
    def __init__(self, run_id="tlabc", step=0, folder="."):
        self.id, self.step, self.dir = run_id, step, str(folder)
        self.summary, self.alerts, self.metrics, self.saved = {}, [], [], []
        self.config = types.SimpleNamespace(update=lambda d, allow_val_change=False: self.config_items.update(d))
        self.config_items = {}

    def alert(self, title, text, level=None, wait_duration=None):
        self.alerts.append((level, title, text))

    def define_metric(self, name, step_metric=None, summary=None, **kw):
        self.metrics.append((name, step_metric, summary))

    def save(self, path, base_path=None, policy="live"):
        self.saved.append(path)


class FakeWandb:
    def __init__(self, run):
        self.run, self.rows, self.exit_code = run, [], None

    def log(self, row, step):
        assert not self.rows or step >= self.rows[-1][0], "W&B would drop this row"
        self.rows.append((step, dict(row)))

    def Table(self, columns, data):
        return ("table", tuple(columns), [tuple(r) for r in data])

    def finish(self, exit_code=None):
        self.exit_code = exit_code
        self.run = None


def _wandb(tmp_path, run=None):
    run = run or FakeRun(folder=tmp_path)
    fake = FakeWandb(run)
    inner = types.SimpleNamespace(wandb=fake, tag=None)
    return LedgerWandB(inner, state_file=tmp_path / "wandb.json", ledger_on=True, max_norm=1.0), fake


def _container(*loggers):
    return types.SimpleNamespace(_loggers=list(loggers),
                                 log=lambda m, s: [x.log(m, s) for x in loggers])


ROW = {"step": 10, "loss": 7.5, "loss_max": 7.7, "loss_max_rank": 1, "grad_norm": 9.7, "max_logit": 1.0}
EV = {"rules": ["zscore_grad_norm"], "grad_norm_median": 0.6, "action": "rollback"}


def test_steps_increase_through_rewind_and_relaunch(tmp_path):
    w, fake = _wandb(tmp_path)
    for s in range(1, 11):
        w.log({"ledger/loss": 8.0 - s / 10, "ledger/grad_norm": 1.0, "ledger/consumed_tokens": 100 * s}, s)
        w.log({"loss_metrics/global_avg_loss": 1.0, "grad_norm": 1.0, "lr/AdamW": 1e-3, "tflops": 2.0}, s)
    log_spike(_container(w), ROW, EV)
    log_rewind(_container(w), from_step=10, to_step=8, window=(9, 10))
    w.log({"ledger/skipped": 1.0}, 9)  # the skip row after the rewind: training step goes back
    w.log({"ledger/loss": 7.0}, 11)
    steps = [s for s, _ in fake.rows]
    assert steps == sorted(steps) and steps[-1] == 11  # 10 steps, the skip row, step 11
    by_train = [(r.get("train/step"), s) for s, r in fake.rows]
    assert (9, 10) in by_train and (10, 9) in by_train  # step 9 re-logged above step 10's W&B step
    rewind = next(r for _, r in fake.rows if "rollback/to_step" in r)
    assert rewind["train/step"] == 10 and rewind["rollback/to_step"] == 8 and rewind["rollback/skip_last"] == 10
    # no duplicates of the ledger's series; the ledger's carry train/ axes and max_norm
    keys = set().union(*(r for _, r in fake.rows))
    assert not keys & {"loss_metrics/global_avg_loss", "grad_norm", "lr/AdamW"} and "tflops" in keys
    first = fake.rows[0][1]
    assert first["train/consumed_tokens"] == 100 and first["ledger/max_norm"] == 1.0
    # a relaunch (same run id, W&B offline: run.step starts at 0 again) continues above
    w2, fake2 = _wandb(tmp_path)
    w2.log({"ledger/loss": 7.1}, 9)
    assert fake2.rows[0][0] == steps[-1] + 1 and w2.spikes == 1 and w2.rewinds == 1


def test_spike_alert_table_and_stop_exit_code(tmp_path):
    w, fake = _wandb(tmp_path)
    c = _container(w)
    w.log({"ledger/loss": 7.0}, 10)
    log_spike(c, ROW, EV)
    row = fake.rows[-1][1]
    assert row["spike/events"][0] == "table" and row["spike/events"][2][0][:2] == (10, "zscore_grad_norm")
    assert any(r.get("spike/flag") == 1.0 and r.get("spike/zscore_grad_norm") == 1.0 for _, r in fake.rows)
    assert fake.run.alerts[0][:2] == ("WARN", "loss spike at step 10")
    run = fake.run
    log_stop(c, RuntimeError("titan_ledger: loss is not finite (nan) at step 11"))
    w.close()
    assert fake.exit_code == 1 and run.alerts[-1][0] == "ERROR" and "not finite" in run.summary["stop/reason"]
    w.close()  # once only
    (tmp_path / "x").mkdir()
    ok, fake_ok = _wandb(tmp_path / "x")
    ok.close()
    assert fake_ok.exit_code == 0


def test_stable_run_id_and_identity(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)
    for var in ("WANDB_RUN_NAME", "WANDB_RUN_NOTES", "WANDB_RUN_TAGS", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(var, raising=False)
    config = types.SimpleNamespace(dump_folder=str(tmp_path / "run7"), metrics=types.SimpleNamespace(enable_wandb=True),
                                   ledger=types.SimpleNamespace(folder="ledger"))
    job = types.SimpleNamespace(doc={"job": {"name": "n1", "tags": ["a", "b"], "notes": "why"}},
                                description="desc", config_file=None, overlays=[], config="debug_cpu",
                                module="titan_ledger")
    dashboards.prepare(config, job, is_metrics_rank=True)
    first = dashboards.os.environ["WANDB_RUN_ID"]
    assert dashboards.os.environ["WANDB_RESUME"] == "allow"
    monkeypatch.delenv("WANDB_RUN_ID")
    dashboards.prepare(config, job, is_metrics_rank=True)
    assert dashboards.os.environ["WANDB_RUN_ID"] == first  # a relaunch continues the same run
    ident = dashboards.run_identity(config, env={})
    assert ident["name"] == "n1" and ident["notes"] == "why" and ident["tags"][:3] == ["a", "b", "debug_cpu"]
    ident = dashboards.run_identity(config, env={"WANDB_RUN_NAME": "env", "WANDB_RUN_TAGS": "x,y"})
    assert ident["name"] == "env" and ident["tags"][:2] == ["x", "y"]
    job.doc = {}
    dashboards.prepare(config, job, is_metrics_rank=False)
    assert dashboards.run_identity(config, env={})["name"] == "run7"


def test_tensorboard_layout_config_text_and_rewind_subrun(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from torch.utils.tensorboard import SummaryWriter

    inner = types.SimpleNamespace(writer=SummaryWriter(str(tmp_path)), tag=None)
    t = LedgerTensorBoard(inner, log_dir=str(tmp_path), ledger_on=True, max_norm=1.0)
    t.setup({"config/toml": "    [training]\n    steps = 10"})
    for s in range(1, 11):
        t.log({"ledger/grad_norm": 0.5, "grad_norm": 0.5, "loss_metrics/global_avg_loss": 1.0}, s)
    t.rewind(from_step=10, to_step=8, window=(9, 10))
    t.log({"ledger/grad_norm": 0.4}, 11)
    t.close()
    ea = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("ledger/grad_norm")] == list(range(1, 11))  # nothing purged
    assert "grad_norm" not in ea.Tags()["scalars"] and "ledger/max_norm" in ea.Tags()["scalars"]
    assert "config/toml/text_summary" in ea.Tags()["tensors"]
    # the custom-scalars layout, written once: every chart of TB_LAYOUT, with its tags
    (config,) = ea.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    charts = {(c.title, ch.title): list(ch.multiline.tag) for c in layout.category for ch in c.chart}
    assert charts == {(cat, title): tags for cat, chs in TB_LAYOUT.items()
                      for title, (_kind, tags) in chs.items()}
    # ... and its charts draw the series this logger writes (the tags are regexes)
    written = ea.Tags()["scalars"]

    def drawn(title):
        return sorted(t for t in written if any(re.search(r, t) for r in charts[("titan_ledger", title)]))

    assert drawn("grad norm (pre-clip, post-clip, max_norm)") == ["ledger/grad_norm", "ledger/max_norm"]
    assert drawn("spikes and rollbacks") == ["rollback/to_step"]
    sub = EventAccumulator(str(tmp_path / "rewind-1"))
    sub.Reload()
    assert [e.step for e in sub.Scalars("ledger/grad_norm")] == [11]


def test_proof_and_answer_on_every_view(tmp_path):
    """A spike's proof fills the ``proof/*`` scalars (what it measured) and its answer
    (``format.answers``: the one cause, the fix) the ``answer/*`` scalars, the W&B table's
    answer columns and the alert; no view derives a cause from the proof; a note's proof
    logs its scalars too."""
    from titan_ledger.format import answers
    from titan_ledger.format.answers import render
    from titan_ledger.format.proofs import ProofRecord

    proof = {"verdict": "bad_data", "applied": "original", "would_apply": "quarantine",
             "held_back": "observe", "executions": [{}, {}, {}], "seconds": 2.5,
             "optimizer": {"amplification": 1.3}, "window": {"cause": "adam"}, "documents": [["c", 7]]}
    s = dashboards.proof_scalars(proof)
    assert s["proof/bad_data"] == 1.0 and s["proof/not_data"] == 0.0 and s["proof/executions"] == 2.0
    assert s["proof/acted"] == 0.0 and s["proof/held_back"] == 1.0 and s["proof/adam_amplification"] == 1.3
    assert s["proof/seconds"] == 2.5 and not any(k.startswith("proof/cause") for k in s)
    acted = dashboards.proof_scalars({**proof, "applied": "quarantine", "held_back": None})
    assert acted["proof/acted"] == 1.0 and acted["proof/held_back"] == 0.0
    assert dashboards.proof_scalars(None) == {}
    answer = answers.build(10, "spike", {**EV, **ROW}, ProofRecord.of(proof), answers.Context())
    ev = {**EV, "proof": proof, "answer": answer.to_json()}
    assert dashboards.answer_scalars(ev) == {"answer/established_in_step": 1.0, "answer/fix_measured": 0.0,
                                             "answer/cause_bad_data": 1.0}
    w, fake = _wandb(tmp_path)
    c = _container(w)
    w.log({"ledger/loss": 7.0}, 10)
    log_spike(c, ROW, ev)
    table = next(r["spike/events"] for _, r in fake.rows if "spike/events" in r)
    cols, data = table[1], table[2][0]
    got = dict(zip(cols, data))
    assert got["proof_verdict"] == "bad_data" and got["answer_cause"] == "bad data"
    assert got["answer_established"] == "in_step" and got["answer"].startswith(render.lines(answer)[0])
    assert any(r.get("proof/bad_data") == 1.0 and r.get("spike/flag") == 1.0 and r.get("answer/cause_bad_data")
               for _, r in fake.rows)
    level, title, text = fake.run.alerts[-1]
    assert title == render.headline(answer) and text.startswith("\n".join(render.lines(answer)))
    dashboards.log_note(c, {**ROW, "step": 11}, {"notes": ["zscore_loss"], "proof": {**proof, "verdict": "outlier"}})
    note = next(r for _, r in fake.rows if r.get("note/flag") == 1.0)
    assert note["proof/outlier"] == 1.0 and note["note/zscore_loss"] == 1.0


def test_the_responses_own_alert_reaches_every_dashboard(tmp_path):
    """``dashboards.alert`` (the circuit breaker's pause, a stall) asks each writer: W&B
    raises an alert; TensorBoard has none, so it writes the text at its last step."""
    w, fake = _wandb(tmp_path)
    texts = []
    writer = types.SimpleNamespace(add_text=lambda tag, text, step: texts.append((tag, text, step)))
    t = LedgerTensorBoard(types.SimpleNamespace(writer=writer, tag=None), log_dir=str(tmp_path), ledger_on=True)
    t.last_step = 7
    dashboards.alert(_container(w, t), "paused", "the response is thrashing")
    assert fake.run.alerts == [("ERROR", "paused", "the response is thrashing")]
    assert texts == [("response/events", "the response is thrashing", 7)]
    dashboards.alert(types.SimpleNamespace(), "paused", "no dashboards on this rank")  # a no-op


def test_the_runs_episodes_reach_the_wandb_summary_and_table_and_tensorboard_text(tmp_path):
    """Issue 77: at the run's end its episodes (the same words every view prints) are in W&B's
    run summary and an ``episodes/table``, and in TensorBoard's ``episodes`` text."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from titan_ledger.format.answers import render
    from titan_ledger.format.answers.episodes import Episode

    ep = Episode(onset=3, last=60, kind="broken", title="the model left its healthy regime at step 3", cause="lr",
                 driver=None, established="health", how="", incidents=(25, 31))
    w, fake = _wandb(tmp_path)
    w.log({"ledger/loss": 7.0}, 60)
    inner = types.SimpleNamespace(writer=SummaryWriter(str(tmp_path / "tb")), tag=None)
    t = LedgerTensorBoard(inner, log_dir=str(tmp_path / "tb"), ledger_on=True, max_norm=1.0)
    t.log({"ledger/loss": 7.0}, 60)
    dashboards.log_episodes(_container(w, t), [ep])
    t.close()
    assert fake.run.summary["episodes/count"] == 1
    assert fake.run.summary["episodes/text"] == "\n".join(render.episodes_block([ep], detail=False))
    table = fake.rows[-1][1]["episodes/table"]
    assert table[1] == tuple(render.EPISODE_COLUMNS) and table[2][0][:3] == (3, 60, "broken")
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    ea.Reload()
    (text,) = ea.Tensors("episodes/text_summary")
    assert b"the learning rate -- not proven" in text.tensor_proto.string_val[0]
