"""``LedgerTrainer``: torchtitan 0.3.0's ``Trainer`` with the ledger attached.

Design decision: subclass, do not fork. The subclass redeclares the nested
``Config`` (otherwise ``config.build()`` would silently build a plain ``Trainer``),
adds the ``ledger`` section, and overrides the hooks torchtitan exposes:
``__init__`` (adapt the config to the backend before the model is built),
``post_dataloading_process`` (dense document mask for the CPU attention),
``state_dict``/``load_state_dict`` (ledger counters in the checkpoint),
``forward_backward_step`` (the step's provenance; the rehearsal faults ``swap`` and
``bitflip`` around torchtitan's) and ``train`` (close the ledger). ``train_step``
has no hook between the clip and ``optimizers.step()``, which is exactly where the signals must be read, so it is
copied from torchtitan 0.3.0; every changed spot is marked ``# CHANGED``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_ledger.rehearsal import backend

backend.ensure_installed()

from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.observability import structured_logger as sl  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titan_ledger.components import attention, counterfactual  # noqa: E402  ADDED (counterfactual: replay rerun)
from titan_ledger.components.attention import document_causal_mask  # noqa: E402
from titan_ledger.components.doc_loss import DocLossTracker, LogZStats, find_doc_loss, use_doc_loss  # noqa: E402
from titan_ledger.components.ledger import Ledger  # noqa: E402
from titan_ledger.components.optimizer import LedgerOptimizers  # noqa: E402
from titan_ledger.components.prevention import ModelOptions, apply_qk_norm  # noqa: E402
from titan_ledger.components.qk_clip import QKClipConfig  # noqa: E402
from titan_ledger.data.filters import mask_repetitive  # noqa: E402
from titan_ledger.data.loader import LedgerDataLoader  # noqa: E402
from titan_ledger.rehearsal import faults  # noqa: E402  ADDED (bitflip, swap)


class LedgerTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's training config plus the ``ledger`` section."""

        ledger: Ledger.Config = field(default_factory=Ledger.Config)
        """titan_ledger settings: signals, data ledger, spike response."""

        optimizer: LedgerOptimizers.Config = field(default_factory=LedgerOptimizers.Config)
        """torchtitan's optimizers (parameter groups by FQN pattern) plus the weight-decay
        presets (``no_decay``)."""

        model: ModelOptions = field(default_factory=ModelOptions)
        """Model switches applied to the config function's model before it is built
        (``qk_norm``)."""

        qk_clip: QKClipConfig = field(default_factory=QKClipConfig)
        """QK-clip (MuonClip, Megatron ``qk_clip``): after each update, scale the Q and K
        rows of the heads whose max attention logit passed a threshold."""

    config: Config
    ledger: Ledger

    def __init__(self, config: Config):
        backend.check(config.ledger.device)
        attention.adapt_config(config)
        if config.model.qk_norm:
            apply_qk_norm(config.model_spec.model)
        if config.ledger.signals and config.ledger.max_logit:
            attention.use_max_logit_attention(config)
        self._dense_masks = attention.uses_cpu_attention(config.model_spec.model)
        self.ledger = config.ledger.build()
        self._ledger_open = False
        self._pending_rollback: int | None = None
        self._io: _StepIO | None = None  # per-step bookkeeping the hooks share
        self._lr_scale = 1.0  # the recovery ladder's rollback_lr factors, multiplied
        self._update_rejected = False
        dry_run = config.comm.mode == "fake_backend"
        if dry_run and config.debug.seed is None:
            # torchtitan would broadcast rank 0's random seed; a fake PG returns none.
            config.debug.seed = 0
        doc_loss = config.ledger.signals and config.ledger.doc_loss.enable and use_doc_loss(config)
        with _meta_materialization() if dry_run else contextlib.nullcontext():
            super().__init__(config)
        self.doc_loss: DocLossTracker | None = None
        ours = find_doc_loss(self.loss_fn)
        if ours is not None and config.ledger.signals:  # log Z: the output-logit drift signal
            self.ledger.logz = ours.logz = LogZStats()
        loss = ours if doc_loss else None
        if loss is not None and not self.parallel_dims.cp_enabled:  # CP splits documents over ranks
            self.doc_loss = loss.tracker = DocLossTracker(config.ledger.doc_loss.k,
                                                          config.ledger.doc_loss.min_tokens,
                                                          config.training.seq_len)
            self.ledger.doc_loss = self.doc_loss
        if self._dense_masks and config.validator.enable:
            self._give_validator_dense_masks()
        if isinstance(self.dataloader, LedgerDataLoader):
            self.dataloader.allow_data_change = config.ledger.allow_data_change
        if not dry_run:
            self.ledger.setup(self)
        else:  # a dry run builds everything the audit reads (its norm probe cannot run on meta)
            from titan_ledger.components.ledger import precision_audit

            precision_audit(self, int(os.environ.get("RANK", "0")) == 0)

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        if self._dense_masks:
            positions = extra_kwargs.get("positions")
            if positions is None:
                raise ValueError(
                    "the CPU attention needs per-document 'positions' from the dataloader"
                )
            extra_kwargs["attention_masks"] = document_causal_mask(positions)
        if self.doc_loss is not None and "positions" in extra_kwargs:
            self.doc_loss.push(extra_kwargs["positions"])  # the loss attributes tokens by position
        return inputs, labels, extra_kwargs

    def _give_validator_dense_masks(self) -> None:
        """The Validator builds its own inputs (masks only for Flex/Varlen configs):
        extend its ``post_dataloading_process`` the way ours is extended."""
        build = self.validator.post_dataloading_process

        def with_dense_mask(input_dict, labels, model_parts, _build=build):
            inputs, labels, extra_kwargs = _build(input_dict, labels, model_parts)
            extra_kwargs["attention_masks"] = document_causal_mask(extra_kwargs["positions"])
            return inputs, labels, extra_kwargs

        self.validator.post_dataloading_process = with_dense_mask

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({f"ledger_{k}": v for k, v in self.ledger.state_dict().items()})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]):
        super().load_state_dict(state_dict)
        self.ledger.load_state_dict(
            {k.removeprefix("ledger_"): v for k, v in state_dict.items() if k.startswith("ledger_")}
        )

    def train(self):
        from titan_ledger.components import dashboards

        dashboards.attach(self)  # W&B / TensorBoard: monotonic steps, identity, layout
        try:
            with _no_final_sleep_on_cpu():
                super().train()
        except BaseException as e:  # a stop (non-finite loss, max_rollbacks, ...): exit code 1
            dashboards.log_stop(self.metrics_processor.logger, e)
            raise
        finally:
            self.ledger.drain(block=True, metrics_logger=self.metrics_processor.logger)
            self.ledger.close()

    # ------------------------------------------------------------------ the step
    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]):
        """A wrapper: what must happen around a step, then the step itself."""
        ledger = self.ledger
        if not self._ledger_open:  # first step of this process, after the checkpoint load
            ledger.open(resumed_from=self.step - 1)
            self._ledger_open = True
            counterfactual.apply_overrides(self)  # ADDED (replay rerun): --ledger.rehearsal.rerun lr_scale/eps after the load
        if self._pending_rollback is not None:  # in-process rollback (on_spike)
            self._rollback(self._pending_rollback)
        window = ledger.skip_window_at(self.step)  # skipped steps train nothing
        if window is not None:
            self._skip_window(window)
            return
        inject = ledger.inject
        self._io = _StepIO(start=time.perf_counter(),
                           inject=inject[2] if inject and inject[:2] == (self.step, ledger.topo.dp_rank) else None)
        self._io.step_faults = faults.plan(self)  # ADDED (bitflip, swap): --ledger.rehearsal.inject STEP:RANK:bitflip|swap
        self._train_step(data_iterator)
        ck = self.config.checkpoint
        if ck.enable and (self.step % ck.interval == 0 or self.step == self.config.training.steps):
            # a checkpoint follows: the ledgers must hold every step it covers
            ledger.drain(block=True, metrics_logger=self.metrics_processor.logger)

    def should_continue_training(self) -> bool:  # ADDED (replay rerun): --ledger.rehearsal.rerun stop=N
        return super().should_continue_training() and counterfactual.before_stop(self)

    def batch_generator(self, data_iterable):
        """torchtitan's generator, plus fetch timing for the ledger and the rehearsal
        injection (``--ledger.rehearsal.inject``), applied before the step counts tokens."""
        inner = super().batch_generator(data_iterable)
        while True:
            t0 = time.perf_counter()
            input_dict, labels = next(inner)
            io = self._io
            if io is not None:
                io.data_loading_s += time.perf_counter() - t0
                if io.inject is not None:
                    labels = _inject(input_dict, labels, io.inject, self.tokenizer.get_vocab_size(),
                                     seed=self.step)
                self._take_provenance(io, input_dict, labels)
            yield input_dict, labels

    def _take_provenance(self, io: _StepIO, input_dict, labels: torch.Tensor) -> None:
        """This microbatch's rows' provenance, and the loss masks that use it (quarantine,
        repetition filter); the masked labels are then ignored like any other."""
        ledger = self.ledger
        if ledger.loader is None:
            return
        tags = ledger.loader.take_tags()
        base = len(io.tags)
        io.tags.extend(tags)
        cfg = self.config.ledger
        if not (ledger.quarantine or cfg.filter.repetition) or not tags:
            return
        valid = int((labels != IGNORE_INDEX).sum())
        if ledger.quarantine:
            hit = ledger.quarantine.mask(tags, labels)
            io.masked.setdefault("quarantine", []).extend([base + r, s] for r, s in hit)
        if cfg.filter.repetition:
            hit = mask_repetitive(input_dict["input"], input_dict["positions"], labels,
                                  cfg.filter.repetition_min, cfg.filter.repetition_max_period)
            io.masked.setdefault("repetition", []).extend([base + r, s] for r, s in hit)
        io.masked_tokens += valid - int((labels != IGNORE_INDEX).sum())

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        # Called once per gradient-accumulation microbatch (under PP once per group of
        # PP microbatches, with lists) by _train_step, keyword arguments only.
        # every batch of the step has been fetched by the first call: write the step's
        # provenance now, before any forward can fail
        io = self._io
        if io is not None and not io.data_recorded and self.ledger.loader is not None:
            masked = {k: v for k, v in io.masked.items() if v} or None
            self.ledger.record_data(self.step, io.tags, injected=io.inject, masked=masked)
            io.data_recorded = True
        step_faults = io.step_faults if io is not None else None
        faults.before_forward(step_faults, kwargs)  # ADDED (swap): the next DP rank's batch, every microbatch
        loss = super().forward_backward_step(**kwargs)
        faults.after_backward(self, step_faults)  # ADDED (bitflip): one grad bit, after the step's first backward
        return loss

    def _train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]):
        # Copied from torchtitan 0.3.0 Trainer.train_step (no hook sits between the
        # clip and optimizers.step()); changed spots marked CHANGED.
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        # Save per-optimizer-group learning rates for logging
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = self.metrics_processor.should_log(self.step)
        need_loss = should_log or self.ledger.enabled  # CHANGED: the ledger needs the loss every step

        parallel_dims = self.parallel_dims
        microbatch_groups: list[list[tuple[dict[str, torch.Tensor], torch.Tensor]]] = []
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for _ in range(self.gradient_accumulation_steps):
            microbatches = []
            for _ in range(self.num_pipeline_parallel_microbatches):
                with sl.log_trace_span("fetching_batch"):
                    input_dict, labels = next(data_iterator)
                local_valid_tokens += (labels != IGNORE_INDEX).sum()
                microbatches.append((input_dict, labels))
            microbatch_groups.append(microbatches)
        sl.log_trace_scalar({"local_valid_tokens": int(local_valid_tokens)})

        if parallel_dims.dp_enabled:
            batch_mesh = parallel_dims.get_mesh("batch")
            global_valid_tokens = dist_utils.dist_sum_tensor(
                local_valid_tokens.to(self.device), batch_mesh
            )
        else:
            global_valid_tokens = local_valid_tokens.to(self.device)

        accumulated_loss: torch.Tensor | None = None
        for microbatches in microbatch_groups:
            input_dict_mbs = []
            label_mbs = []
            for input_dict, labels in microbatches:
                for key, value in input_dict.items():
                    if isinstance(value, torch.Tensor):
                        input_dict[key] = value.to(self.device)
                input_dict_mbs.append(input_dict)
                label_mbs.append(labels.to(self.device))

            if parallel_dims.pp_enabled:
                fwd_bwd_input_dict = input_dict_mbs
                fwd_bwd_labels = label_mbs
            else:
                assert len(input_dict_mbs) == len(label_mbs) == 1
                fwd_bwd_input_dict = input_dict_mbs[0]
                fwd_bwd_labels = label_mbs[0]

            loss = self.forward_backward_step(
                input_dict=fwd_bwd_input_dict,
                labels=fwd_bwd_labels,
                global_valid_tokens=global_valid_tokens,
            )
            if need_loss:  # CHANGED (was: if should_log)
                loss = loss.detach()
                if accumulated_loss is None:
                    accumulated_loss = loss.clone()
                else:
                    accumulated_loss.add_(loss)

        with sl.log_trace_span("optim"):
            grad_norm = dist_utils.clip_grad_norm_(
                [p for m in self.model_parts for p in m.parameters()],
                self.config.training.max_norm,
                foreach=True,
                pp_mesh=parallel_dims.get_optional_mesh("pp"),
                ep_enabled=parallel_dims.ep_enabled,
            )
            self._record_and_guard(grad_norm, accumulated_loss, global_valid_tokens,  # CHANGED
                                   int(local_valid_tokens), lr_metrics)
            self.checkpointer.maybe_wait_for_staging()
            if not self._update_rejected:  # CHANGED: the update guard (on_spike)
                self.optimizers.step()
            self.ledger.after_update(applied=not self._update_rejected)  # CHANGED: QK-clip
            self.lr_schedulers.step()

        if not should_log:
            self.ledger.drain(block=False, metrics_logger=self.metrics_processor.logger)  # CHANGED
            return

        assert accumulated_loss is not None

        with sl.log_trace_span("collect_dist_metrics"):
            sl.log_trace_scalar({"global_valid_tokens": int(global_valid_tokens)})
            if parallel_dims.dp_cp_enabled:
                loss_mesh = parallel_dims.get_optional_mesh("loss")
                local_avg_loss = (
                    accumulated_loss * global_valid_tokens / local_valid_tokens
                )
                global_avg_loss, global_max_loss, global_ntokens_seen = (
                    dist_utils.dist_sum(accumulated_loss, loss_mesh),
                    dist_utils.dist_max(local_avg_loss, loss_mesh),
                    dist_utils.dist_sum(
                        torch.tensor(
                            self.ntokens_seen, dtype=torch.int64, device=self.device
                        ),
                        loss_mesh,
                    ),
                )
            else:
                global_avg_loss = global_max_loss = float(accumulated_loss.item())
                global_ntokens_seen = self.ntokens_seen

        # CHANGED: this step synchronised already; write pending ledger rows first so
        # every logger sees steps in order
        self.ledger.drain(block=True, metrics_logger=self.metrics_processor.logger)

        if not math.isfinite(global_avg_loss):
            raise RuntimeError(
                f"Loss is not finite (global_avg_loss={global_avg_loss}) at "
                f"step {self.step}. Stopping training."
            )

        extra_metrics = {
            "n_tokens_seen": global_ntokens_seen,
            **lr_metrics,
        }
        self.metrics_processor.log(
            self.step,
            global_avg_loss,
            global_max_loss,
            float(grad_norm.item()),
            extra_metrics=extra_metrics,
        )

    def _record_and_guard(self, grad_norm, accumulated_loss, global_valid_tokens, local_tokens: int,
                          lr_metrics) -> None:
        """Between the clip and ``optimizers.step()``: record the step's signals from the
        gradients about to be applied, and decide whether the update is applied."""
        ledger = self.ledger
        if self.doc_loss is not None:  # the step's distinct documents (rank separation), a host count
            self.doc_loss.set_documents(self._io.tags)
        ledger.record(
            step=self.step,
            local_loss_sum=(accumulated_loss * global_valid_tokens).sum() if accumulated_loss is not None else None,
            local_tokens=local_tokens,
            grad_norm=grad_norm,
            lr=next(iter(lr_metrics.values()), float("nan")),
            step_start=self._io.start,
            data_loading_s=self._io.data_loading_s,
            masked_tokens=self._io.masked_tokens,
        )
        self._io = None
        # A flagged step's update is not applied when the guard is on. Not calling
        # optimizers.step() leaves params, moments and Adam's step count as they were
        # (OLMo-core PR 309/317: the count must not advance).
        self._update_rejected = False
        if not (ledger.ladder.acts and ledger.spike_flag_now()):
            return
        rung, rec = ledger.ladder.on_spike(self.step)  # the recovery ladder decides
        ledger.record_action(rec)
        if rung is not None and rung.action == "none":
            return
        self._update_rejected = True
        ledger.mark_update_skipped()
        if rung is None or rung.action == "stop":
            self._stop_with_report(rec)
        if rung.rolls_back:
            self._pending_rollback = self.step
            if rung.lr is not None:
                self._lr_scale *= rung.lr  # kept across every later checkpoint load

    def _skip_window(self, window: tuple[int, int]) -> None:
        """Consume the data of steps ``self.step..window end`` at once: no forward,
        backward or optimizer step; the LR schedule frozen or advanced per
        ``--ledger.skip.lr``. torchtitan's loop then continues from the last
        skipped step (its checkpoint/validation checks see that step)."""
        step_start = time.perf_counter()
        first = self.step
        last = min(window[1], self.config.training.steps)
        n = last - first + 1
        info = self.ledger.loader.skip(
            n * self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches)
        if self.config.ledger.skip.lr == "advance":
            for sched in self.lr_schedulers.schedulers:
                sched.last_epoch += n - 1  # O(1) for any window: one step() applies it
                sched.step()
        lr = next(iter(self.lr_schedulers.get_metrics().values()), float("nan"))
        self.ledger.record_skip(first=first, last=last, info=info, lr=lr, step_start=step_start,
                                metrics_logger=self.metrics_processor.logger)
        logger.info(f"titan_ledger: skipped steps {first}-{last}: samples "
                    f"[{info.position_before}, {info.position_after}) consumed without training, "
                    f"LR schedule {self.config.ledger.skip.lr}")
        self.step = last


    def _rollback(self, spike_step: int) -> None:
        """Reload the last checkpoint at or before ``spike - rollback_back`` in this
        process and skip from there past the spike (PaLM's fix, no relaunch).

        What makes this safe on torchtitan 0.3.0: the checkpoint load is the same
        DCP in-place load a relaunch does (model, optimizer, LR schedulers,
        dataloader position, train state, ledger counters); the spiked step's update
        was not applied; the data iterator restarts at the restored position; the
        ledgers open a new segment that supersedes the rewound steps.
        """
        import torch.distributed as dist

        from titan_ledger.format.reader import checkpoints

        cfg = self.config.ledger
        self._pending_rollback = None
        unlimited = len(self.ledger.ladder.rungs) == 1  # a single action; a ladder sets its own limits
        if unlimited and self.ledger.rewinds >= cfg.on_spike.max_rollbacks:
            raise RuntimeError(f"titan_ledger: spike at step {spike_step} after {self.ledger.rewinds} "
                               f"rollbacks (--ledger.on_spike.max_rollbacks); stopping. See "
                               f"{self.ledger.folder / 'spikes.jsonl'}")
        self.checkpointer.maybe_wait_for_staging()
        decision = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            steps = [c for c in checkpoints(self.config.dump_folder, self.config.checkpoint.folder)
                     if c <= spike_step - cfg.on_spike.rollback_back]
            decision = [steps[-1] if steps else None]
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0)
        load = decision[0]
        if load is None:
            raise RuntimeError(f"titan_ledger: spike at step {spike_step}: no checkpoint at or before "
                               f"step {spike_step - cfg.on_spike.rollback_back} to roll back to "
                               f"(--ledger.on_spike.rollback_back, --checkpoint.interval)")
        window = (load + 1, load + max(cfg.on_spike.rollback_skip, spike_step - load))
        logger.warning(f"titan_ledger: rolling back from step {spike_step} to checkpoint step-{load}; "
                       f"skipping steps {window[0]}-{window[1]}")
        self.ledger._keep_ladder = True  # the ladder's history is this process's, not the checkpoint's
        try:
            self.checkpointer.load(step=load)  # sets self.step = load via the train state
        finally:
            self.ledger._keep_ladder = False
        if self._lr_scale != 1.0:
            scale_lr(self.lr_schedulers, self._lr_scale)
        self.ledger.rewind(from_step=spike_step, to_step=load, window=window,
                           metrics_logger=self.metrics_processor.logger)
        from titan_ledger.components.dashboards import log_rewind

        log_rewind(self.metrics_processor.logger, from_step=spike_step, to_step=load, window=window)
        self.step = load + 1


    def _stop_with_report(self, rec: dict) -> None:
        """The ladder is exhausted (or says stop): write what is pending, then stop with
        a one-screen report (exit 1)."""
        from titan_ledger.errors import LedgerStop

        ledger = self.ledger
        ledger.drain(block=True, metrics_logger=self.metrics_processor.logger)
        raise LedgerStop(ladder_report(ledger, self.config, rec))


def scale_lr(lr_schedulers, factor: float) -> None:
    """Scale the LR from now on: the schedulers' base LRs (torchtitan rebuilds them
    from the config) and the optimizer's current ones (a checkpoint restores those)."""
    for sched in lr_schedulers.schedulers:
        sched.base_lrs = [b * factor for b in sched.base_lrs]
        sched._last_lr = [lr * factor for lr in sched.get_last_lr()]
        for g in sched.optimizer.param_groups:
            g["lr"] = g["lr"] * factor


def ladder_report(ledger, config, rec: dict) -> str:
    """One screen: what happened, what was tried, where the evidence is, what to run."""
    from titan_ledger.errors import python_command

    folder = ledger.folder
    dump = config.dump_folder
    py = python_command()  # the interpreter that trained: the commands run as printed
    tried = "; ".join(f"step {h['step']}: {h['action']}" + (f" ({h['attempt']})" if "attempt" in h else "")
                      for h in ledger.ladder.history) or "nothing"
    return "\n".join([
        f"the recovery ladder stopped training at step {rec['step']} "
        f"(--ledger.on_spike.action {config.ledger.on_spike.action}, horizon {config.ledger.on_spike.ladder_horizon} steps)",
        f"  what happened: spikes kept coming back within the horizon; last at step {rec['step']}",
        f"  what was tried: {tried}",
        f"  evidence: {folder / 'spikes.jsonl'} (every flag and decision), {folder / 'signals.jsonl'}, "
        f"{folder}/data_dp*.jsonl (documents and their losses), checkpoints in {dump}/checkpoint",
        f"  next: {py} -m titan_ledger.diagnose {dump} --step {rec['step']}",
        f"        {py} -m titan_ledger.report {dump} --step {rec['step']} -o incident.html",
        f"        {py} -m titan_ledger.replay rerun --dump-folder {dump} --step {rec['step']}  (reuses this run's launch)",
    ])


@contextlib.contextmanager
def _no_final_sleep_on_cpu():
    """On the CPU rehearsal backend, skip the 2 s that rank 0 of torchtitan 0.3.0's
    ``Trainer.train`` sleeps after the last step ("for other ranks to complete"): on CPU
    nothing is in flight, and every launch of the test suite paid them (a CPU launch of a
    few steps takes 15-20 s).
    torchtitan has no hook for it: its module's ``time`` is swapped for the call only
    (CHANGED spot: ``torchtitan/trainer.py`` ``time.sleep(2)``); on CUDA nothing changes."""
    import torchtitan.trainer as tt

    if backend.installed() != "cpu" or getattr(tt, "time", None) is not time:
        yield
        return

    class _Time:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds):
            pass

    tt.time = _Time()
    try:
        yield
    finally:
        tt.time = time


@dataclass
class _StepIO:
    """What the step's hooks (batch_generator, forward_backward_step, the copy) share."""

    start: float
    inject: str | None = None
    data_loading_s: float = 0.0
    data_recorded: bool = False
    tags: list = field(default_factory=list)  # the step's rows, in fetch order
    masked: dict = field(default_factory=dict)  # {"quarantine"|"repetition": [[row, segment]]}
    masked_tokens: int = 0  # label tokens those masks removed
    step_faults: faults.StepFaults | None = None  # ADDED (bitflip, swap): this step's fault injections


def _inject(input_dict: dict[str, torch.Tensor], labels: torch.Tensor, kind: str, vocab: int,
            seed: int) -> torch.Tensor:
    """Rehearsal: this batch becomes one repeated (rare) token or uniform random tokens."""
    inputs = input_dict["input"]
    if kind == "repeat":
        inputs.fill_(vocab - 1)
        return torch.full_like(labels, vocab - 1)
    g = torch.Generator().manual_seed(seed)
    inputs.copy_(torch.randint(3, vocab, inputs.shape, generator=g))
    return torch.randint(3, vocab, labels.shape, generator=g)


@contextlib.contextmanager
def _meta_materialization():
    """Dry run: build every shard on the meta device instead of allocating it.

    torchtitan's fake backend moves no data, so real weights would only cost time
    (initialising 70B / 64 ranks of fp32 takes many minutes on a CPU). Trainer
    reads ``utils.device_type`` when it picks the init device; pointing it at
    "meta" for the duration of ``__init__`` keeps every other step real: meshes,
    TP/FSDP/PP wrapping, init functions, optimizer, dataloader, checkpointer.
    """
    import torchtitan.tools.utils as tt_utils

    saved = tt_utils.device_type
    tt_utils.device_type = "meta"
    try:
        yield
    finally:
        tt_utils.device_type = saved
