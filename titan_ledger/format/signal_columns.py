"""The columns of ``signals.jsonl``, declared once: every view of a signals row derives from this table.

Design decision: one :class:`Column` per key of a signals row, in the order the row holds
them, carrying everything any view needs to know about it -- its JSON type, whether it may
be null, a one-line doc, its slot in the recorder's reduced device vector, plot's panel,
TensorBoard's chart, its W&B summary, whether it is a dashboard scalar. Everything else is
computed from :data:`COLUMNS` and never written by hand again:

* :data:`SIGNAL_KEYS` (a trained row's keys, in order: the bytes on disk and the header's
  ``keys``) and :data:`WINDOW_KEYS` (what only a skipped window's row adds);
* :class:`SignalRow`, the row's ``TypedDict``, and ``format.columns.KINDS`` (each column's
  pyarrow type for the fast reader, ``export`` and plot);
* :data:`DEVICE_SLOTS`, the fixed block of ``components.signals.recorder``'s reduced vector
  (the recorder builds it and reads it back by these names; it adds only its own scratch
  slots, values no column holds), and :data:`RECORD_KEYS`, the host facts the row copies
  from the step's record as they stand;
* :func:`plot_panels` (``tools.plot``), :func:`tensorboard_charts`, :data:`SUMMARIES` and
  :data:`DASHBOARD_KEYS` (``components.ledger`` and the recorder's ``ledger/<key>`` scalars);
* :data:`TIMING_KEYS`, the wall-clock columns that comparisons of two runs leave out (the
  tests' bit-for-bit comparisons of a resumed, deferred or proven run with a straight one).

So adding a column is one line here plus the code that measures it: a host fact is a
``record`` column and a field of the step record (the recorder copies it, no code there); a
device signal is a ``slot`` and the recorder's lines that put this rank's value in the
all-gather, reduce it and turn it into the row's value. ``tests/unit/format/
test_signal_columns.py`` checks that every view agrees with the table, and adds a column to
prove it. This module is part of the format layer: it imports nothing else of the package,
so the readers, the recorder and the tools all stand on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

#: plot's panels, top to bottom: a column's ``plot`` names one; (y-axis label, scale:
#: ``"log"`` a log axis, else linear)
PLOT_PANELS: dict[str, tuple[str, str]] = {
    "loss": ("loss\n(nats/token)", "loss"),
    "grad_norm": ("grad norm\n(global L2)", "log"),
    "param_norm": ("param norm\n(global L2)", "linear"),
    "max_logit": ("max attention logit\n(q·k·scale)", "linear"),
    "num_zeros": ("zeros in grads\n(elements)", "linear"),
    "lr": ("learning rate", "linear"),
}

#: TensorBoard's custom-scalars charts of signal columns, in order: a column's
#: ``tensorboard`` names one (its title here; the dashboard writer adds the charts of
#: other scalars, and ``max_norm`` beside ``grad_norm``)
TB_CHARTS: dict[str, str] = {
    "loss": "loss (average, worst DP rank)",
    "grad_norm": "grad norm (pre-clip, post-clip, max_norm)",
    "max_logit": "max attention logit",
    "qk_clip": "QK-clip (heads scaled, smallest eta)",
    "logz": "output logits: log Z (mean, max)",
    "param_norm": "param norm",
}

_KINDS = {int: "int", float: "float", bool: "bool", str: "str"}


@dataclass(frozen=True)
class Column:
    """One key of a signals row and what each view needs to know about it."""

    name: str
    type: type  # the JSON value's type: int, float, bool or str (format.columns.KINDS)
    doc: str  # one line: what the value is
    null: bool = True  # may be null (a skipped window's model signals are; an option off)
    #: its value's slot in the recorder's reduced device vector (the device reduces it over
    #: the world; the row reads it back by this name); None: a fact the host knows
    slot: str | None = None
    #: the value is the step record's field of the same name, as it stands (a host fact:
    #: ``components.signals.step_record.StepRecord``); the recorder computes the others
    record: bool = False
    window: bool = False  # only a skipped window's row has it (not in SIGNAL_KEYS)
    #: a wall-clock measurement: two runs of the same steps differ in it, so comparisons of
    #: runs (a resume against a straight run, deferred against in-step) leave it out
    timing: bool = False
    off: str | None = None  # the setting, off by default, without which it is null in every row
    plot: str | None = None  # plot's panel (PLOT_PANELS) it is drawn in
    label: str | None = None  # its legend label there (default: its name, "_" as " ")
    tensorboard: str | None = None  # TensorBoard's chart (TB_CHARTS) it is drawn in
    summary: str | None = None  # its W&B summary ("max", "min")
    dashboard: bool = True  # logged as ``ledger/<name>`` each trained step, when not null

    @property
    def kind(self) -> str:
        """``int``, ``float``, ``bool`` or ``str``: how columnar readers type it."""
        return _KINDS[self.type]


C = Column
#: every column of a signals row, in the row's key order (trained rows: those without
#: ``window``; a skipped window's row appends the ``window`` ones)
COLUMNS: tuple[Column, ...] = (
    C("step", int, "1-based training step (a skipped window: its first step)", null=False, record=True,
      dashboard=False),
    C("consumed_samples", int, "rows consumed so far, trained or skipped (checkpointed)", null=False, record=True),
    C("consumed_tokens", int, "valid label tokens trained so far; skipped windows add none (checkpointed)",
      null=False, slot="consumed_tokens"),
    C("loss", float, "global token-weighted average loss (under PP: from the last stage)",
      plot="loss", label="avg", tensorboard="loss", summary="min"),
    C("loss_max", float, "largest per-DP-rank average loss",
      plot="loss", label="worst DP rank", tensorboard="loss", summary="max"),
    C("loss_max_rank", int, "the DP rank of loss_max"),
    C("grad_norm", float, "global L2 norm of the gradients before the clip", slot="grad_norm",
      plot="grad_norm", label="pre-clip", tensorboard="grad_norm", summary="max"),
    C("grad_norm_clipped", float, "the same after the clip (min(1, max_norm / (norm + 1e-6)) x norm)",
      slot="grad_norm_clipped", plot="grad_norm", label="post-clip", tensorboard="grad_norm", summary="max"),
    C("num_zeros", int, "gradient elements exactly 0, each logical element counted once", slot="num_zeros",
      plot="num_zeros"),
    C("masked_tokens", int, "label tokens the quarantine / repetition filter masked this step (all ranks)",
      slot="masked_tokens"),
    C("param_norm", float, "global L2 norm of the parameters before the update", slot="param_sq",
      plot="param_norm", tensorboard="param_norm"),
    C("update_norm", float, "|| params after optimizers.step - before || (0: no update applied)",
      off="--ledger.update_norm"),
    C("max_logit", float, "largest pre-softmax score q.k.scale over layers, heads, ranks", slot="max_logit",
      plot="max_logit", tensorboard="max_logit", summary="max"),
    C("z_loss", float, "mean over valid label tokens of log Z^2 (unweighted; recorded at weight 0 too)",
      slot="logz_sq"),
    C("logz_mean", float, "mean log Z = logsumexp(logits) over valid label tokens", slot="logz_sum",
      tensorboard="logz"),
    C("logz_max", float, "largest log Z over valid label tokens (the output-logit drift signal)",
      slot="logz_max", tensorboard="logz", summary="max"),
    C("qk_clip_heads", int, "query heads whose Q/K rows this step's QK-clip scaled", slot="qk_clip_heads",
      off="--qk_clip.enable", tensorboard="qk_clip", summary="max"),
    C("qk_clip_eta_min", float, "the smallest QK-clip factor eta (1: nothing clipped)", slot="qk_clip_eta_min",
      off="--qk_clip.enable", tensorboard="qk_clip", summary="min"),
    C("lr", float, "learning rate of this step's update (first param group)", null=False, record=True,
      plot="lr"),
    C("skipped", bool, "the step's data was consumed without training", null=False),
    C("skipped_samples", int, "samples consumed without training so far", null=False),
    C("spike", bool, "an acting spike rule fired: the step is a spike"),
    C("spike_note", bool, "only note-tier rules fired (recorded, not acted on)"),
    C("update_skipped", bool, "the update guard did not apply this step's update", null=False, record=True),
    C("step_time_s", float, "host wall time of the step", null=False, record=True, timing=True),
    C("data_loading_s", float, "host wall time of fetching the step's batches", null=False, record=True,
      timing=True),
    C("last_step", int, "the window's last step", null=False, window=True, dashboard=False),
    C("skip_lr", str, "the LR schedule over the window (freeze or advance)", null=False, window=True,
      dashboard=False),
)
del C

#: the per-layer pre-clip grad norms (``[ledger] per_layer``): a dict per row, no column
PER_LAYER_KEY = "grad_norm_per_layer"

BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}
#: a trained step's row keys, in order (a skipped window's row adds WINDOW_KEYS)
SIGNAL_KEYS: tuple[str, ...] = tuple(c.name for c in COLUMNS if not c.window)
WINDOW_KEYS: tuple[str, ...] = tuple(c.name for c in COLUMNS if c.window)
#: the reduced device vector's slots that hold a column's value, in table order
DEVICE_SLOTS: tuple[str, ...] = tuple(c.slot for c in COLUMNS if c.slot is not None)
#: the columns whose value is the step record's field of the same name
RECORD_KEYS: tuple[str, ...] = tuple(c.name for c in COLUMNS if c.record)
#: the wall-clock columns: what differs between two runs of the same steps
TIMING_KEYS: frozenset[str] = frozenset(c.name for c in COLUMNS if c.timing)
#: the columns logged as ``ledger/<key>`` scalars
DASHBOARD_KEYS: frozenset[str] = frozenset(c.name for c in COLUMNS if c.dashboard)
#: W&B summaries of the ``ledger/<key>`` scalars (``define_metric(summary=...)``)
SUMMARIES: dict[str, str] = {f"ledger/{c.name}": c.summary for c in COLUMNS if c.summary}

#: one row of ``signals.jsonl`` (a trained step, or a skipped window), typed as the table says
SignalRow = TypedDict("SignalRow", {c.name: c.type | None if c.null else c.type for c in COLUMNS},  # type: ignore[misc]
                      total=False)


def plot_panels() -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """plot's panels, top to bottom: ``(y-axis label, scale, columns)``."""
    return tuple((ylabel, scale, tuple(c.name for c in COLUMNS if c.plot == panel))
                 for panel, (ylabel, scale) in PLOT_PANELS.items())


def tensorboard_charts() -> dict[str, tuple[str, ...]]:
    """TensorBoard's charts of signal columns, in order: ``{title: columns}``."""
    return {title: tuple(c.name for c in COLUMNS if c.tensorboard == chart) for chart, title in TB_CHARTS.items()}
