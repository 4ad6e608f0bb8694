"""W&B and TensorBoard, done for an operator: monotonic W&B steps through rollbacks and
relaunches, run identity, summaries, alerts, a spike table, TensorBoard layouts.

Design decisions.

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

*Run id.* ``WANDB_RUN_ID`` if set; else the id in ``wandb.json`` (a relaunch on the
same dump folder continues the same W&B run, ``WANDB_RESUME=allow``); else a new id,
written there before ``wandb.init``. Both variables are set before torchtitan's
``WandBLogger`` calls ``wandb.init`` (:func:`prepare`, from ``train.py``).

*Identity and config.* Name: ``WANDB_RUN_NAME``, else ``[job] name``, else the dump
folder's name. Notes: ``WANDB_RUN_NOTES``, else ``[job] notes``, else ``[job]
description``. Tags: ``WANDB_RUN_TAGS`` (comma-separated) + ``[job] tags`` + the base
config function and backend. The W&B config gets a ``titan_ledger`` entry (ledger
``run_id`` of this launch, ``config_digest``, TOML path, overlays); the TOML file (and
overlays) are copied into the run's files.

*No duplicated series.* The ledger logs loss, worst-rank loss, pre-clip grad norm and LR
every step as ``ledger/loss``, ``ledger/loss_max``, ``ledger/grad_norm``, ``ledger/lr``;
torchtitan's ``loss_metrics/global_avg_loss``, ``loss_metrics/global_max_loss``,
``grad_norm`` and ``lr/*`` (every ``log_freq`` steps) are the same numbers, so they are
dropped from both dashboards while the ledger records signals.

*Ends.* A stop by a non-finite loss, by the ledger (``[ledger.rollback] limit``) or any other
exception raises an ERROR alert and ends the run with ``finish(exit_code=1)``.
Spikes raise a WARN alert each and are appended to the ``spike/events`` table; notes
(the weaker tier, :mod:`titan_ledger.components.detection.spikes`) are ``note/*`` scalars only.

*TensorBoard.* A custom-scalars layout (loss with ``loss_max``; grad norm before and
after the clip with ``max_norm``; max logit; spikes) and the run's config as text. TB
would purge events whose step is above a step that goes back, so after a rewind the
writer moves to a sub-run ``rewind-<n>`` of the same log dir.

Only the rank torchtitan logs metrics from has a W&B run / TB writer; every function
here is a no-op elsewhere (their ``metrics_logger`` is a bare ``BaseLogger``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "wandb.json"

#: torchtitan's keys that the ledger's per-step ``ledger/<key>`` already carries.
DUPLICATES = ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm")
DUPLICATE_PREFIXES = ("lr/",)

#: W&B summaries (``define_metric(summary=...)``).
SUMMARIES = {"ledger/grad_norm": "max", "ledger/grad_norm_clipped": "max", "ledger/max_logit": "max",
             "ledger/logz_max": "max", "ledger/qk_clip_heads": "max", "ledger/qk_clip_eta_min": "min",
             "ledger/loss_max": "max", "ledger/loss": "min", "spike/count": "max",
             "rollback/count": "max"}

STEP_KEY = "train/step"
TOKENS_KEY = "train/consumed_tokens"

#: TensorBoard custom-scalars layout (tags are regexes).
TB_LAYOUT = {
    "titan_ledger": {
        "loss (average, worst DP rank)": ["Multiline", [r"^ledger/loss$", r"^ledger/loss_max$"]],
        "grad norm (pre-clip, post-clip, max_norm)": [
            "Multiline", [r"^ledger/grad_norm$", r"^ledger/grad_norm_clipped$", r"^ledger/max_norm$"]],
        "max attention logit": ["Multiline", [r"^ledger/max_logit$"]],
        "QK-clip (heads scaled, smallest eta)": ["Multiline", [r"^ledger/qk_clip_heads$", r"^ledger/qk_clip_eta_min$"]],
        "output logits: log Z (mean, max)": ["Multiline", [r"^ledger/logz_mean$", r"^ledger/logz_max$"]],
        "param norm": ["Multiline", [r"^ledger/param_norm$"]],
        "spikes and rollbacks": ["Multiline", [r"^spike/flag$", r"^rollback/to_step$"]],
        "notes (not acted on)": ["Multiline", [r"^note/flag$"]],
    }
}

#: what train.py's :func:`prepare` learned before the trainer was built
_job: dict[str, Any] = {}


# --------------------------------------------------------------------------- #
# Before the trainer is built (train.py): the W&B run id
# --------------------------------------------------------------------------- #


def job_fields(job) -> dict[str, Any]:
    """``[job]`` name / tags / notes / description, the TOML file and overlays."""
    jsec = (getattr(job, "doc", None) or {}).get("job", {}) if job is not None else {}
    tags = jsec.get("tags", [])
    if isinstance(tags, str):
        tags = [t.strip() for t in tags.split(",") if t.strip()]
    return {"name": jsec.get("name"), "notes": jsec.get("notes"), "tags": list(tags),
            "group": jsec.get("group"), "description": getattr(job, "description", None),
            "config_file": getattr(job, "config_file", None),
            "overlays": list(getattr(job, "overlays", []) or []),
            "config": getattr(job, "config", None), "module": getattr(job, "module", None)}


def state_path(dump_folder: str | os.PathLike, ledger_folder: str = "ledger") -> Path:
    return Path(dump_folder) / ledger_folder / STATE_FILE


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


def stable_run_id(path: Path, env: dict | None = None) -> str:
    """``WANDB_RUN_ID``, else the id saved for this dump folder, else a new one."""
    env = os.environ if env is None else env
    if env.get("WANDB_RUN_ID"):
        return env["WANDB_RUN_ID"]
    saved = read_state(path).get("id")
    if saved:
        return saved
    import uuid

    return "tl" + uuid.uuid4().hex[:10]


def prepare(config, job, *, is_metrics_rank: bool) -> None:
    """Before ``config.build()``: remember the job; on the W&B rank pin the run id
    (``WANDB_RUN_ID``, ``WANDB_RESUME=allow``) so a relaunch continues the same run."""
    _job.clear()
    _job.update(job_fields(job))
    if not (is_metrics_rank and getattr(config.metrics, "enable_wandb", False)):
        return
    ledger_folder = getattr(getattr(config, "ledger", None), "folder", "ledger")
    path = state_path(config.dump_folder, ledger_folder)
    run_id = stable_run_id(path)
    state = read_state(path)
    if state.get("id") != run_id:
        state = {"id": run_id, "next_step": 0 if state.get("id") not in (None, run_id) else
                 state.get("next_step", 0)}
        write_state(path, state)
    os.environ["WANDB_RUN_ID"] = run_id
    if not os.environ.get("WANDB_RESUME"):
        os.environ["WANDB_RESUME"] = "allow"
    _job["state_path"] = str(path)


# --------------------------------------------------------------------------- #
# Loggers that replace torchtitan's in its LoggerContainer
# --------------------------------------------------------------------------- #


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
        a = _answer(ev)
        self.spike_rows.append([step, rules, _f(row.get("loss")), _f(row.get("loss_max")),
                                row.get("loss_max_rank"), _f(row.get("grad_norm")),
                                _f(ev.get("grad_norm_median")), _f(row.get("max_logit")), ev.get("action"),
                                proof.get("verdict"), a.cause_text if a else None, a.established if a else None,
                                a.fix.change if a and a.fix else None, "\n".join(a.lines()) if a else None])
        self.log({"spike/count": self.spikes}, step)
        try:
            table = self.wandb.Table(columns=["step", "rules", "loss", "loss_max", "loss_max_rank", "grad_norm",
                                              "grad_norm_median", "max_logit", "action", "proof_verdict",
                                              "answer_cause", "answer_established", "answer_fix", "answer"],
                                     data=[list(r) for r in self.spike_rows])
            self.wandb.log({"spike/events": table}, step=self._advance(step))
        except Exception:
            pass
        self._alert(a.headline() if a else f"loss spike at step {step}", _incident_text(ev, row), "WARN")
        self._save()

    def answer(self, a) -> None:
        """An incident answered outside a flag (a stall's window proof): its alert."""
        self._alert(a.headline(), "\n".join(a.lines() + a.detail()), "WARN")

    def rewind(self, *, from_step: int, to_step: int, window: tuple[int, int]) -> None:
        self.rewinds += 1
        self.log({"rollback/from_step": from_step, "rollback/to_step": to_step,
                  "rollback/skip_first": window[0], "rollback/skip_last": window[1],
                  "rollback/count": self.rewinds}, from_step)
        self._alert(f"rollback at step {from_step}",
                    f"rolled back from step {from_step} to checkpoint step-{to_step}; skipping steps "
                    f"{window[0]}-{window[1]} (rollback {self.rewinds})", "WARN")
        self._save()

    def stop(self, reason: str, exit_code: int = 1) -> None:
        self.exit_code = exit_code
        try:
            self.run.summary["stop/reason"] = reason
            if self.train_step is not None:
                self.run.summary["stop/step"] = self.train_step
        except Exception:
            pass
        self._alert("training stopped", reason, "ERROR")

    def _alert(self, title: str, text: str, level: str) -> None:
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
        self.writer.add_text("spike/events", _code(_incident_text(ev, row)), int(row["step"]))

    def answer(self, a) -> None:
        """An incident answered outside a flag (a stall's window proof), as text at its step."""
        self.writer.add_text("spike/events", _code("\n".join(a.lines() + a.detail())), int(a.step))

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


# --------------------------------------------------------------------------- #
# Attach to a built trainer; events from the ledger
# --------------------------------------------------------------------------- #


def _logger_list(container) -> list | None:
    """The list of loggers inside torchtitan's ``LoggerContainer`` (None on a rank
    whose ``metrics_processor.logger`` is a bare ``BaseLogger``); :func:`attach`
    replaces entries in it in place."""
    # CHANGED from torchtitan (no public hook: torchtitan.components.metrics.LoggerContainer
    # offers only add_logger/log/number_of_loggers/close, nothing to list or replace a
    # logger; MetricsProcessor._build_metric_logger creates WandBLogger/TensorBoardLogger
    # (they call wandb.init / open the event file) and is called from
    # MetricsProcessor.__init__, which Trainer.__init__ runs inline via config.metrics.build;
    # no Config field selects the logger classes)
    return getattr(container, "_loggers", None)


def _ours(metrics_logger) -> list:
    return [x for x in _logger_list(metrics_logger) or [] if isinstance(x, (LedgerWandB, LedgerTensorBoard))]


def attach(trainer) -> None:
    """Replace torchtitan's W&B / TB loggers in the trainer's LoggerContainer (metrics
    rank only) and set up identity, config, summaries and the TB layout. Idempotent."""
    from torchtitan.components.metrics import TensorBoardLogger, WandBLogger

    loggers = _logger_list(trainer.metrics_processor.logger)
    if not loggers:
        return
    config = trainer.config
    ledger = getattr(trainer, "ledger", None)
    ledger_on = bool(ledger is not None and getattr(ledger, "recorder", None) is not None)
    max_norm = float(config.training.max_norm) if config.training.max_norm else None
    ledger_folder = getattr(getattr(config, "ledger", None), "folder", "ledger")
    info = ledger_info(trainer)
    for i, lg in enumerate(list(loggers)):
        if isinstance(lg, WandBLogger):
            loggers[i] = w = LedgerWandB(lg, state_file=Path(_job.get("state_path") or
                                                             state_path(config.dump_folder, ledger_folder)),
                                         ledger_on=ledger_on, max_norm=max_norm)
            try:
                setup_wandb(w, config, info)
            except Exception as e:
                from torchtitan.tools.logging import logger

                logger.warning(f"titan_ledger: W&B setup incomplete ({type(e).__name__}: {e})")
        elif isinstance(lg, TensorBoardLogger):
            log_dir = getattr(lg.writer, "log_dir", None)
            loggers[i] = t = LedgerTensorBoard(lg, log_dir=log_dir, ledger_on=ledger_on, max_norm=max_norm)
            t.setup(config_text(config, info))


def ledger_info(trainer) -> dict[str, Any]:
    ledger = getattr(trainer, "ledger", None)
    return {"run_id": getattr(ledger, "run_id", None), "config_digest": getattr(ledger, "config_digest", None),
            "ledger_folder": str(getattr(ledger, "folder", "")), "config_file": _job.get("config_file"),
            "overlays": _job.get("overlays", []), "base_config": _job.get("config"),
            "description": _job.get("description")}


def run_identity(config, env: dict | None = None) -> dict[str, Any]:
    """Name, notes, tags, group for the W&B run (see the module doc for precedence)."""
    env = os.environ if env is None else env
    from titan_ledger.rehearsal import backend

    name = env.get("WANDB_RUN_NAME") or _job.get("name") or Path(str(config.dump_folder)).resolve().name
    notes = env.get("WANDB_RUN_NOTES") or _job.get("notes") or _job.get("description")
    tags = [t.strip() for t in env.get("WANDB_RUN_TAGS", "").split(",") if t.strip()]
    tags += list(_job.get("tags") or [])
    tags += [t for t in (_job.get("config"), backend.installed()) if t]
    tags = list(dict.fromkeys(str(t)[:64] for t in tags))
    return {"name": name, "notes": notes, "tags": tags, "group": env.get("WANDB_RUN_GROUP") or _job.get("group")}


def setup_wandb(w: LedgerWandB, config, info: dict[str, Any]) -> None:
    run = w.run
    ident = run_identity(config)
    run.name = ident["name"]
    if ident["notes"]:
        run.notes = ident["notes"]
    run.tags = tuple(ident["tags"])
    if ident["group"]:
        try:
            run.group = ident["group"]
        except Exception:
            pass
    run.config.update({"titan_ledger": {**info, "wandb_step_start": w.wb_step + 1}}, allow_val_change=True)
    run.define_metric(STEP_KEY)
    run.define_metric(TOKENS_KEY, step_metric=STEP_KEY)
    run.define_metric("*", step_metric=STEP_KEY)
    for key, summary in SUMMARIES.items():
        run.define_metric(key, step_metric=STEP_KEY, summary=summary)
    for f in [info.get("config_file"), *info.get("overlays", [])]:
        if f and Path(f).is_file():
            dest = Path(run.dir) / ("config_" + Path(f).name if not str(f).endswith(".toml") else Path(f).name)
            shutil.copyfile(f, dest)
            run.save(str(dest), base_path=run.dir, policy="now")


def config_text(config, info: dict[str, Any]) -> dict[str, str]:
    """TensorBoard text entries: the TOML file, the ledger identity, the full config."""
    out = {}
    f = info.get("config_file")
    if f and Path(f).is_file():
        out["config/toml"] = f"{f}\n\n" + _code(Path(f).read_text())
    out["config/titan_ledger"] = _code(json.dumps(info, indent=1, default=str))
    try:
        full = json.dumps(config.to_dict(), indent=1, default=repr, sort_keys=True)
    except Exception:
        full = repr(config)
    out["config/full"] = _code(full[:200_000])
    return out


def _code(text: str) -> str:
    """A markdown code block (TensorBoard renders text summaries as markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def _answer(ev: dict[str, Any]):
    """The incident's answer recorded in its event (``format.answers.Answer``), or None."""
    from titan_ledger.format.answers import Answer

    return Answer.of(ev["answer"]) if isinstance(ev.get("answer"), dict) else None


def _incident_text(ev: dict[str, Any], row: dict[str, Any]) -> str:
    """A flagged step in words: its answer (three lines and the command), then its signals;
    an event without an answer (not rank 0's) says its rules and proof."""
    a = _answer(ev)
    signals = (f"loss {_fmt(row.get('loss'))} (worst DP rank {row.get('loss_max_rank')}: {_fmt(row.get('loss_max'))}), "
               f"grad norm {_fmt(row.get('grad_norm'))} (window median {_fmt(ev.get('grad_norm_median'))}); rules "
               f"{', '.join(ev.get('rules', []))}; action {ev.get('action')}")
    if a is not None:
        return "\n".join(a.lines() + (["  run it: " + a.command] if a.command else []) + ["  signals: " + signals])
    return f"step {row['step']}: {signals}" + (f"; {_proof_line(ev['proof'])}" if ev.get("proof") else "")


def answer_scalars(ev: dict[str, Any]) -> dict[str, float]:
    """The answer as dashboard scalars: ``answer/cause_<cause>`` (the one cause; none when not
    established), ``answer/established_<how>``, ``answer/fix_measured`` (a fix the window
    measured removed or lowered it)."""
    a = _answer(ev)
    if a is None:
        return {}
    out = {f"answer/established_{a.established.replace('+', '_')}": 1.0,
           "answer/fix_measured": float(a.fix is not None)}
    if a.cause:
        out[f"answer/cause_{a.cause}"] = 1.0
    return out


def _proof_line(proof: dict[str, Any]) -> str:
    from titan_ledger.format.proofs import describe_proof

    return describe_proof(proof)


def proof_scalars(proof: dict[str, Any] | None) -> dict[str, float]:
    """A proof as dashboard scalars (:meth:`titan_ledger.format.proofs.Proof.scalars`: the
    verdict, the cause it proves, executions, seconds, acted, held back, Adam's
    amplification); empty without a proof."""
    if not proof:
        return {}
    from titan_ledger.format.proofs import Proof

    return Proof.of(proof).scalars()


def log_spike(metrics_logger, row: dict[str, Any], ev: dict[str, Any]) -> None:
    """A flagged step: ``spike/*`` and ``proof/*`` scalars on every dashboard, an alert and a
    table row on W&B (the proof's verdict, what it applied, what it would have), the event
    and its proof as TensorBoard text."""
    if metrics_logger is None:
        return
    from titan_ledger.components.detection.spikes import RULES

    metrics_logger.log({"spike/flag": 1.0, **{f"spike/{r}": float(r in ev["rules"]) for r in RULES},
                        "spike/loss": float(row["loss"]), "spike/grad_norm": float(row["grad_norm"]),
                        "spike/loss_max_rank": float(row["loss_max_rank"]), **proof_scalars(ev.get("proof")),
                        **answer_scalars(ev)}, row["step"])
    for x in _ours(metrics_logger):
        x.spike(row, ev)


def log_answer(metrics_logger, ev: dict[str, Any]) -> None:
    """An incident answered outside a flag (a stall's window proof, in its forced proof's
    event): its ``answer/*`` scalars at the stall's step, its alert and text."""
    a = _answer(ev)
    if metrics_logger is None or a is None:
        return
    metrics_logger.log(answer_scalars(ev), a.step)
    for x in _ours(metrics_logger):
        x.answer(a)


def log_note(metrics_logger, row: dict[str, Any], ev: dict[str, Any]) -> None:
    """A note (weaker evidence, no acting rule): ``note/*`` scalars and its proof's
    ``proof/*`` (TensorBoard: the proof in words), no alert."""
    if metrics_logger is None:
        return
    from titan_ledger.components.detection.spikes import RULES

    metrics_logger.log({"note/flag": 1.0, **{f"note/{r}": 1.0 for r in ev["notes"] if r in RULES},
                        **proof_scalars(ev.get("proof"))}, row["step"])
    if ev.get("proof"):
        for x in _ours(metrics_logger):
            if isinstance(x, LedgerTensorBoard):
                x.proof(int(row["step"]), ev["proof"])


def log_rewind(metrics_logger, *, from_step: int, to_step: int, window: tuple[int, int]) -> None:
    for x in _ours(metrics_logger):
        x.rewind(from_step=from_step, to_step=to_step, window=window)


def alert(metrics_logger, title: str, text: str, level: str = "ERROR") -> None:
    """An alert of the response itself (the circuit breaker's pause, a stall): W&B's alert,
    and the text in TensorBoard (``response/events``)."""
    for x in _ours(metrics_logger):
        if isinstance(x, LedgerWandB):
            x._alert(title, text, level)
        elif isinstance(x, LedgerTensorBoard):
            x.writer.add_text("response/events", text, int(x.last_step or 0))


def log_stop(metrics_logger, err: BaseException | str, exit_code: int = 1) -> None:
    """Training stopped by an exception: ERROR alert, ``finish(exit_code)`` at close."""
    reason = err if isinstance(err, str) else (f"{type(err).__name__}: {err}".strip() or type(err).__name__)
    for x in _ours(metrics_logger):
        try:
            x.stop(reason, exit_code)
        except Exception:
            pass
