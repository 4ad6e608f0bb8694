"""``LedgerTrainer``: torchtitan 0.3.0's ``Trainer`` with the ledger attached.

Design decision: subclass, do not fork, and keep this file a seam. The subclass redeclares
the nested ``Config`` (else ``config.build()`` builds a plain ``Trainer``) and overrides
torchtitan's hooks: ``__init__`` (launch checks, the config adapted to the backend),
``post_dataloading_process`` (the CPU attention's document mask), ``state_dict``
/``load_state_dict`` (ledger counters), ``batch_generator`` (the step's record per batch:
``components.ledger.batches``), ``forward_backward_step`` (rehearsal faults), ``train``
(close the ledger). ``train_step`` has no hook between the clip and ``optimizers.step()``,
where the signals are read and a flagged step is decided, so its body is copied from
torchtitan 0.3.0 as ``_train_step`` + ``execute`` (which a proof and a redo run again);
changed spots are marked ``# CHANGED``. A step's facts travel in one :class:`StepRecord`,
handed whole to ``Ledger.record``. What a flagged step does is
:class:`~titan_ledger.components.response.recovery.Recovery`'s, asked through its protocol
(one call at each spot, a named answer; its docstring has the flow with deferred decisions).
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

from torchtitan.components.dataloader import DataloaderExhaustedError  # noqa: E402
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.observability import structured_logger as sl  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titan_ledger.components.ledger.batches import Batches  # noqa: E402
from titan_ledger.components.ledger.ledger import Ledger  # noqa: E402
from titan_ledger.components.prevention.optimizer import LedgerOptimizers  # noqa: E402
from titan_ledger.components.prevention.qk_clip import QKClipConfig  # noqa: E402
from titan_ledger.components.prevention.qk_norm import ModelOptions, apply_qk_norm  # noqa: E402
from titan_ledger.components.response import counterfactual  # noqa: E402  ADDED (replay rerun)
from titan_ledger.components.response.host import Parts, RunFacts  # noqa: E402
from titan_ledger.components.response.recovery import Outcome, Recovery  # noqa: E402
from titan_ledger.components.run import disk_space, patches  # noqa: E402
from titan_ledger.components.signals import attention  # noqa: E402
from titan_ledger.components.signals.doc_loss import use_doc_loss  # noqa: E402
from titan_ledger.components.signals.precision import audit_trainer  # noqa: E402
from titan_ledger.components.signals.step_record import StepRecord  # noqa: E402
from titan_ledger.components.signals.sums import loss_sum  # noqa: E402
from titan_ledger.config.toml_frontend import world_size_from_env  # noqa: E402
from titan_ledger.config.validate import validate  # noqa: E402
from titan_ledger.data.loader import LedgerDataLoader  # noqa: E402
from titan_ledger.errors import NonFiniteLoss  # noqa: E402
from titan_ledger.rehearsal import faults  # noqa: E402  ADDED (bitflip, swap, repeat, random)


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
        validate(config, world_size_from_env(config))  # the launch checks (train.load_config ran them too)
        attention.adapt_config(config)
        if config.model.qk_norm:
            apply_qk_norm(config.model_spec.model)
        if config.ledger.signals and config.ledger.max_logit:
            attention.use_max_logit_attention(config)
        self._dense_masks = attention.uses_cpu_attention(config.model_spec.model)
        self.ledger = config.ledger.build()
        self._ledger_open = False
        self.step_record: StepRecord | None = None  # the step being trained, filled by the hooks
        dry_run = config.comm.mode == "fake_backend"
        if dry_run and config.debug.seed is None:  # torchtitan broadcasts rank 0's seed; a fake PG has none
            config.debug.seed = 0
        doc_loss = config.ledger.signals and config.ledger.doc_loss.enable and use_doc_loss(config)
        with patches.meta_materialization() if dry_run else contextlib.nullcontext():
            super().__init__(config)
        self.doc_loss = self.ledger.attach_loss(self.loss_fn, per_document=doc_loss, seq_len=config.training.seq_len,
                                                cp_enabled=self.parallel_dims.cp_enabled)
        if self._dense_masks and config.validator.enable:
            attention.give_validator_dense_masks(self.validator)
        if isinstance(self.dataloader, LedgerDataLoader):
            self.dataloader.allow_data_change = config.ledger.allow_data_change
        if not dry_run:
            self.ledger.setup(self)
        else:  # a dry run builds everything the audit reads (its norm probe cannot run on meta)
            audit_trainer(self, int(os.environ.get("RANK", "0")) == 0)
        # the response, after torchtitan and the ledger built what it acts on: sections, ports, facts passed in
        self._overrides = counterfactual.parse_overrides(config.ledger.rehearsal.rerun)
        facts = RunFacts.of(config, self.ledger, Parts.of(self), device=self.device,
                            microbatches=self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches)
        self.recovery = Recovery.Config.of(config.ledger).build(host=self, ledger=self.ledger, facts=facts)

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        if self._dense_masks:
            positions = extra_kwargs.get("positions")
            if positions is None:
                raise ValueError("the CPU attention needs per-document 'positions' from the dataloader")
            extra_kwargs["attention_masks"] = attention.document_causal_mask(positions)
        if self.doc_loss is not None and "positions" in extra_kwargs:
            self.doc_loss.push(extra_kwargs["positions"])  # the loss attributes tokens by position
        return inputs, labels, extra_kwargs

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # + the ledger's counters, the response's history (keys as ever)
        state.update({f"ledger_{k}": v for k, v in {**self.ledger.state_dict(), **self.recovery.state_dict()}.items()})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]):
        super().load_state_dict(state_dict)
        ours = {k.removeprefix("ledger_"): v for k, v in state_dict.items() if k.startswith("ledger_")}
        self.ledger.load_state_dict(ours)
        self.recovery.load_state_dict(ours)

    def train(self):
        from titan_ledger.components.ledger import dashboards

        dashboards.attach(self)  # W&B / TensorBoard: monotonic steps, identity, layout
        try:
            # a decision still deferred when training ends is made; after a stop, written as it stands
            with patches.no_final_sleep_on_cpu(), self.recovery.settling():
                super().train()
        except BaseException as e:  # a stop (non-finite loss, [ledger.rollback] limit, ...): exit code 1
            dashboards.log_stop(self.metrics_processor.logger, e)
            raise
        finally:
            self.ledger.finish(self.metrics_processor.logger)  # the last rows, the files closed, the run's episodes

    # ------------------------------------------------------------------ the step
    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]):
        """A wrapper: what must happen around a step, then the step itself."""
        ledger = self.ledger
        if not self._ledger_open:  # first step of this process, after the checkpoint load
            ledger.open(resumed_from=self.step - 1)
            self._ledger_open = True
            # ADDED (replay rerun): --ledger.rehearsal.rerun lr_scale/eps/logit_cap/beta2 after the load
            counterfactual.apply_overrides(self._overrides, self.optimizers, self.lr_schedulers, self.model_parts)
            disk_space.warn_at_start(self)  # ADDED: what the run will write against the dump folder's free space
        if self.recovery.before_step():  # a pending rollback ran, or a skip window consumed the step
            return
        inject = ledger.inject
        rec = self.step_record = StepRecord(
            step=self.step, start=time.perf_counter(),
            inject=inject[2] if inject and inject[:2] == (self.step, ledger.topo.dp_rank) else None)
        rec.faults = faults.plan(self, rec)  # ADDED (bitflip, swap): --ledger.rehearsal.inject STEP:RANK:bitflip|swap
        try:
            self._train_step(data_iterator)
        except DataloaderExhaustedError:
            # the previous step's deferred decision is made now; a rollback runs (and
            # training goes on) as it would have before this step's fetch
            if not self.recovery.at_data_end(rec):
                raise
            return
        if self.checkpoint_due(self.step):  # a checkpoint follows: the ledgers must hold every step it covers
            ledger.drain(block=True, metrics_logger=self.metrics_processor.logger)

    # ------------------------------------------------------------------ ADDED: the Host protocol
    # (components/response/host.py): the response asks for these by name; only this class
    # writes ``step`` and ``step_record`` (tests/unit/test_seam.py)
    def attend(self, rec: StepRecord | None) -> StepRecord | None:
        before, self.step_record = self.step_record, rec
        return before

    @contextlib.contextmanager
    def as_step(self, step: int):
        now, self.step = self.step, step
        try:
            yield
        finally:
            self.step = now

    def move_to(self, step: int) -> None:
        self.step = step

    def checkpoint_due(self, step: int) -> bool:
        """Whether torchtitan saves a checkpoint after ``step``: its own rule, asked of its
        own ``CheckpointManager`` (``_should_save``: enabled and not ``load_only``; the
        first step with ``enable_first_step_checkpoint``; the last step; every
        ``interval``), with ``last_step`` as torchtitan's loop passes it. The ledger's drain
        and the response's deferral both ask here: one rule, torchtitan's."""
        return bool(self.checkpointer._should_save(step, last_step=step == self.config.training.steps))

    def decision_due(self, step: int) -> bool:
        """Whether the last step, a checkpoint or a validation follows ``step`` (Host)."""
        return (not self.should_continue_training() or self.checkpoint_due(step)
                or (self.config.validator.enable and self.validator.should_validate(step)))

    @property
    def ran_a_step(self) -> bool:
        """ADDED: whether this process ran a step (trained, or consumed one untrained): a
        relaunch that resumes at its last step runs none (``train.run`` says so)."""
        return self._ledger_open

    def should_continue_training(self) -> bool:  # ADDED (replay rerun): --ledger.rehearsal.rerun stop=N
        return super().should_continue_training() and counterfactual.before_stop(self._overrides, self.step)

    def batch_generator(self, data_iterable):
        """torchtitan's generator, each batch landing in the step's record (``Batches``)."""
        return Batches(self, data_iterable, Trainer.batch_generator)

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        # Once per gradient-accumulation microbatch (PP: per group of PP microbatches, with
        # lists), keyword arguments only; every batch of the step was fetched before the first
        rec = self.step_record
        if rec is not None:
            self.ledger.provenance_ready(rec)
        step_faults = rec.faults if rec is not None else None
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
        for _ in range(self.gradient_accumulation_steps):
            microbatches = []
            for _ in range(self.num_pipeline_parallel_microbatches):
                with sl.log_trace_span("fetching_batch"):
                    input_dict, labels = next(data_iterator)
                microbatches.append((input_dict, labels))
            microbatch_groups.append(microbatches)
        rec = self.step_record  # CHANGED: the rest is ``execute``, which a proof re-runs on these batches
        rec.batches = microbatch_groups
        tokens = self.count_tokens(microbatch_groups)  # CHANGED: counted once, before the first execution
        # CHANGED: the step executed once -- unless every label is masked (consumed whole,
        # never trained into a NaN) -- and the previous step's deferred decision made behind
        # its launched work (which may execute it again, or drop it for a rollback)
        outcome, executed = self.recovery.first_execution(
            rec, tokens, need_loss, run=lambda: self.execute(microbatch_groups, need_loss, tokens))
        if outcome in (Outcome.EMPTY, Outcome.DROPPED):
            return
        accumulated_loss, grad_norm, local_valid_tokens, global_valid_tokens = executed

        with sl.log_trace_span("optim"):
            # CHANGED: record the step's signals from the gradients about to be applied
            self.step_record = None
            if self.doc_loss is not None:  # the step's distinct documents (rank separation), a host count
                self.doc_loss.set_documents(rec.tags)
            rec.lr = next(iter(lr_metrics.values()), float("nan"))
            self.ledger.record(rec, grad_norm=grad_norm, local_tokens=int(local_valid_tokens),
                               local_loss_sum=loss_sum(accumulated_loss, global_valid_tokens))
            self.checkpointer.maybe_wait_for_staging()
            self.recovery.update(rec)  # CHANGED (was optimizers.step()): applied, withheld, or held on the device
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
            raise NonFiniteLoss(  # CHANGED (was RuntimeError): Recovery.settling decides a deferred step first
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

    def count_tokens(self, microbatch_groups) -> tuple[torch.Tensor, torch.Tensor]:
        """ADDED: the step's valid label tokens, this rank's (host) and the batch mesh's
        (device) -- torchtitan 0.3.0's train_step's count, split out of ``execute`` so that a
        step with none is seen before its forward (``Recovery.no_tokens``)."""
        parallel_dims = self.parallel_dims
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for microbatches in microbatch_groups:
            for _, labels in microbatches:
                local_valid_tokens += (labels != IGNORE_INDEX).sum()
        sl.log_trace_scalar({"local_valid_tokens": int(local_valid_tokens)})
        if parallel_dims.dp_enabled:
            batch_mesh = parallel_dims.get_mesh("batch")
            global_valid_tokens = dist_utils.dist_sum_tensor(
                local_valid_tokens.to(self.device), batch_mesh
            )
        else:
            global_valid_tokens = local_valid_tokens.to(self.device)
        return local_valid_tokens, global_valid_tokens

    def execute(self, microbatch_groups, need_loss: bool = True, tokens=None):
        """ADDED: the rest of torchtitan 0.3.0's train_step body on the fetched batches (valid
        tokens, every forward/backward, the clip), so that a proof re-runs exactly the step.
        ``tokens``: ``count_tokens``'s, when the step counted them already. Returns
        (accumulated loss, pre-clip grad norm, local and global valid tokens)."""
        parallel_dims = self.parallel_dims
        local_valid_tokens, global_valid_tokens = tokens if tokens is not None else \
            self.count_tokens(microbatch_groups)

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
            faults.before_clip(self, self.step_record and self.step_record.faults)  # ADDED (bitflip@F)
            grad_norm = dist_utils.clip_grad_norm_(
                [p for m in self.model_parts for p in m.parameters()],
                self.config.training.max_norm,
                foreach=True,
                pp_mesh=parallel_dims.get_optional_mesh("pp"),
                ep_enabled=parallel_dims.ep_enabled,
            )
        return accumulated_loss, grad_norm, local_valid_tokens, global_valid_tokens
