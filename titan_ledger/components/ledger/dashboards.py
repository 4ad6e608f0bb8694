"""W&B and TensorBoard, done for an operator: monotonic W&B steps through rollbacks and
relaunches, run identity, summaries, alerts, a spike table, TensorBoard layouts.

Design decisions.

*One face, two writers.* The trainer and the ledger call this module only (``prepare``,
``attach``, ``log_spike``, ``alert``, ...); what each dashboard does with an event is its
writer's, :mod:`titan_ledger.components.ledger.dashboard_writers` (``LedgerWandB``,
``LedgerTensorBoard``: the W&B step counter, the TensorBoard sub-runs, the layout, the
duplicated series dropped). Here: the run's identity before and at the build, the
writers put in torchtitan's place, and each event fanned out to them.

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

*Ends.* A stop by a non-finite loss, by the ledger (``[ledger.rollback] limit``) or any other
exception raises an ERROR alert and ends the run with ``finish(exit_code=1)``.
Spikes raise a WARN alert each and are appended to the ``spike/events`` table; notes
(the weaker tier, :mod:`titan_ledger.components.detection.spikes`) are ``note/*`` scalars only.

Only the rank torchtitan logs metrics from has a W&B run / TB writer; every function
here is a no-op elsewhere (their ``metrics_logger`` is a bare ``BaseLogger``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from titan_ledger.components.ledger.dashboard_writers import (
    STEP_KEY,
    TOKENS_KEY,
    LedgerTensorBoard,
    LedgerWandB,
    answer_of,
    code_block,
    read_state,
    write_state,
)
from titan_ledger.format import signal_columns

STATE_FILE = "wandb.json"

#: W&B summaries (``define_metric(summary=...)``): the signal columns' (a column's
#: ``summary`` in format/signal_columns.py), then the response's counters
SUMMARIES = {**signal_columns.SUMMARIES, "spike/count": "max", "rollback/count": "max"}


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


def writers(metrics_logger) -> list:
    """The ledger's dashboard writers on ``metrics_logger`` (W&B, TensorBoard); [] when none."""
    return _ours(metrics_logger) if metrics_logger is not None else []


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
        out["config/toml"] = f"{f}\n\n" + code_block(Path(f).read_text())
    out["config/titan_ledger"] = code_block(json.dumps(info, indent=1, default=str))
    try:
        full = json.dumps(config.to_dict(), indent=1, default=repr, sort_keys=True)
    except Exception:
        full = repr(config)
    out["config/full"] = code_block(full[:200_000])
    return out


def answer_scalars(ev: dict[str, Any]) -> dict[str, float]:
    """The answer as dashboard scalars: ``answer/cause_<cause>`` (the one cause; none when not
    established), ``answer/established_<how>``, ``answer/fix_measured`` (a fix the window
    measured removed or lowered it)."""
    a = answer_of(ev)
    if a is None:
        return {}
    out = {f"answer/established_{a.established.replace('+', '_')}": 1.0,
           "answer/fix_measured": float(a.fix is not None)}
    if a.cause:
        out[f"answer/cause_{a.cause}"] = 1.0
    return out


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
    from titan_ledger.components.detection.spike_rules import RULES

    metrics_logger.log({"spike/flag": 1.0, **{f"spike/{r}": float(r in ev["rules"]) for r in RULES},
                        "spike/loss": float(row["loss"]), "spike/grad_norm": float(row["grad_norm"]),
                        "spike/loss_max_rank": float(row["loss_max_rank"]), **proof_scalars(ev.get("proof")),
                        **answer_scalars(ev)}, row["step"])
    for x in _ours(metrics_logger):
        x.spike(row, ev)


def log_answer(metrics_logger, ev: dict[str, Any]) -> None:
    """An incident answered outside a flag (a stall's window proof, in its forced proof's
    event): its ``answer/*`` scalars at the stall's step, its alert and text."""
    a = answer_of(ev)
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
    from titan_ledger.components.detection.spike_rules import RULES

    metrics_logger.log({"note/flag": 1.0, **{f"note/{r}": 1.0 for r in ev["notes"] if r in RULES},
                        **proof_scalars(ev.get("proof"))}, row["step"])
    if ev.get("proof"):
        for x in _ours(metrics_logger):
            if isinstance(x, LedgerTensorBoard):
                x.proof(int(row["step"]), ev["proof"])


def log_episodes(metrics_logger, eps: list) -> None:
    """The run's episodes at its end (``format.answers.episodes``): W&B's run summary and an
    ``episodes/table``, TensorBoard's ``episodes`` text."""
    for x in _ours(metrics_logger):
        x.episodes(eps)


def log_rewind(metrics_logger, *, from_step: int, to_step: int, window: tuple[int, int]) -> None:
    for x in _ours(metrics_logger):
        x.rewind(from_step=from_step, to_step=to_step, window=window)


def alert(metrics_logger, title: str, text: str, level: str = "ERROR") -> None:
    """An alert of the response itself (the circuit breaker's pause, a stall): W&B's alert,
    and the text in TensorBoard (``response/events``)."""
    for x in _ours(metrics_logger):
        x.alert(title, text, level)


def log_stop(metrics_logger, err: BaseException | str, exit_code: int = 1) -> None:
    """Training stopped by an exception: ERROR alert, ``finish(exit_code)`` at close."""
    reason = err if isinstance(err, str) else (f"{type(err).__name__}: {err}".strip() or type(err).__name__)
    for x in _ours(metrics_logger):
        try:
            x.stop(reason, exit_code)
        except Exception:
            pass
