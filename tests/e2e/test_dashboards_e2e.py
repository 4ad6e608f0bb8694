"""Dashboards end to end: ONE short run (W&B offline + TensorBoard, a spike injected at
step 10, in-process rollback to checkpoint step-8), read back with wandb's own reader
(``wandb leet inspect --json``, tests/helpers.py), TensorBoard's EventAccumulator, and the
incident page opened in headless chromium (installed by .ci/run; its signals plot checked
for legibility)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import CONFIGS, explain, headless_chromium, torchrun, wandb_files, wandb_records
from titan_ledger.format.reader import RunLedger

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dash")
    toml = d / "dash.toml"
    toml.write_text((CONFIGS / "debug_cpu.toml").read_text().replace(
        'description = "', 'name = "spike-drill"\ntags = ["e2e", "drill"]\nnotes = "rollback rehearsal"\n'
                           'description = "'))
    dump = d / "run"
    p = torchrun(["--job.config_file", str(toml), "--training.steps", "13", "--dump_folder", str(dump),
                  "--metrics.enable_wandb", "--metrics.enable_tensorboard", "--ledger.spike.window", "8",
                  "--ledger.rehearsal.inject", "10:1:repeat", "--checkpoint.enable", "--checkpoint.interval", "4",
                  "--ledger.response.policy", "act", "--ledger.response.action", "rollback", "--ledger.rollback.back", "1", "--ledger.rollback.skip", "2",
                  "--ledger.proof.scope", "off"],  # the rollback's dashboards (a proof would fix it in step)
                 WANDB_RUN_ID="")
    assert p.returncode == 0, explain(p)
    assert "less than the current step" not in p.stdout + p.stderr  # W&B dropped nothing
    return dump, toml


def test_wandb_steps_identity_summaries_alerts(run):
    dump, toml = run
    (log,) = wandb_files(dump)  # one offline run: the rollback resumed it, no second run
    assert log.parent.parent.name == "wandb" and log.parent.name.startswith("offline-run-")
    kinds = {}
    for r in wandb_records(log):
        kinds.setdefault(r["type"], []).append(r[r["type"]])
    hist = [h["item"] for h in kinds["history"]]
    steps = [h["_step"] for h in hist]
    assert steps == sorted(set(steps)), steps  # strictly increasing
    led = RunLedger(dump)
    rows = led.signals
    # every signals row, rolled back or not, reached W&B in the order it was written:
    # after the rewind the training step goes back (a skip row at 9 after step 10)
    written = [r["step"] for seg in rows.segments for r in seg.rows]
    train = [h["train/step"] for h in hist if "ledger/consumed_samples" in h]
    assert train == written and written[:11] == list(range(1, 11)) + [9], (train, written)
    assert len(led.rewinds()) >= 1
    spike_row = next(h for h in hist if h.get("spike/flag") == 1.0)
    assert spike_row["train/step"] == 10 and spike_row["rollback/to_step"] == 8
    assert spike_row["rollback/skip_first"] == 9 and spike_row["spike/loss_max_rank"] == 1
    # the spike events table: logged on the spike's row, saved with the run, holding step 10
    assert spike_row["spike/events._type"] == "table-file" and spike_row["spike/events.nrows"] == 1
    table = spike_row["spike/events.path"]
    assert table in {f["path"] for fs in kinds["files"] for f in fs["files"]}
    events = json.loads((log.parent / "files" / table).read_text())
    assert [r[events["columns"].index("step")] for r in events["data"]] == [10]
    keys = set().union(*hist)
    assert not keys & {"loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm"}
    assert not any(k.startswith("lr/") for k in keys) and "ledger/lr" in keys and "train/consumed_tokens" in keys
    # summaries: max grad norm is the spike's, not the last step's
    summary = {}
    for s in kinds["summary"]:
        summary.update(s["update"])
    gmax = max(r["grad_norm"] for r in rows.history + rows.superseded if r.get("grad_norm") is not None)
    assert summary["ledger/grad_norm"] == {"max": pytest.approx(gmax)}
    assert "min" in summary["ledger/loss"] and "max" in summary["ledger/max_logit"]
    assert "max" in summary["ledger/logz_max"]  # the output-logit drift signal (log Z of the CE's pass)
    assert summary["spike/count"] == {"max": len(led.spike_events())}
    defined = {m.get("name") or m.get("glob_name"): m for m in kinds["metric"]}
    assert defined["*"]["step_metric"] == "train/step" and "ledger/loss_max" in defined
    alerts = {(a["level"], a["title"]) for a in kinds["alert"]}
    titles = {t for lv, t in alerts if lv == "WARN"}  # the answer's headline is the spike's alert
    assert "rollback at step 10" in titles and any(t.endswith(" at step 10: cause not established") for t in titles), \
        alerts
    assert kinds["exit"][-1].get("exit_code", 0) == 0
    ident = kinds["run"][-1]
    assert ident["display_name"] == "spike-drill" and ident["notes"] == "rollback rehearsal"
    assert {"e2e", "drill", "debug_cpu"} <= set(ident["tags"])
    state = json.loads((dump / "ledger" / "wandb.json").read_text())
    assert ident["run_id"] == state["id"]  # the stable id a relaunch reuses
    cfg = json.dumps(kinds["config"])
    header = rows.segments[0].header
    assert header.run_id in cfg and header.extra["config_digest"] in cfg and str(toml) in cfg
    assert any(f["path"] == "dash.toml" for fs in kinds["files"] for f in fs["files"])


def test_tensorboard_layout_and_rewind_subrun(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump, _ = run
    (tb,) = [p for p in (dump / "tb").iterdir() if p.is_dir()]
    ea = EventAccumulator(str(tb), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("ledger/grad_norm")] == list(range(1, 11))  # spike kept
    assert "custom_scalars__config__" in ea.Tags()["tensors"]
    assert "config/toml/text_summary" in ea.Tags()["tensors"] and "ledger/max_norm" in ea.Tags()["scalars"]
    logz = [e.value for e in ea.Scalars("ledger/logz_max")]  # recorded at z_loss_weight 0 too
    assert len(logz) == 10 and all(math.log(2048) - 2 < v < 20 for v in logz), logz
    led = RunLedger(dump)
    subs = sorted(tb.glob("rewind-*"))
    assert len(subs) == len(led.rewinds()) >= 1  # one TB sub-run per rewind
    sub = EventAccumulator(str(subs[-1]))
    sub.Reload()
    last = led.rewinds()[-1]["skip_window"][1]
    assert [e.step for e in sub.Scalars("ledger/grad_norm")] == \
        [r["step"] for r in led.trained_rows() if r["step"] > last]


PROBE = """<script>addEventListener('load', () => {
  const pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify([...document.images].map(i => {
    const r = i.getBoundingClientRect(), cs = getComputedStyle(i);
    const border = parseFloat(cs.borderLeftWidth) + parseFloat(cs.borderRightWidth);
    return {alt: i.alt, complete: i.complete, natural: [i.naturalWidth, i.naturalHeight],
            shown: [r.width - border, r.height - border]}; }));
  document.body.appendChild(pre); });</script>"""


def _png_size(b64: str) -> list[int]:
    import base64
    import struct

    head = base64.b64decode(b64[:64])
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return list(struct.unpack(">II", head[16:24]))


def test_incident_report_renders_in_chromium(run, tmp_path):
    """The page, and its signals plot legible: against the figure as saved (each panel's
    height, legends off the data, spike labels short and in place) and as chromium shows it."""
    from tests.unit.tools.test_plot import MIN_PANEL_PX, assert_legible
    from titan_ledger.tools.report import report

    dump, _ = run
    out = tmp_path / "incident.html"
    info = report(dump, 10, out, back=1, skip=2)
    page = out.read_text()
    assert re.search(r"<h1>Incident: [a-z -]+(\([a-z ]+\))? at step 10</h1><div class='answer'>", page) and \
        "injected batch" in page
    assert "<td>stdlib_docs</td>" in page and "c4_test" not in page  # the bundled corpus's own name
    from titan_ledger.tools.rollback import existing_skips, plan

    led = RunLedger(dump)
    p = plan(led.checkpoints(), 10, 1, 2, existing=existing_skips(led))  # the page's own plan
    assert p["load_step"] <= 9 and p["load_step"] in led.checkpoints()
    assert f"--checkpoint.load_step {p['load_step']}" in page and f"<td>step-{p['load_step']}</td>" in page
    # the per-rank table of the rolled-back step holds the rank files' rows as it trained,
    # and the caption counts this run's own steps
    ranks = page.split("<h2>Per-rank losses</h2>", 1)[1].split("<h2>", 1)[0]
    assert "before a rollback or resume superseded it" in ranks and "None" not in ranks, ranks
    last = max(int(r.get("last_step") or r["step"]) for r in RunLedger(dump).signals.history)
    assert f"<p>Steps 1-{last}: " in page, re.findall(r"<p>Steps [^:]*:", page)
    layout = info["signals_plot"]["layout"]
    assert_legible(layout, [10])
    assert all(p["lines"] for p in layout["panels"]), layout["panels"]  # every signal drawn
    (signals_b64,) = re.findall(r'alt="signals around step 10" src="data:image/png;base64,([^"]+)"', page)
    assert _png_size(signals_b64) == layout["size_px"]  # the layout is the embedded image's
    flags = [*headless_chromium(tmp_path / "profile", "; the page was checked as HTML only"),
             "--enable-logging=stderr", "--v=0"]
    # the page has no script; a copy with a probe reports each image's decoded and shown size
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = subprocess.run(flags + ["--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Rollback plan" in dom.stdout and len(re.findall(r"<img ", dom.stdout)) >= 2
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert m, dom.stdout[-2000:]
    imgs = {i["alt"]: i for i in json.loads(m.group(1))}
    sig = imgs["signals around step 10"]
    assert sig["complete"] and sig["natural"] == layout["size_px"], sig  # decoded, at its own size
    scale = sig["shown"][1] / sig["natural"][1]
    assert abs(sig["shown"][0] / sig["natural"][0] - scale) < 0.01, sig  # not distorted
    assert scale > 0.95, sig  # shown at (about) its own size in a 1200 px window
    assert_legible(layout, [10], scale=scale)  # each panel >= MIN_PANEL_PX CSS pixels on screen
    assert min(p["axes"][3] - p["axes"][1] for p in layout["panels"]) * scale >= MIN_PANEL_PX
    assert imgs["per-rank losses"]["complete"] and imgs["per-rank losses"]["natural"][0] > 0
    shot = tmp_path / "incident.png"
    p = subprocess.run(flags + [f"--screenshot={shot}", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and shot.stat().st_size > 50_000, p.stderr[-2000:]
    console = [ln for ln in (dom.stderr + p.stderr).splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    assert "Failed to load resource" not in dom.stderr + p.stderr
    shutil.copy(shot, Path("/tmp") / "titan_ledger_incident_e2e.png") if Path("/tmp").is_dir() else None
