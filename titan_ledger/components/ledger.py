"""The ``[ledger]`` section and the ledger components one run uses.

Design decision: one Configurable, ``Ledger``, owns the ``ledger`` config section
(torchtitan's pattern: nested ``@dataclass(kw_only=True, slots=True) Config``,
attribute docstrings as ``--help``, checks in ``__post_init__`` so a bad value
fails when the config is parsed, before any process group). At run time it is a
thin composition of three components, each built from a :class:`Topology` and
unit-testable in-process without torchrun:

* :class:`~titan_ledger.components.recorder.SignalRecorder` -- per-step signals, one
  collective, written a step late (``signals.jsonl``, ``rank<r>.jsonl``);
* :class:`~titan_ledger.components.data_writer.DataLedgerWriter` -- the data ledger
  (``data_dp<r>.jsonl``);
* :class:`~titan_ledger.components.guard.SpikeGuard` -- the spike rules, events, and the
  host read the update guard / rollback need.

``Ledger`` itself owns what spans them: the run id and segment numbering (one
``seq`` per launch or rewind, from the launch log ``segments.jsonl``), the skip
windows, rewinds, and the checkpointed counters. ``LedgerTrainer`` calls it at
``open`` (first step), ``record`` (after the clip, before ``optimizers.step``),
``drain`` and ``close``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.profiler import record_function
from torchtitan.config import Configurable

from titan_ledger.components.attention import MaxLogitRecorder, forget_pp_metadata_inference
from titan_ledger.components.counterfactual import parse_overrides
from titan_ledger.components.data_writer import DataLedgerWriter
from titan_ledger.components.guard import Ladder, SpikeGuard, parse_ladder
from titan_ledger.components.recorder import SignalRecorder
from titan_ledger.components.signals import ParamPlan, natural_key
from titan_ledger.components.spikes import SpikeDetector
from titan_ledger.components.topology import Topology
from titan_ledger.data.filters import Quarantine
from titan_ledger.data.layout import RowTag, parse_skip_steps, window_at
from titan_ledger.errors import ConfigError, TitanLedgerError
from titan_ledger.format import records
from titan_ledger.format.reader import RunLedger
from titan_ledger.rehearsal.faults import parse_inject

# ---------------------------------------------------------------------------- sections
# Design decision: the [ledger] table groups its fields by what they control, each
# group a nested dataclass (torchtitan's own nesting: ``--ledger.skip.steps``); the flat
# names of earlier releases (``--ledger.skip_steps``, ``[ledger] inject = ...``) keep
# working through RENAMED, which the TOML front end and the tools apply.


@dataclass(kw_only=True, slots=True)
class DocLossConfig:
    enable: bool = True
    """Per-document loss: attribute each token's loss to its document segment (in the
    loss torchtitan already computes; no extra forward) and write each DP rank's
    ``k`` highest- and lowest-loss segments per step to the data ledger."""

    k: int = 4
    """Segments kept per DP rank and step at each end (highest and lowest mean loss)."""

    min_tokens: int = 16
    """Segments with fewer label tokens are not ranked (their mean loss is noise)."""

    def __post_init__(self) -> None:
        if self.k < 1 or self.min_tokens < 1:
            raise ConfigError(f"--ledger.doc_loss.k and --ledger.doc_loss.min_tokens must be >= 1 "
                              f"(got {self.k}, {self.min_tokens})")


@dataclass(kw_only=True, slots=True)
class FilterConfig:
    quarantine: list[str] = field(default_factory=list)
    """Quarantine files: one ``{"source": ..., "doc": ...}`` per line (``lookup --json``
    names documents this way; ``diagnose --write-quarantine`` writes them). Those
    documents' tokens are loss-masked wherever they appear; the sample sequence is
    unchanged, so adding a file when resuming after a spike is not a data change."""

    repetition: bool = False
    """Mask document segments holding an n-gram repeated ``repetition_min`` times in
    a row (OLMo-core's instance filter rule), counted per step in the ledgers."""

    repetition_min: int = 32
    """Repetition filter: repeats of one n-gram that mask its segment."""

    repetition_max_period: int = 13
    """Repetition filter: the longest n-gram period checked (1 = one token repeated)."""

    def __post_init__(self) -> None:
        if self.repetition_min < 2 or self.repetition_max_period < 1:
            raise ConfigError(f"--ledger.filter.repetition_min must be >= 2 and "
                              f"--ledger.filter.repetition_max_period >= 1 (got {self.repetition_min}, "
                              f"{self.repetition_max_period})")
        Quarantine(self.quarantine)  # the files exist and parse


@dataclass(kw_only=True, slots=True)
class SkipConfig:
    steps: list[str] = field(default_factory=list)
    """Steps whose data is consumed without forward/backward or update: absolute,
    1-indexed, inclusive ranges or single steps, e.g. ``["137000-137300", "140001"]``
    (on the command line also comma-separated). Needs LedgerDataLoader."""

    lr: Literal["freeze", "advance"] = "freeze"
    """LR schedule over skipped steps: ``freeze`` (Megatron: the schedule does not
    advance) or ``advance`` (as if the steps had trained)."""

    auto: bool = False
    """Add the steps listed in ``<dump_folder>/ledger/rejected_steps.jsonl`` (every
    flagged step of earlier launches) to ``steps`` (Megatron's tracker-file flow)."""

    def __post_init__(self) -> None:
        parse_skip_steps(self.steps)  # raises SkipError naming the entry


@dataclass(kw_only=True, slots=True)
class OnSpikeConfig:
    action: str = "none"
    """What a flagged step does: ``none`` (record it), ``skip_update`` (do not apply
    its optimizer update; Adam's step count does not advance; costs one
    device->host read of the flag per step), ``rollback`` (reload the last
    checkpoint at or before step - rollback_back, skip rollback_skip steps from
    there and continue in the same process), ``rollback_lr:X`` (the same, and the
    LR scaled by X from then on), ``stop`` (stop with a report, exit 1). One action
    repeats without limit (rollbacks capped by max_rollbacks); a comma-separated
    **ladder** escalates when a spike repeats within ``ladder_horizon`` steps, each
    rung ``*N`` attempts (default 1), e.g. ``skip_update*2,rollback,rollback_lr:0.5,stop``;
    past the last rung the run stops. Every decision is recorded in spikes.jsonl."""

    ladder_horizon: int = 100
    """A spike within this many steps of the previous one is a repeat (next attempt
    or next rung); after a quiet horizon the ladder starts again at its first rung."""

    rollback_back: int = 100
    """Rollbacks: go back to a checkpoint at or before spike - this many steps."""

    rollback_skip: int = 200
    """Rollbacks: steps skipped from the checkpoint on (the window is widened to
    reach the spike step)."""

    max_rollbacks: int = 3
    """Rollbacks: stop with an error after this many rewinds in one run."""

    def __post_init__(self) -> None:
        parse_ladder(self.action)  # raises ConfigError naming the rung
        if self.ladder_horizon < 1:
            raise ConfigError(f"--ledger.on_spike.ladder_horizon must be >= 1, got {self.ladder_horizon}")
        for name in ("rollback_back", "max_rollbacks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--ledger.on_spike.{name} must be >= 0, got {getattr(self, name)}")
        if self.rollback_skip < 1:
            raise ConfigError(f"--ledger.on_spike.rollback_skip must be >= 1, got {self.rollback_skip}")


@dataclass(kw_only=True, slots=True)
class RehearsalConfig:
    inject: str = ""
    """Rehearsal only: ``STEP:DP_RANK:KIND`` replaces that DP rank's batch at that step
    by a single repeated token (``repeat``) or uniform random tokens (``random``);
    see ``python -m titan_ledger.replay inject``. ``bitflip`` (a hardware-fault
    rehearsal, :mod:`titan_ledger.rehearsal.faults`) flips one exponent bit of one gradient
    element on that DP rank after the backward, before the clip; ``swap`` makes every DP
    rank r train on rank (r+1) % dp's batch at that step (the rank is ignored; write 0).
    Comma-separated specs combine one data kind with faults, e.g. ``8:1:repeat,11:0:bitflip``."""

    rerun: str = ""
    """Set by ``python -m titan_ledger.replay rerun`` only (:mod:`titan_ledger.components.counterfactual`):
    ``stop=N`` ends training after step N (the LR schedule still spans
    ``--training.steps``), ``lr_scale=X`` / ``eps=X`` override the checkpoint's
    learning rate (scaled) and Adam epsilon from the first step on, e.g.
    ``stop=9,lr_scale=0.5``."""

    def __post_init__(self) -> None:
        parse_inject(self.inject)
        parse_overrides(self.rerun)  # raises ConfigError naming the entry


#: Flat ``[ledger]`` names of earlier releases -> their nested path (TOML keys and flags).
RENAMED: dict[str, str] = {
    "doc_loss": "doc_loss.enable", "doc_loss_k": "doc_loss.k", "doc_loss_min_tokens": "doc_loss.min_tokens",
    "quarantine": "filter.quarantine", "repetition_filter": "filter.repetition",
    "repetition_min": "filter.repetition_min", "repetition_max_period": "filter.repetition_max_period",
    "skip_steps": "skip.steps", "skip_lr": "skip.lr", "auto_skip": "skip.auto",
    "on_spike": "on_spike.action", "ladder_horizon": "on_spike.ladder_horizon",
    "rollback_back": "on_spike.rollback_back", "rollback_skip": "on_spike.rollback_skip",
    "max_rollbacks": "on_spike.max_rollbacks", "inject": "rehearsal.inject", "rerun": "rehearsal.rerun",
}
#: ... of which these are booleans (``--ledger.no_doc_loss`` -> ``--ledger.doc_loss.no_enable``).
RENAMED_BOOLS = ("doc_loss", "repetition_filter", "auto_skip")


def renamed_flags() -> dict[str, str]:
    """Old command-line spelling -> new, bool negations included."""
    out = {f"--ledger.{old}": f"--ledger.{new}" for old, new in RENAMED.items()}
    for old in RENAMED_BOOLS:
        head, _, last = RENAMED[old].rpartition(".")
        out[f"--ledger.no_{old}"] = f"--ledger.{head}.no_{last}"  # (hyphens: alias_cli folds them)
    return out



class Ledger(Configurable):
    """Per-step signals: computed on device, reduced packed, written a step late."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        device: Literal["auto", "cpu", "cuda"] = "auto"
        """
        Compute backend. ``auto`` uses CUDA when a GPU is visible and otherwise the
        CPU rehearsal backend (gloo collectives, CPU masked attention, FSDP sum
        reduction). ``cpu`` forces the rehearsal backend on a GPU machine. It is
        read before torchtitan is imported, so set it in the TOML ``[ledger]``
        section or as ``--ledger.device`` on the ``titan_ledger.train`` command line
        (or with the ``TITAN_LEDGER_DEVICE`` environment variable).
        """

        signals: bool = True
        """Record the signals ledger (<dump_folder>/ledger/signals.jsonl) every step."""

        max_logit: bool = True
        """Record the max pre-softmax attention logit (Flex max_scores on GPU)."""

        per_layer: bool = False
        """Also record the pre-clip grad norm of each layer (``grad_norm_per_layer``)."""

        doc_loss: DocLossConfig = field(default_factory=lambda: DocLossConfig())
        """Per-document loss (``[ledger.doc_loss]``)."""

        filter: FilterConfig = field(default_factory=lambda: FilterConfig())
        """Document masks: quarantine files and the repetition filter (``[ledger.filter]``)."""

        folder: str = "ledger"
        """Ledger folder, relative to ``dump_folder``."""

        skip: SkipConfig = field(default_factory=lambda: SkipConfig())
        """Steps whose data is consumed without training (``[ledger.skip]``)."""

        allow_data_change: bool = False
        """Resume even if the checkpoint's data fingerprint (source, tokenizer,
        seq_len, seed) differs from this run's."""

        new_run: bool = False
        """A dump folder belongs to one run configuration: a launch whose data layout
        (seq_len, global batch, data fingerprint) differs from the run already recorded
        in ``dump_folder`` is refused, unless this is set; then the old ledger and
        checkpoint folders are renamed ``<folder>.old-<n>`` and a new run starts. A
        relaunch of the new run (same layout) resumes it as usual, flag or not."""

        spike: SpikeDetector.Config = field(default_factory=SpikeDetector.Config)
        """Spike rules on loss and grad norm (on device, every step)."""

        on_spike: OnSpikeConfig = field(default_factory=lambda: OnSpikeConfig())
        """What a flagged step does: the action or recovery ladder and its limits
        (``[ledger.on_spike]``)."""

        rehearsal: RehearsalConfig = field(default_factory=lambda: RehearsalConfig())
        """Fault injection and counterfactual reruns (``[ledger.rehearsal]``); rehearsal only."""

        def __post_init__(self) -> None:
            # every check that needs no trainer runs here, when the flags are parsed
            # (each section checks its own fields; these are the cross-section ones)
            if any(r.action != "none" for r in parse_ladder(self.on_spike.action)) \
                    and not (self.signals and self.spike.enable):
                raise ConfigError(f"--ledger.on_spike.action {self.on_spike.action} needs --ledger.signals "
                                  f"and --ledger.spike.enable")
            if not self.folder or Path(self.folder).is_absolute() or ".." in Path(self.folder).parts:
                raise ConfigError(f"--ledger.folder {self.folder!r}: give a folder name inside "
                                  f"--dump_folder, e.g. ledger")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.enabled = False  # until setup() binds a trainer
        self.skip_windows = parse_skip_steps(config.skip.steps)
        self.inject = parse_inject(config.rehearsal.inject)
        self.topo = Topology.single()
        self.recorder: SignalRecorder | None = None
        self.data: DataLedgerWriter | None = None
        self.guard: SpikeGuard | None = None
        self.loader = None  # a LedgerDataLoader, when the run uses one
        self.rewinds = 0
        self._state: dict[str, Any] = {}  # loaded before setup (checkpoint load order)
        self._seq = 0
        self._keep_ladder = False  # an in-process rollback keeps the ladder's own history
        self._step_tags: tuple | None = None  # (tags, injected, masked) until the step's row is queued
        self.doc_loss = None  # a DocLossTracker (set by the trainer when the loss is tracked)
        self.logz = None  # a LogZStats (set by the trainer when the loss is titan_ledger's)
        self.qk_clip = None  # a QKClip when [qk_clip] enable (built in setup)
        self.quarantine = Quarantine(config.filter.quarantine)
        self.ladder = Ladder(parse_ladder(config.on_spike.action), config.on_spike.ladder_horizon)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        """Bind to a built trainer (after model, optimizer and dataloader exist)."""
        from titan_ledger.data.loader import LedgerDataLoader

        cfg = self.config
        self.enabled = cfg.signals
        self.topo = topo = Topology.from_trainer(trainer)
        self.device = trainer.device
        loader = trainer.dataloader
        self.loader = loader if isinstance(loader, LedgerDataLoader) else None
        self.folder = Path(trainer.config.dump_folder) / cfg.folder
        self.global_batch = (trainer.config.training.local_batch_size * topo.dp_size
                             * trainer.gradient_accumulation_steps)
        steps = trainer.config.training.steps
        if cfg.skip.auto:
            rejected = RunLedger(trainer.config.dump_folder, cfg.folder).rejected_steps() \
                if self.folder.exists() else []
            self.skip_windows = parse_skip_steps(
                [f"{a}-{b}" for a, b in self.skip_windows] + [str(t) for t in rejected])
        if self.ladder.rolls_back and not trainer.config.checkpoint.enable:
            raise ConfigError(f"--ledger.on_spike.action {cfg.on_spike.action}: a rollback reloads checkpoints: set "
                              f"--checkpoint.enable")
        if (self.quarantine or cfg.filter.repetition) and (self.loader is None or not self.loader.tagging):
            raise ConfigError("--ledger.filter.quarantine and --ledger.filter.repetition mask documents by the "
                              "rows' provenance: they need LedgerDataLoader with --dataloader.tagging")
        if self.skip_windows and self.loader is None:
            raise ConfigError("--ledger.skip.steps needs LedgerDataLoader (a titan_ledger config "
                              "function such as debug_cpu); this run's dataloader is "
                              f"{type(loader).__name__}")
        late = [w for w in self.skip_windows if w[0] > steps and not cfg.skip.auto]
        if late:
            raise ConfigError(f"--ledger.skip.steps {late[0][0]}-{late[0][1]} starts after the last "
                              f"step (--training.steps {steps}): it would skip nothing")
        if self.inject is not None and self.inject[1] >= topo.dp_size:
            raise ConfigError(f"--ledger.rehearsal.inject {cfg.rehearsal.inject}: DP rank {self.inject[1]} does not exist "
                              f"(this run has DP ranks 0-{topo.dp_size - 1})")
        if self.inject is not None and self.inject[0] > steps:
            raise ConfigError(f"--ledger.rehearsal.inject {cfg.rehearsal.inject}: step {self.inject[0]} is after the last "
                              f"step (--training.steps {steps})")
        # rank 0 checks that the dump folder holds this run (or moves another run aside);
        # then one run id for all ranks (rank 0's) and the next segment number, agreed once
        claim_error = None
        if topo.is_rank0 and trainer.config.comm.mode != "fake_backend":
            layout = {"seq_len": trainer.config.training.seq_len, "global_batch": self.global_batch}
            if self.loader is not None:
                layout["fingerprint"] = self.loader.fingerprint
            try:
                moved = claim_dump_folder(trainer.config.dump_folder, cfg.folder, layout,
                                          new_run=cfg.new_run, allow_data_change=cfg.allow_data_change,
                                          checkpoint_folder=trainer.config.checkpoint.folder,
                                          checkpoint_enabled=trainer.config.checkpoint.enable)
                if moved:
                    from torchtitan.tools.logging import logger

                    logger.warning(f"titan_ledger: --ledger.new_run: the earlier run of another layout "
                                   f"was moved aside to {', '.join(moved)}")
            except ConfigError as e:
                claim_error = str(e)
        agreed = [uuid.uuid4().hex[:12], records.next_seq(self.folder) if topo.is_rank0 else 0,
                  claim_error]
        if dist.is_initialized():
            dist.broadcast_object_list(agreed, src=0)
        if agreed[2] is not None:  # every rank stops with rank 0's line
            raise ConfigError(agreed[2])
        self.run_id, self._seq = agreed[0], int(agreed[1]) - 1
        self.config_digest = _digest(trainer.config)
        # the compute dtype of the parameters: diagnose's precision question needs it
        # (a one-step glitch in an fp32 run cannot be bf16 rounding)
        self.param_dtype = str(trainer.config.training.mixed_precision_param)
        self.precision = precision_audit(trainer, topo.is_rank0)
        from titan_ledger.components.optimizer import describe_groups

        # the optimizer's parameter groups and their weight decay (the no_decay presets)
        self.param_groups = describe_groups(trainer.optimizers)
        if self.loader is not None and self.loader.tagging:
            self.data = DataLedgerWriter(topo, self.loader, global_batch=self.global_batch,
                                         skip_lr=cfg.skip.lr,
                                         tokenizer=str(Path(trainer.config.hf_assets_path).resolve()))
        if not self.enabled:
            if getattr(getattr(trainer.config, "qk_clip", None), "enable", False):
                raise ConfigError("--qk_clip.enable reads the ledger's per-head max logits: it needs "
                                  "--ledger.signals (drop --ledger.no_signals)")
            return
        named = [(n, p) for m in trainer.model_parts for n, p in m.named_parameters()]
        groups = None
        if cfg.per_layer:
            local_groups = ParamPlan.build(named, topo.world, topo.pp_size).groups
            gathered: list[list[str]] = [None] * topo.world  # type: ignore[list-item]
            if dist.is_initialized():
                dist.all_gather_object(gathered, local_groups)  # once, at setup
            else:
                gathered = [local_groups]
            groups = sorted({g for gs in gathered for g in gs}, key=natural_key)
        plan = ParamPlan.build(named, topo.world, topo.pp_size, groups)
        plan.group_index = plan.group_index.to(self.device)  # no H2D copy per step
        attn = [m for part in trainer.model_parts for m in part.modules() if isinstance(m, MaxLogitRecorder)]
        for m in attn:
            m.record_max_logit = cfg.max_logit
        qk_cfg = getattr(trainer.config, "qk_clip", None)
        if qk_cfg is not None and qk_cfg.enable:
            if not cfg.max_logit:
                raise ConfigError("--qk_clip.enable reads the ledger's max attention logits: drop "
                                  "--ledger.no_max_logit (or --qk_clip.enable)")
            from torchtitan.models.common.attention import GQAttention

            from titan_ledger.components.qk_clip import QKClip

            pd = trainer.parallel_dims
            self.qk_clip = QKClip(qk_cfg, trainer.model_parts,
                                  n_layers=sum(1 for _ in trainer.config.model_spec.model.traverse(GQAttention.Config)),
                                  tp_rank=topo.tp_rank, tp_size=pd.tp if pd.tp_enabled else 1)
        if trainer.parallel_dims.pp_enabled:
            forget_pp_metadata_inference(trainer.pp_schedule, attn,
                                         also=[x.rewind_step for x in (self.doc_loss, self.logz) if x])
        self.recorder = SignalRecorder(
            topo, device=self.device, plan=plan, attn=attn, per_layer=cfg.per_layer,
            max_logit=cfg.max_logit, max_norm=float(trainer.config.training.max_norm),
            global_batch=self.global_batch, seq_len=trainer.config.training.seq_len,
            doc_loss=self.doc_loss, logz=self.logz, qk_clip=self.qk_clip)
        if cfg.spike.enable:
            self.guard = SpikeGuard(topo, cfg.spike, cfg.on_spike.action, self.device)
        self._apply_state()

    # ------------------------------------------------------------------ segments
    def open(self, resumed_from: int, rewind_from: int | None = None) -> None:
        """Start this segment in every ledger file (after the checkpoint load)."""
        self._seq += 1
        header = records.Header(schema="", run_id=self.run_id, seq=self._seq, resumed_from=resumed_from,
                                time=time.time(),
                                extra={"config_digest": self.config_digest, "world_size": self.topo.world,
                                       "dp_size": self.topo.dp_size, "param_dtype": self.param_dtype,
                                       "precision": self.precision, "param_groups": self.param_groups,
                                       **_LAUNCH})
        if self.quarantine:
            # recorded, not refused: quarantining documents after a spike is the normal use
            header.extra["quarantine"] = {"files": self.quarantine.paths, "digest": self.quarantine.digest,
                                          "documents": len(self.quarantine.docs)}
        if self.config.filter.repetition:
            header.extra["repetition_filter"] = {"min_repeats": self.config.filter.repetition_min,
                                                 "max_period": self.config.filter.repetition_max_period}
        if rewind_from is not None:
            # a rewind is a new segment of the same process: its own run id and seq
            header.run_id = f"{self.run_id}.r{self.rewinds}"
            header.extra["rewind_from"] = rewind_from
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.topo.is_rank0:
            records.append_segment(self.folder, header)
        if self.data is not None:
            self.data.open(self.folder, header, self.skip_windows)
        if self.recorder is not None:
            self.recorder.open(self.folder, header)
        if self.guard is not None:
            self.guard.open(self.folder, header)

    def close(self) -> None:
        for c in (self.recorder, self.data, self.guard):
            if c is not None:
                c.close()

    # ------------------------------------------------------------------ per step
    def record(self, *, step: int, local_loss_sum: torch.Tensor | None, local_tokens: int,
               grad_norm: torch.Tensor, lr: float, step_start: float, data_loading_s: float,
               masked_tokens: int = 0) -> None:
        """Reduce this step's signals (one collective), run the spike rules, queue the row.

        Call after ``clip_grad_norm_`` and before ``optimizers.step()``: zeros and
        norms are read from the gradients about to be applied. No host read.
        """
        if self.recorder is None:
            return
        with record_function("titan_ledger.signals"):
            red = self.recorder.reduce(local_loss_sum=local_loss_sum, local_tokens=local_tokens,
                                       grad_norm=grad_norm, masked_tokens=masked_tokens)
            reduced = red.vector
        stats = self.guard.observe(red, grad_norm) if self.guard is not None else None
        tags, injected, masked = self._step_tags or (None, None, None)
        self._step_tags = None
        with record_function("titan_ledger.signals"):
            self.recorder.queue(step=step, reduced=reduced, extra=stats, lr=lr, step_start=step_start,
                                data_loading_s=data_loading_s, tags=tags, injected=injected, masked=masked)

    def after_update(self, applied: bool) -> None:
        """After ``optimizers.step()``: QK-clip scales the Q/K rows of the groups this step's
        logits put over the threshold (not when the guard rejected the update)."""
        if self.qk_clip is not None:
            if applied:
                with record_function("titan_ledger.qk_clip"):
                    self.qk_clip.apply()
            self.qk_clip.head_max = None

    def spike_flag_now(self) -> bool:
        return self.guard.flag_now() if self.guard is not None else False

    def record_action(self, rec: dict) -> None:
        if self.guard is not None:
            self.guard.record_action(rec)

    def mark_update_skipped(self) -> None:
        self.recorder.mark_update_skipped()

    def drain(self, block: bool, metrics_logger=None) -> None:
        if self.recorder is None:
            return
        on_row = None
        if self.guard is not None:
            guard = self.guard

            def on_row(row, stats):
                guard.on_row(row, stats, metrics_logger)
        self.recorder.drain(block, metrics_logger, on_row,
                            self.data.record if self.data is not None else None)

    # ------------------------------------------------------------------ data ledger, skips
    def skip_window_at(self, step: int) -> tuple[int, int] | None:
        return window_at(self.skip_windows, step)

    def record_data(self, step: int, tags: list[RowTag], injected: str | None = None,
                    masked: dict | None = None) -> None:
        """This DP rank's rows of ``step``. With signals on, the row is written when the
        step's signals are (a step late on GPU), carrying its per-document losses."""
        if self.data is None or not self.data.active:
            return
        if self.recorder is not None:
            self._step_tags = (tags, injected, masked)
        else:
            self.data.record(step, tags, injected, masked=masked)

    def record_skip(self, *, first: int, last: int, info, lr: float, step_start: float,
                    metrics_logger=None) -> None:
        """A skipped window: data consumed, no forward/backward, no update; one data row
        per DP rank and one signals row for the whole window."""
        self.drain(block=True, metrics_logger=metrics_logger)  # rows stay in step order
        if self.data is not None:
            self.data.record_skip(first=first, last=last, info=info)
        if self.recorder is not None:
            self.recorder.record_skip(first=first, last=last, n_samples=info.position_after - info.position_before,
                                      lr=lr, step_start=step_start, skip_lr=self.config.skip.lr,
                                      metrics_logger=metrics_logger)

    def rewind(self, *, from_step: int, to_step: int, window: tuple[int, int], metrics_logger=None) -> None:
        """In-process rollback: close this segment, open one that supersedes rows after
        ``to_step`` (readers treat it like a relaunch that resumed there)."""
        self.drain(block=True, metrics_logger=metrics_logger)
        if self.guard is not None:
            self.guard.record_rewind(from_step=from_step, to_step=to_step, window=window)
        self.close()
        self.rewinds += 1
        self.skip_windows = parse_skip_steps(
            [f"{a}-{b}" for a, b in self.skip_windows] + [f"{window[0]}-{window[1]}"])
        self.open(resumed_from=to_step, rewind_from=from_step)

    def summary(self) -> dict[str, Any]:
        """What this process wrote (for the end-of-run summary)."""
        return {"folder": str(getattr(self, "folder", "")), "run_id": getattr(self, "run_id", None),
                "signal_rows": self.recorder.rows_written if self.recorder else 0,
                "data_rows": self.data.rows_written if self.data else 0,
                "spikes": self.guard.flagged if self.guard else 0, "rewinds": self.rewinds}

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        state = self.recorder.state_dict() if self.recorder else dict(self._state)
        state["spike_detector"] = json.dumps(self.guard.state_dict()) if self.guard else \
            self._state.get("spike_detector", "")
        state["quarantine_digest"] = self.quarantine.digest  # what the checkpointed model was masked with
        state["ladder"] = json.dumps(self.ladder.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # torchtitan loads checkpoints after setup(), but keep the values if not
        self._state = dict(state)
        self._apply_state()

    def _apply_state(self) -> None:
        if not self._state:
            return
        if self.recorder is not None:
            self.recorder.load_state_dict(self._state)
        det = self._state.get("spike_detector")
        if self.guard is not None and det:
            self.guard.load_state_dict(json.loads(det))
        if self._state.get("ladder") and not self._keep_ladder:
            self.ladder.load_state_dict(json.loads(self._state["ladder"]))


#: the data-ledger header keys that make a run's data layout (``claim_dump_folder``)
LAYOUT_KEYS = {"seq_len": "--training.seq_len",
               "global_batch": "--training.local_batch_size x DP size x gradient accumulation",
               "fingerprint": "the data fingerprint: source, tokenizer, seq_len, seed"}


def precision_audit(trainer, is_rank0: bool) -> list[dict] | None:
    """The §3.5 checklist from the live model, optimizer and FSDP policy
    (:mod:`titan_ledger.components.precision`): rank 0 prints the table, each deviation
    is a warning; the rows go into every segment header. An audit that cannot run is
    said once and never stops training."""
    from torchtitan.tools.logging import logger

    from titan_ledger.components import precision

    try:
        n_layers = len(getattr(trainer.config.model_spec.model, "layers", None) or []) or None
        rows = precision.audit(trainer.model_parts, trainer.optimizers, trainer.loss_fn, n_layers=n_layers)
    except Exception as e:  # a model this audit does not know: record why, train on
        if is_rank0:
            logger.warning(f"titan_ledger: precision audit skipped ({type(e).__name__}: {e})")
        return None
    if is_rank0:
        logger.info("titan_ledger: precision (design article §3.5), checked on the live objects:\n"
                    + precision.table(rows))
        for r in precision.deviations(rows):
            logger.warning(f"titan_ledger: precision: {r['check']} is {r['found']}, want {r['want']} ({r['how']})")
    return rows


#: The launch as the entry point received it (``train.run``): its training flags and
#: working directory, recorded in every segment header so the tools (``replay rerun``,
#: ``replay resume``, ``diagnose --rerun``) can reuse the run's own launch.
_LAUNCH: dict[str, Any] = {}


def record_launch(argv: list[str], cwd: str) -> None:
    """Remember this process's launch flags for the segment headers (``train.run``)."""
    _LAUNCH.clear()
    _LAUNCH.update(argv=[str(a) for a in argv], cwd=str(cwd))


def claim_dump_folder(dump_folder, ledger_folder: str, layout: dict[str, Any], *, new_run: bool = False,
                      allow_data_change: bool = False, checkpoint_folder: str = "checkpoint",
                      checkpoint_enabled: bool = True, read_only: bool = False) -> list[str]:
    """A dump folder belongs to one run configuration (every rank before the process
    group, ``read_only``; rank 0 again at setup, where ``new_run`` moves an old run aside).

    Reads the run already in ``dump_folder`` through :class:`RunLedger` (the latest
    data-ledger header) and compares its layout with ``layout`` (:data:`LAYOUT_KEYS`).
    A value of ``layout`` may be a function returning it (or None: unknown, not
    compared), called only when there is a recorded value to compare it with and the
    comparison can decide: the data fingerprint costs a tokenizer and the corpus index,
    a fresh folder pays nothing. Same layout: a resume, nothing to do. Another layout:
    ``ConfigError`` naming the folder, the key and the fix -- or, with ``new_run``, the
    ledger and checkpoint folders are renamed ``<name>.old-<n>`` (returned) so runs are
    never mixed; ``read_only`` (a check before the ranks start) renames nothing and
    returns ``[]``. ``allow_data_change`` accepts the change (a deliberate resume on
    other data). A folder without a readable data ledger has no layout to compare.
    When the launch will resume from a complete checkpoint, a changed seq_len or
    fingerprint is left to the checkpoint load, which refuses it with its own line
    naming ``--ledger.allow_data_change`` (``LedgerDataLoader.load_state_dict``).
    """
    dump = Path(dump_folder)
    folder = dump / ledger_folder
    if not folder.is_dir() or allow_data_change or (new_run and read_only):
        return []
    try:
        old = RunLedger(dump, ledger_folder).data.header()
    except TitanLedgerError:
        return []
    resuming = None  # the launch will load a complete checkpoint (asked once, if needed)
    diffs = []
    for k in LAYOUT_KEYS:
        if layout.get(k) is None or old.get(k) is None:
            continue
        if k in ("seq_len", "fingerprint") and not new_run:
            if resuming is None:
                from titan_ledger.format.reader import checkpoints

                resuming = bool(checkpoint_enabled and checkpoints(dump, checkpoint_folder))
            if resuming:
                continue  # a resume: the checkpoint's data state decides
        now = layout[k]() if callable(layout[k]) else layout[k]
        if now is not None and now != old[k]:
            diffs.append((k, old[k], now))
            break  # the first difference is the one named
    if not diffs:
        return []
    key, was, now = diffs[0]
    if not new_run:
        raise ConfigError(
            f"{dump}: holds a run with {key} {was!r}, this run has {now!r} ({LAYOUT_KEYS[key]}); a "
            f"dump folder belongs to one run: use another --dump_folder, or pass --ledger.new_run "
            f"to move the old {ledger_folder}/ and {checkpoint_folder}/ aside ({ledger_folder}.old-N) "
            f"and start a new run there")
    moved = [p for p in (folder, dump / checkpoint_folder) if p.exists()]
    n = 1
    while any(p.with_name(f"{p.name}.old-{n}").exists() for p in moved):
        n += 1
    for p in moved:
        p.rename(p.with_name(f"{p.name}.old-{n}"))
    return [str(p.with_name(f"{p.name}.old-{n}")) for p in moved]


def _digest(config) -> str:
    """SHA-256 of the config, stable across processes (no object addresses)."""
    blob = json.dumps(config.to_dict(), sort_keys=True, default=repr)
    blob = re.sub(r" at 0x[0-9a-f]+", "", blob)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
