"""The dashboard writers: torchtitan's W&B and TensorBoard loggers, each wrapped so that
a run that goes back in steps stays readable, and the words they write about an incident.

Design decision: these two classes are everything that differs between W&B and
TensorBoard -- how a step that goes back is kept (a W&B step counter, a TensorBoard
sub-run), what an alert or a spike becomes (an alert and a table row, a text entry).
:mod:`titan_ledger.components.ledger.dashboards` is the one face the trainer and the
ledger call (``attach``, ``log_spike``, ...): it finds these writers in torchtitan's
logger container and fans each event out to them, so a third dashboard is a class here
and no change there.

*W&B steps.* W&B refuses a ``step`` lower than the last one ("Tried to log to step 9
that is less than the current step 10 ... ignored"), but a training step goes back
after an in-process rollback and a relaunch that resumes from a checkpoint re-runs
steps. So the W&B step (``_step``) is **not** the training step: it is an event
counter that advances by one each time the training step of a log call changes (in
either direction), and never goes back. Every row carries the training step as a
value, ``train/step``, and the tokens trained so far, ``train/consumed_tokens``;
``define_metric("*", step_metric="train/step")`` makes ``train/step`` the default
x-axis of every chart (``train/consumed_tokens`` is the other axis to pick). A rewind
is logged at the current W&B step (the spike's), its target as values
(``rollback/to_step``, ``rollback/skip_first``, ``rollback/skip_last``). The counter is
persisted in ``<dump_folder>/<ledger>/wandb.json`` (with the run id) on every change,
so a relaunch -- resumed by W&B or, offline, synced later into the same run --
continues above every step the earlier launch logged (``max(run.step, saved)``).

*No duplicated series.* The ledger logs loss, worst-rank loss, pre-clip grad norm and LR
every step as ``ledger/loss``, ``ledger/loss_max``, ``ledger/grad_norm``, ``ledger/lr``;
torchtitan's ``loss_metrics/global_avg_loss``, ``loss_metrics/global_max_loss``,
``grad_norm`` and ``lr/*`` (every ``log_freq`` steps) are the same numbers, so they are
dropped from both dashboards while the ledger records signals.

*TensorBoard.* A custom-scalars layout (loss with ``loss_max``; grad norm before and
after the clip with ``max_norm``; max logit; spikes) and the run's config as text. TB
would purge events whose step is above a step that goes back, so after a rewind the
writer moves to a sub-run ``rewind-<n>`` of the same log dir.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from titan_ledger.format import signal_columns
from titan_ledger.format.answers import Answer, render

#: torchtitan's keys that the ledger's per-step ``ledger/<key>`` already carries.
DUPLICATES = ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm")
DUPLICATE_PREFIXES = ("lr/",)

#: what every W&B row carries: the training step (the x-axis) and the tokens so far
STEP_KEY = "train/step"
TOKENS_KEY = "train/consumed_tokens"

#: TensorBoard custom-scalars layout (tags are regexes): the signal columns' charts (a
#: column's ``tensorboard`` in format/signal_columns.py; ``max_norm`` is logged beside
#: ``grad_norm``, so it is drawn with it), then the response's
TB_LAYOUT = {
    "titan_ledger": {
        **{title: ["Multiline", [rf"^ledger/{k}$" for k in keys]
                   + ([r"^ledger/max_norm$"] if "grad_norm" in keys else [])]
           for title, keys in signal_columns.tensorboard_charts().items()},
        "spikes and rollbacks": ["Multiline", [r"^spike/flag$", r"^rollback/to_step$"]],
        "notes (not acted on)": ["Multiline", [r"^note/flag$"]],
    }
}


def read_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def write_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _drop_duplicates(metrics: dict[str, Any], ledger_on: bool) -> dict[str, Any]:
    if not ledger_on:
        return metrics
    return {k: v for k, v in metrics.items()
            if k not in DUPLICATES and not k.startswith(DUPLICATE_PREFIXES)}


class LedgerWandB:
    """torchtitan's ``WandBLogger`` with a monotonic W&B step (see the module doc)."""

    def __init__(self, inner, *, state_file: Path | None, ledger_on: bool, max_norm: float | None = None):
        self.inner = inner
        self.wandb = inner.wandb
        self.run = inner.wandb.run
        self.ledger_on = ledger_on
        self.max_norm = max_norm
        self.state_file = Path(state_file) if state_file else None
        saved = read_state(self.state_file) if self.state_file else {}
        if saved.get("id") not in (None, getattr(self.run, "id", None)):
            saved = {}
        start = max(int(getattr(self.run, "step", 0) or 0), int(saved.get("next_step", 0)))
        self.wb_step = start - 1  # the next new training step logs at ``start``
        self.train_step: int | None = None
        self.spikes = int(saved.get("spikes", 0))
        self.rewinds = int(saved.get("rewinds", 0))
        self.spike_rows: list[list[Any]] = [list(r) for r in saved.get("spike_rows", [])]
        self.exit_code = 0
        self.finished = False

    # the step map ------------------------------------------------------------
    def _advance(self, step: int) -> int:
        if step != self.train_step:
            self.wb_step += 1
            self.train_step = step
            self._save()
        return self.wb_step

    def _save(self) -> None:
        if self.state_file is None:
            return
        try:
            write_state(self.state_file, {"id": getattr(self.run, "id", None), "next_step": self.wb_step + 1,
                                          "spikes": self.spikes, "rewinds": self.rewinds,
                                          "spike_rows": self.spike_rows[-1000:]})
        except OSError:
            pass  # a dashboard must never stop training

    def log(self, metrics: dict[str, Any], step: int) -> None:
        metrics = _drop_duplicates(metrics, self.ledger_on)
        if not metrics or self.finished:
            return
        wb_step = self._advance(int(step))
        row = {k if self.inner.tag is None else f"{self.inner.tag}/{k}": v for k, v in metrics.items()}
        row[STEP_KEY] = int(step)
        if "ledger/consumed_tokens" in row:
            row[TOKENS_KEY] = row["ledger/consumed_tokens"]
        if self.max_norm is not None and "ledger/grad_norm" in row:
            row["ledger/max_norm"] = self.max_norm
        self.wandb.log(row, step=wb_step)

    # events ------------------------------------------------------------------
    def spike(self, row: dict[str, Any], ev: dict[str, Any]) -> None:
        self.spikes += 1
        step = int(row["step"])
        rules = ", ".join(ev.get("rules", []))
        proof = ev.get("proof") or {}
        a = answer_of(ev)
        self.spike_rows.append([step, rules, _f(row.get("loss")), _f(row.get("loss_max")),
                                row.get("loss_max_rank"), _f(row.get("grad_norm")),
                                _f(ev.get("grad_norm_median")), _f(row.get("max_logit")), ev.get("action"),
                                proof.get("verdict"), a.cause_text if a else None, a.established if a else None,
                                a.fix.change if a and a.fix else None, "\n".join(render.lines(a)) if a else None])
        self.log({"spike/count": self.spikes}, step)
        try:
            table = self.wandb.Table(columns=["step", "rules", "loss", "loss_max", "loss_max_rank", "grad_norm",
                                              "grad_norm_median", "max_logit", "action", "proof_verdict",
                                              "answer_cause", "answer_established", "answer_fix", "answer"],
                                     data=[list(r) for r in self.spike_rows])
            self.wandb.log({"spike/events": table}, step=self._advance(step))
        except Exception:
            pass
        self.alert(render.headline(a) if a else f"loss spike at step {step}", _incident_text(ev, row), "WARN")
        self._save()

    def answer(self, a) -> None:
        """An incident answered outside a flag (a stall's window proof): its alert."""
        self.alert(render.headline(a), "\n".join(render.lines(a) + render.detail(a)), "WARN")

    def rewind(self, *, from_step: int, to_step: int, window: tuple[int, int]) -> None:
        self.rewinds += 1
        self.log({"rollback/from_step": from_step, "rollback/to_step": to_step,
                  "rollback/skip_first": window[0], "rollback/skip_last": window[1],
                  "rollback/count": self.rewinds}, from_step)
        self.alert(f"rollback at step {from_step}",
                   f"rolled back from step {from_step} to checkpoint step-{to_step}; skipping steps "
                   f"{window[0]}-{window[1]} (rollback {self.rewinds})", "WARN")
        self._save()

    def episodes(self, eps: list) -> None:
        """The run's answer at its end: the episodes in the run's summary (``episodes/count``,
        ``episodes/text``: every view's words) and as a table (``episodes/table``)."""
        try:
            self.run.summary["episodes/count"] = len(eps)
            self.run.summary["episodes/text"] = "\n".join(render.episodes_block(eps, detail=False))
            cols = list(render.EPISODE_COLUMNS)
            rows = [[str(v) if isinstance(v, list) else v for v in render.episode_columns(e).values()] for e in eps]
            self.wandb.log({"episodes/table": self.wandb.Table(columns=cols, data=rows)},
                           step=self._advance(self.train_step or 0))
        except Exception:
            pass

    def stop(self, reason: str, exit_code: int = 1) -> None:
        self.exit_code = exit_code
        try:
            self.run.summary["stop/reason"] = reason
            if self.train_step is not None:
                self.run.summary["stop/step"] = self.train_step
        except Exception:
            pass
        self.alert("training stopped", reason, "ERROR")

    def alert(self, title: str, text: str, level: str) -> None:
        """A W&B alert (``dashboards.alert`` asks it for the response's own alerts)."""
        try:
            self.run.alert(title=title, text=text[:1000], level=level, wait_duration=1)
        except Exception:
            pass

    def close(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.wandb.run is not None:
            self.wandb.finish(exit_code=self.exit_code)


class LedgerTensorBoard:
    """torchtitan's ``TensorBoardLogger`` plus the layout, config text, no duplicates,
    and a sub-run per rewind (TB purges events above a step that goes back)."""

    def __init__(self, inner, *, log_dir: str | None, ledger_on: bool, max_norm: float | None = None):
        self.inner = inner
        self.writer = inner.writer
        self.tag = inner.tag
        self.log_dir = log_dir or self.writer.log_dir
        self.ledger_on = ledger_on
        self.max_norm = max_norm
        self.rewinds = 0
        self.last_step: int | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        metrics = _drop_duplicates(metrics, self.ledger_on)
        if self.max_norm is not None and "ledger/grad_norm" in metrics:
            metrics = {**metrics, "ledger/max_norm": self.max_norm}
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k if self.tag is None else f"{self.tag}/{k}", v, step)
        self.last_step = step

    def setup(self, config_text: dict[str, str]) -> None:
        self.writer.add_custom_scalars(TB_LAYOUT)
        for name, text in config_text.items():
            self.writer.add_text(name, text, 0)
        self.writer.flush()

    def spike(self, row: dict[str, Any], ev: dict[str, Any]) -> None:
        self.writer.add_text("spike/events", code_block(_incident_text(ev, row)), int(row["step"]))

    def answer(self, a) -> None:
        """An incident answered outside a flag (a stall's window proof), as text at its step."""
        self.writer.add_text("spike/events", code_block("\n".join(render.lines(a) + render.detail(a))), int(a.step))

    def proof(self, step: int, proof: dict[str, Any]) -> None:
        """A note's proof in words (a spike's rides in ``spike/events``)."""
        self.writer.add_text("proof/events", f"step {step}: {_proof_line(proof)}", int(step))

    def rewind(self, *, from_step: int, to_step: int, window: tuple[int, int]) -> None:
        self.rewinds += 1
        self.log({"rollback/to_step": to_step, "rollback/skip_first": window[0],
                  "rollback/skip_last": window[1]}, from_step)
        self.writer.add_text("rollback/events", f"rolled back from step {from_step} to step-{to_step}; "
                             f"skipping {window[0]}-{window[1]}; later steps: sub-run rewind-{self.rewinds}",
                             from_step)
        self.writer.close()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(self.log_dir, f"rewind-{self.rewinds}"), max_queue=1000)
        self.inner.writer = self.writer

    def alert(self, title: str, text: str, level: str) -> None:
        """An alert of the response itself: TensorBoard has none, so its text at the last step."""
        self.writer.add_text("response/events", text, int(self.last_step or 0))

    def episodes(self, eps: list) -> None:
        """The run's answer at its end, as text (``episodes``)."""
        self.writer.add_text("episodes", code_block("\n".join(render.episodes_block(eps, detail=False))),
                             int(self.last_step or 0))

    def stop(self, reason: str, exit_code: int = 1) -> None:
        self.writer.add_text("stop/reason", reason, int(self.last_step or 0))

    def close(self) -> None:
        self.writer.close()


def _f(v):
    if v is None:
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _fmt(v) -> str:
    try:
        return f"{float(v):.4g}"
    except (TypeError, ValueError):
        return str(v)


def code_block(text: str) -> str:
    """A markdown code block (TensorBoard renders text summaries as markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def answer_of(ev: dict[str, Any]):
    """The incident's answer recorded in its event (``format.answers.Answer``), or None."""
    return Answer.of(ev["answer"]) if isinstance(ev.get("answer"), dict) else None


def _incident_text(ev: dict[str, Any], row: dict[str, Any]) -> str:
    """A flagged step in words: its answer (three lines and the command), then its signals;
    an event without an answer (not rank 0's) says its rules and proof."""
    a = answer_of(ev)
    signals = (f"loss {_fmt(row.get('loss'))} (worst DP rank {row.get('loss_max_rank')}: {_fmt(row.get('loss_max'))}), "
               f"grad norm {_fmt(row.get('grad_norm'))} (window median {_fmt(ev.get('grad_norm_median'))}); rules "
               f"{', '.join(ev.get('rules', []))}; action {ev.get('action')}")
    if a is not None:
        return "\n".join([*render.lines(a), *filter(None, [render.run_it(a)]), "  signals: " + signals])
    return f"step {row['step']}: {signals}" + (f"; {_proof_line(ev['proof'])}" if ev.get("proof") else "")


def _proof_line(proof: dict[str, Any]) -> str:
    from titan_ledger.format.proofs import describe_proof

    return describe_proof(proof)
