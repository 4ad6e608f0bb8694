"""titan_ledger.format.signal_columns: the signal columns are declared once, and every view
of a row -- the row's keys and types, the column reader's kinds, the recorder's reduced
vector, plot's panels, the dashboards' scalars, charts and summaries -- follows the table.
The last test adds a column to the table (in a fresh interpreter) and finds it in every view."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import typing
from pathlib import Path

from titan_ledger.components.ledger.dashboard_writers import TB_LAYOUT
from titan_ledger.components.ledger.dashboards import SUMMARIES
from titan_ledger.components.signals.recorder import SLOTS, dashboard
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.format import columns, records, signal_columns
from titan_ledger.format.signal_columns import COLUMNS, PLOT_PANELS, TB_CHARTS
from titan_ledger.tools import plot


def test_the_table_is_well_formed():
    names = [c.name for c in COLUMNS]
    assert len(set(names)) == len(names) and records.PER_LAYER_KEY not in names
    # a skipped window's row appends its own keys after a trained row's: they come last
    window = [c.window for c in COLUMNS]
    assert window == sorted(window) and any(window)
    for c in COLUMNS:
        assert c.type in (int, float, bool, str) and c.doc and "\n" not in c.doc, c
        assert c.plot is None or c.plot in PLOT_PANELS, c
        assert c.tensorboard is None or c.tensorboard in TB_CHARTS, c
        assert c.summary in (None, "max", "min") and (c.summary is None or c.dashboard), c
        assert c.label is None or c.plot is not None, c
        assert not (c.window and (c.slot or c.dashboard or c.plot)), c  # a window trains nothing
        assert not (c.record and c.slot), c  # one source per value: the step's record or the device
    # every panel and chart draws something; no two columns share a slot
    assert {c.plot for c in COLUMNS} - {None} == set(PLOT_PANELS)
    assert {c.tensorboard for c in COLUMNS} - {None} == set(TB_CHARTS)
    slots = [c.slot for c in COLUMNS if c.slot]
    assert len(set(slots)) == len(slots)


def test_the_format_views_are_the_tables():
    assert records.SIGNAL_KEYS == tuple(c.name for c in COLUMNS if not c.window)
    assert columns.TABLE_KEYS == (*records.SIGNAL_KEYS, *(c.name for c in COLUMNS if c.window))
    assert columns.KINDS == {c.name: {int: "int", float: "float", bool: "bool", str: "str"}[c.type] for c in COLUMNS}
    hints = typing.get_type_hints(records.SignalRow)
    assert list(hints) == [c.name for c in COLUMNS]
    assert all(hints[c.name] == (c.type | None if c.null else c.type) for c in COLUMNS)


def test_the_recorders_vector_has_a_slot_per_device_column_and_the_record_a_field_per_host_fact():
    # the table's slots first, in its order, then the recorder's own scratch (no column's)
    assert SLOTS[:len(signal_columns.DEVICE_SLOTS)] == tuple(c.slot for c in COLUMNS if c.slot)
    assert not set(SLOTS[len(signal_columns.DEVICE_SLOTS):]) & set(signal_columns.DEVICE_SLOTS)
    assert set(signal_columns.RECORD_KEYS) <= {f.name for f in dataclasses.fields(StepRecord)}


def test_plot_and_the_dashboards_draw_what_the_table_says():
    assert [(ylabel, scale) for ylabel, scale, _ in plot.PANELS] == list(PLOT_PANELS.values())
    for c in COLUMNS:
        on_panel = [keys for ylabel, _, keys in plot.PANELS if c.name in keys]
        assert on_panel == ([] if c.plot is None else [plot.PANELS[list(PLOT_PANELS).index(c.plot)][2]]), c
        if c.label:
            assert plot.LABELS[c.name] == c.label
        charts = [t for t, (_, tags) in TB_LAYOUT["titan_ledger"].items() if rf"^ledger/{c.name}$" in tags]
        assert charts == ([] if c.tensorboard is None else [TB_CHARTS[c.tensorboard]]), c
        assert SUMMARIES.get(f"ledger/{c.name}") == c.summary, c
    # a trained row with every column set: one ledger/<key> scalar per dashboard column
    row = {c.name: {int: 3, float: 0.5, bool: True, str: "x"}[c.type] for c in COLUMNS if not c.window}
    row[records.PER_LAYER_KEY] = {"layers.0": 2.0}
    scalars = dashboard(row)
    assert set(scalars) == {f"ledger/{c.name}" for c in COLUMNS if c.dashboard and not c.window} | \
        {"ledger/grad_norm_per_layer/layers.0"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in scalars.values())


# What adding a column is: one line in the table. In a fresh interpreter, a device signal
# "new_signal" (reduced on device, charted, summarised) and a host fact "new_fact" (the step
# record's field, a wall-clock time) are added; every view must then hold them, the recorder copies "new_fact" from the
# record with no code of its own, and refuses a step until its code fills "new_signal".
_ADD_A_COLUMN = r"""
import importlib.util, json, sys
from pathlib import Path
import titan_ledger.format
path = Path(titan_ledger.format.__file__).parent / "signal_columns.py"
src = path.read_text()
line = '    C("lr", float,'
assert src.count(line) == 1
src = src.replace(line, '    C("new_signal", float, "a new signal", slot="new_signal", plot="loss", label="the new signal", '
                        'tensorboard="logz", summary="max"),\n'
                        '    C("new_fact", int, "a new host fact", record=True, timing=True),\n' + line)
spec = importlib.util.spec_from_loader("titan_ledger.format.signal_columns", loader=None)
mod = importlib.util.module_from_spec(spec)
mod.__file__ = str(path)
sys.modules[spec.name] = mod
exec(compile(src, str(path), "exec"), mod.__dict__)
titan_ledger.format.signal_columns = mod

import torch
from titan_ledger.components.ledger.dashboard_writers import TB_LAYOUT
from titan_ledger.components.ledger.dashboards import SUMMARIES
from titan_ledger.components.signals import recorder
from titan_ledger.components.signals.sums import ParamPlan
from titan_ledger.components.signals.topology import Topology
from titan_ledger.format import columns, records
from titan_ledger.tools import plot

model = torch.nn.Linear(2, 1)
model(torch.ones(1, 2)).sum().backward()
rec = recorder.SignalRecorder(Topology.single(), device=torch.device("cpu"),
                              plan=ParamPlan.build(model.named_parameters(), 1, 1), attn=[], per_layer=False,
                              max_logit=True, max_norm=1.0, global_batch=1, seq_len=2)
try:
    rec.reduce(local_loss_sum=torch.tensor(1.0), local_tokens=1, grad_norm=torch.tensor(1.0))
    refused = None
except RuntimeError as e:
    refused = str(e)
from titan_ledger.components.signals.step_record import StepRecord
step = StepRecord(step=1, start=0.0)
step.new_fact = 7  # (the field the new host fact would add to StepRecord)
layout = recorder.RowLayout(dp_size=1, dp_rank=0, max_logit=True, qk_clip=False, per_layer_groups=None)
try:
    recorder.signals_row([2.0, 1.0] + [0.0] * len(recorder.SLOTS), step, layout, skipped_samples=0, stats=None)
    row_refused = None
except KeyError as e:
    row_refused = str(e)
print(json.dumps({
    "signal_keys": list(records.SIGNAL_KEYS), "kinds": columns.KINDS, "slots": list(recorder.SLOTS),
    "panels": [list(keys) for _, _, keys in plot.PANELS], "labels": plot.LABELS,
    "tb": TB_LAYOUT["titan_ledger"], "summaries": SUMMARIES,
    "dashboard": sorted(recorder.dashboard({"step": 1, "new_signal": 2.0, "new_fact": 3})), "refused": refused,
    "row_refused": row_refused, "timing": sorted(mod.TIMING_KEYS)}))
"""


def test_a_column_added_to_the_table_reaches_every_view():
    root = Path(__file__).resolve().parents[3]
    p = subprocess.run([sys.executable, "-c", _ADD_A_COLUMN], capture_output=True, text=True, timeout=120,
                       cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    keys = got["signal_keys"]
    assert keys[keys.index("new_signal") + 1:keys.index("new_signal") + 3] == ["new_fact", "lr"]
    assert len(keys) == len(records.SIGNAL_KEYS) + 2
    assert (got["kinds"]["new_signal"], got["kinds"]["new_fact"]) == ("float", "int")
    assert list(got["kinds"])[:len(keys)] == keys
    assert "new_signal" in got["slots"] and len(got["slots"]) == len(SLOTS) + 1
    assert got["panels"][0] == ["loss", "loss_max", "new_signal"] and got["labels"]["new_signal"] == "the new signal"
    assert r"^ledger/new_signal$" in got["tb"][TB_CHARTS["logz"]][1]
    assert got["summaries"]["ledger/new_signal"] == "max"
    assert got["dashboard"] == ["ledger/new_fact", "ledger/new_signal"]
    assert got["timing"] == sorted({*signal_columns.TIMING_KEYS, "new_fact"})  # runs compared without it
    # the recorder's vector follows the table: the new slot is one its code must fill; the
    # row takes the host fact from the record, and waits for the device signal's value only
    assert got["refused"] and "'new_signal'" in got["refused"], got["refused"]
    assert got["row_refused"] and "columns nothing computes ['new_signal']" in got["row_refused"], got["row_refused"]
