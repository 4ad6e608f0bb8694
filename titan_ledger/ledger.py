"""The ``[ledger]`` section and the per-step signal ledger.

Design decision: one Configurable component, ``Ledger``, owns the ``ledger``
config section and all run-time ledger state, following torchtitan's pattern
(nested ``@dataclass(kw_only=True, slots=True) Config``, attribute docstrings as
``--help``). ``LedgerTrainer`` calls it at three points of a step: ``begin``,
``record`` (after the clip, before ``optimizers.step``) and ``drain``.

Cost discipline: per step the ledger adds exactly two collectives over the world
-- one SUM of a packed fp64 vector (loss sums, token counts, zero counts, param
and per-layer grad sums of squares) and one MAX of a packed fp32 vector (max
attention logit) -- and no blocking device->host copy: the results are copied
``non_blocking`` into pinned memory behind a CUDA event and written when the
event has completed (usually at the next step). On torchtitan's logging steps,
which synchronise anyway (``.item()``), pending rows are drained first, so
loggers always see steps in order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from titan_ledger import records
from titan_ledger.attention import MaxLogitRecorder
from titan_ledger.data.layout import RowTag, parse_skip_steps, window_at
from titan_ledger.signals import ParamPlan, clipped_norm, local_sums, natural_key
from titan_ledger.spikes import RULES, SpikeDetector, describe


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

        folder: str = "ledger"
        """Ledger folder, relative to ``dump_folder``."""

        skip_steps: list[str] = field(default_factory=list)
        """Steps whose data is consumed without forward/backward or update: absolute,
        1-indexed, inclusive ranges or single steps, e.g. ``["137000-137300", "140001"]``
        (on the command line also comma-separated). Needs LedgerDataLoader."""

        skip_lr: Literal["freeze", "advance"] = "freeze"
        """LR schedule over skipped steps: ``freeze`` (Megatron: the schedule does not
        advance) or ``advance`` (as if the steps had trained)."""

        allow_data_change: bool = False
        """Resume even if the checkpoint's data fingerprint (source, tokenizer,
        seq_len, seed) differs from this run's."""

        spike: SpikeDetector.Config = field(default_factory=SpikeDetector.Config)
        """Spike rules on loss and grad norm (on device, every step)."""

        on_spike: Literal["none", "skip_update", "rollback"] = "none"
        """What a flagged step does: ``none`` (record it), ``skip_update`` (do not apply
        its optimizer update; Adam's step count does not advance; costs one
        device->host read of the flag per step), ``rollback`` (reload the last
        checkpoint at or before step - rollback_back, skip rollback_skip steps from
        there and continue in the same process)."""

        rollback_back: int = 100
        """``on_spike = "rollback"``: go back to a checkpoint at or before spike - this many steps."""

        rollback_skip: int = 200
        """``on_spike = "rollback"``: steps skipped from the checkpoint on (the window
        is widened to reach the spike step)."""

        max_rollbacks: int = 3
        """``on_spike = "rollback"``: stop with an error after this many rewinds in one run."""

        auto_skip: bool = False
        """Add the steps listed in ``<dump_folder>/ledger/rejected_steps.jsonl`` (every
        flagged step of earlier launches) to ``skip_steps`` (Megatron's tracker-file flow)."""

        inject: str = ""
        """Rehearsal only: ``STEP:DP_RANK:KIND`` replaces that DP rank's batch at that step
        by a single repeated token (``repeat``) or uniform random tokens (``random``);
        see ``python -m titan_ledger.replay inject``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.enabled = False  # until setup() binds a trainer
        # consumed counters: checkpointed with the trainer state
        self.consumed_samples = 0
        self._consumed_tokens = torch.zeros((), dtype=torch.float64)  # on device after setup
        self._pending: deque[_Pending] = deque()
        self._writer: records.RecordWriter | None = None
        self._rank_writer: records.RecordWriter | None = None
        self._attn: list[MaxLogitRecorder] = []
        self.skipped_samples = 0
        self._data_writer: records.RecordWriter | None = None
        self.loader = None  # a LedgerDataLoader, when the run uses one
        # parsed here so a bad entry fails before any process group exists
        self.skip_windows = parse_skip_steps(config.skip_steps)
        self.inject = parse_inject(config.inject)
        self.detector: SpikeDetector | None = None
        self._detector_state = None
        self._spike_writer: records.RecordWriter | None = None
        self._rejected_writer: records.RecordWriter | None = None
        self.last_flag: torch.Tensor | None = None  # this step's spike flag (device)
        self.rewinds = 0

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        """Bind to a built trainer (after model, optimizer and dataloader exist)."""
        from titan_ledger.dataloader import LedgerDataLoader

        cfg = self.config
        self.enabled = cfg.signals
        pd = trainer.parallel_dims
        self.device = trainer.device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.max_norm = float(trainer.config.training.max_norm)
        self.pp = pd.pp if pd.pp_enabled else 1
        if pd.dp_enabled:
            bm = pd.get_mesh("batch")
            self.dp_size, self.dp_rank = bm.size(), bm.get_local_rank()
        else:
            self.dp_size, self.dp_rank = 1, 0
        tp_mesh = pd.get_optional_mesh("tp")
        tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
        cp_mesh = pd.get_optional_mesh("cp")
        last_stage = trainer.pp_has_last_stage if pd.pp_enabled else True
        # Loss sums: every CP rank holds a piece of the sequence, so all of them add
        # theirs; token counts: every CP rank sees the whole batch's labels, so one.
        self.owns_loss = last_stage and tp_rank == 0
        self.owns_tokens = self.owns_loss and (cp_mesh is None or cp_mesh.get_local_rank() == 0)
        self.global_batch = (trainer.config.training.local_batch_size * self.dp_size
                             * trainer.gradient_accumulation_steps)
        self.seq_len = trainer.config.training.seq_len
        self.tokenizer_path = str(Path(trainer.config.hf_assets_path).resolve())
        pp_mesh = pd.get_optional_mesh("pp")
        first_stage = pp_mesh is None or pp_mesh.get_local_rank() == 0
        loader = trainer.dataloader
        self.loader = loader if isinstance(loader, LedgerDataLoader) else None
        self.folder = Path(trainer.config.dump_folder) / cfg.folder
        if cfg.auto_skip:
            rejected = read_rejected(self.folder)
            self.skip_windows = parse_skip_steps(
                [f"{a}-{b}" for a, b in self.skip_windows] + [str(t) for t in rejected])
        if cfg.on_spike != "none" and not (cfg.signals and cfg.spike.enable):
            raise ValueError(f"--ledger.on_spike {cfg.on_spike} needs --ledger.signals and "
                             f"--ledger.spike.enable")
        if cfg.on_spike == "rollback" and not trainer.config.checkpoint.enable:
            raise ValueError("--ledger.on_spike rollback reloads checkpoints: set --checkpoint.enable")
        if self.skip_windows and self.loader is None:
            raise ValueError("--ledger.skip_steps needs LedgerDataLoader (a titan_ledger config "
                             "function such as debug_cpu); this run's dataloader is "
                             f"{type(loader).__name__}")
        # one writer per DP rank: the rank of that DP group with tp = cp = pp = 0
        self.writes_data = (self.loader is not None and self.loader.tagging and tp_rank == 0
                            and (cp_mesh is None or cp_mesh.get_local_rank() == 0) and first_stage)
        # one run id for all ranks (rank 0's), agreed once at setup
        ids = [uuid.uuid4().hex[:12]]
        if dist.is_initialized():
            dist.broadcast_object_list(ids, src=0)
        self.run_id = ids[0]
        self.config_digest = _digest(trainer.config)
        if not self.enabled:
            return

        named = [(n, p) for m in trainer.model_parts for n, p in m.named_parameters()]
        groups = None
        if cfg.per_layer:
            local_groups = ParamPlan.build(named, self.world, self.pp).groups
            gathered: list[list[str]] = [None] * self.world  # type: ignore[list-item]
            if dist.is_initialized():
                dist.all_gather_object(gathered, local_groups)  # once, at setup
            else:
                gathered = [local_groups]
            groups = sorted({g for gs in gathered for g in gs}, key=natural_key)
        self.plan = ParamPlan.build(named, self.world, self.pp, groups)
        self.plan.group_index = self.plan.group_index.to(self.device)  # no H2D copy per step
        self._attn = [m for part in trainer.model_parts for m in part.modules()
                      if isinstance(m, MaxLogitRecorder)]
        for m in self._attn:
            m.record_max_logit = cfg.max_logit
        if pd.pp_enabled:
            _forget_pp_metadata_inference(trainer.pp_schedule, self._attn)

        self._cuda = self.device.type == "cuda"
        self._consumed_tokens = self._consumed_tokens.to(self.device)
        if cfg.spike.enable:
            self.detector = SpikeDetector(cfg.spike, self.device)
            if self._detector_state is not None:
                self.detector.load_state_dict(self._detector_state)

    def open(self, resumed_from: int, rewind_from: int | None = None) -> None:
        """Start this run's segment in the ledger files (after checkpoint load)."""
        header = {"run_id": self.run_id, "config_digest": self.config_digest,
                  "resumed_from": resumed_from, "world_size": self.world,
                  "dp_size": self.dp_size, "time": time.time()}
        if rewind_from is not None:
            # a rewind is a new segment of the same process: its own id, so the
            # readers' cross-file supersession sees it as a later run
            header.update(run_id=f"{self.run_id}.r{self.rewinds}", rewind_from=rewind_from)
        if self.writes_data:
            self._data_writer = records.RecordWriter(
                self.folder / f"data_dp{self.dp_rank}.jsonl",
                {"schema": records.DATA_SCHEMA, **header, **self.loader.header(),
                 "global_batch": self.global_batch, "skip_lr": self.config.skip_lr,
                 "tokenizer": self.tokenizer_path,
                 "skip_steps": [list(w) for w in self.skip_windows]})
        if not self.enabled:
            return
        if self.rank == 0:
            self._writer = records.RecordWriter(
                self.folder / "signals.jsonl",
                {"schema": records.SIGNALS_SCHEMA, **header,
                 "keys": list(records.SIGNAL_KEYS),
                 "per_layer": self.plan.groups if self.config.per_layer else None})
        if self.rank == 0 and self.detector is not None:
            # event logs, not step histories: no resumed_from, so no event is ever
            # superseded (a spike that caused a rewind stays on record)
            events = {k: v for k, v in header.items() if k != "resumed_from"}
            events["started_after_step"] = resumed_from
            self._spike_writer = records.RecordWriter(
                self.folder / "spikes.jsonl", {"schema": records.SPIKES_SCHEMA, **events,
                                               "rules": _asdict(self.config.spike),
                                               "on_spike": self.config.on_spike})
            self._rejected_writer = records.RecordWriter(
                self.folder / "rejected_steps.jsonl", {"schema": records.REJECTED_SCHEMA, **events})
        if self.owns_tokens:
            self._rank_writer = records.RecordWriter(
                self.folder / f"rank{self.rank}.jsonl",
                {"schema": records.RANK_SCHEMA, **header, "rank": self.rank, "dp_rank": self.dp_rank})

    # ------------------------------------------------------------------ per step
    def record(
        self,
        *,
        step: int,
        local_loss_sum: torch.Tensor | None,
        local_tokens: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        step_start: float,
        data_loading_s: float,
        skipped: bool = False,
    ) -> None:
        """Reduce this step's signals (2 collectives) and queue the row.

        Call after ``clip_grad_norm_`` and before ``optimizers.step()``: zeros and
        norms are read from the gradients about to be applied.
        """
        if not self.enabled:
            return
        dev = self.device
        sums = local_sums(self.plan, self.config.per_layer, dev)
        # SUM vector: [loss_sum, tokens, loss_sum_by_dp (dp), tokens_by_dp (dp), zeros,
        #              param_sq, grad_sq (per layer)] in fp64 (exact token/zero counts)
        dp = self.dp_size
        loss_by_dp = torch.zeros(dp, dtype=torch.float64, device=dev)
        tok_by_dp = torch.zeros(dp, dtype=torch.float64, device=dev)
        if self.owns_loss and local_loss_sum is not None:
            loss_by_dp[self.dp_rank] = local_loss_sum.detach().double()
        if self.owns_tokens:
            tok_by_dp[self.dp_rank] = local_tokens.double()
        parts = [loss_by_dp, tok_by_dp, sums["num_zeros"].double().reshape(1),
                 sums["param_sq"].double().reshape(1)]
        if self.config.per_layer:
            parts.append(sums["grad_sq"].double())
        packed_sum = torch.cat(parts)
        logits = [m.take_max_logit(dev) for m in self._attn]
        packed_max = (torch.stack(logits).amax() if logits else
                      torch.full((), float("-inf"), device=dev)).float().reshape(1)
        if self.world > 1:
            dist.all_reduce(packed_sum, op=dist.ReduceOp.SUM)
            dist.all_reduce(packed_max, op=dist.ReduceOp.MAX)
        # counters advance on device and on the host without waiting for the row
        self.consumed_samples += self.global_batch
        self._consumed_tokens = self._consumed_tokens + packed_sum[dp:2 * dp].sum()
        extra = torch.stack([grad_norm.detach().double(),
                             clipped_norm(grad_norm.detach(), self.max_norm).double(),
                             self._consumed_tokens])
        host = [packed_sum, packed_max, extra]
        if self.detector is not None:
            # reduced values only: every rank reaches the same flag, no collective, no sync
            loss_dev = packed_sum[:dp].sum() / packed_sum[dp:2 * dp].sum()
            stats = self.detector.step(loss_dev, grad_norm.detach())
            self.last_flag = stats[0] > 0
            host.append(stats)
        event = None
        if self._cuda:
            host = [t.to("cpu", non_blocking=True) for t in host]
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_Pending(step, host, event, lr, skipped, time.perf_counter() - step_start,
                                      data_loading_s, self.consumed_samples))

    def mark_update_skipped(self) -> None:
        """The update guard did not apply the last recorded step's update."""
        self._pending[-1].update_skipped = True

    # ------------------------------------------------------------------ data ledger
    def skip_window_at(self, step: int) -> tuple[int, int] | None:
        return window_at(self.skip_windows, step)

    def record_data(self, step: int, tags: list[RowTag], injected: str | None = None) -> None:
        """This DP rank's rows of ``step`` -> ``data_dp<r>.jsonl`` (host-only, no sync)."""
        if self._data_writer is not None:
            row = {"step": step, "skipped": False, "rows": [t.to_json() for t in tags]}
            if injected:
                row["injected"] = injected  # the rows' tokens were replaced (rehearsal)
            self._data_writer.write(row)

    def record_skip(self, *, first: int, last: int, info, lr: float, step_start: float,
                    metrics_logger=None) -> None:
        """A skipped window: data consumed, no forward/backward, no update.

        One data-ledger row per DP rank (the sample range; explicit rows for text
        streams, whose content is not a function of the id) and one signals row for
        the whole window, so a skip of 10^6 steps costs two lines.
        """
        n = info.position_after - info.position_before
        self.consumed_samples += n
        self.skipped_samples += n
        self._consumed_tokens = self._consumed_tokens + n * self.seq_len
        if self._data_writer is not None:
            row = {"step": first, "last_step": last, "skipped": True,
                   "samples": [info.position_before, info.position_after],
                   "layout": {"mbs": self.loader.mbs, "dp_size": self.dp_size,
                              "global_batch": self.global_batch}}
            if info.tags is not None:
                row["rows"] = [t.to_json() for t in info.tags]
            self._data_writer.write(row)
        if not self.enabled:
            return
        self.drain(block=True, metrics_logger=metrics_logger)  # keep rows in step order
        row = {k: None for k in records.SIGNAL_KEYS}
        row.update({"step": first, "last_step": last, "consumed_samples": self.consumed_samples,
                    "consumed_tokens": int(self._consumed_tokens.item()), "lr": lr,
                    "skipped": True, "skipped_samples": self.skipped_samples,
                    "skip_lr": self.config.skip_lr,
                    "step_time_s": time.perf_counter() - step_start, "data_loading_s": 0.0})
        if self._writer is not None:
            self._writer.write(row)
        if metrics_logger is not None:
            metrics_logger.log({"ledger/skipped": 1.0, "ledger/skipped_samples": float(self.skipped_samples),
                                "ledger/consumed_samples": float(self.consumed_samples)}, first)

    def drain(self, block: bool, metrics_logger=None) -> None:
        """Write every pending row whose device->host copy is done (in step order)."""
        while self._pending:
            p = self._pending[0]
            if p.event is not None and not block and not p.event.query():
                return
            if p.event is not None:
                p.event.synchronize()
            self._pending.popleft()
            self._write(p, metrics_logger)

    def _write(self, p: "_Pending", metrics_logger) -> None:
        dp = self.dp_size
        s, mx, ex = (t.tolist() for t in p.host[:3])
        stats = p.host[3].tolist() if len(p.host) > 3 else None
        spike = bool(stats[0]) if stats is not None else None
        loss_by_dp, tok_by_dp = s[:dp], s[dp:2 * dp]
        zeros, param_sq = s[2 * dp], s[2 * dp + 1]
        tokens = sum(tok_by_dp)
        loss = sum(loss_by_dp) / tokens if tokens else float("nan")
        local_avg = [lv / t if t else float("-inf") for lv, t in zip(loss_by_dp, tok_by_dp)]
        max_rank = max(range(dp), key=lambda r: (local_avg[r] if not math.isnan(local_avg[r])
                                                 else float("inf")))
        row = {
            "step": p.step,
            "consumed_samples": p.consumed_samples,
            "consumed_tokens": int(ex[2]),
            "loss": loss,
            "loss_max": local_avg[max_rank],
            "loss_max_rank": max_rank,
            "grad_norm": ex[0],
            "grad_norm_clipped": ex[1],
            "num_zeros": int(zeros),
            "param_norm": math.sqrt(param_sq),
            "max_logit": mx[0] if self.config.max_logit else None,
            "lr": p.lr,
            "skipped": p.skipped,
            "skipped_samples": self.skipped_samples,
            "spike": spike,
            "update_skipped": p.update_skipped,
            "step_time_s": p.step_time_s,
            "data_loading_s": p.data_loading_s,
        }
        if self.config.per_layer:
            row[records.PER_LAYER_KEY] = {
                g: math.sqrt(v) for g, v in zip(self.plan.groups, s[2 * dp + 2:])}
        if self._writer is not None:
            self._writer.write(row)
        if self._rank_writer is not None:
            lt = tok_by_dp[self.dp_rank]
            self._rank_writer.write({"step": p.step, "loss": loss_by_dp[self.dp_rank] / lt if lt else None,
                                     "tokens": int(lt)})
        if metrics_logger is not None:
            metrics_logger.log(_dashboard(row), p.step)
        if spike:
            self._spike_event(row, stats, metrics_logger)
        if not math.isfinite(loss):
            self.close()
            raise RuntimeError(
                f"titan_ledger: loss is not finite ({loss}) at step {p.step}; the row is in "
                f"{self.folder / 'signals.jsonl'}. Stopping training."
            )

    def _spike_event(self, row: dict, stats: list[float], metrics_logger) -> None:
        ev = {"step": row["step"], "loss": row["loss"], "grad_norm": row["grad_norm"],
              "loss_max": row["loss_max"], "loss_max_rank": row["loss_max_rank"],
              "max_logit": row["max_logit"], **describe(stats),
              "action": self.config.on_spike}
        if self._spike_writer is not None:
            self._spike_writer.write(ev)
            self._rejected_writer.write({"step": row["step"], "rules": ev["rules"]})
        if self.rank == 0:
            logger.warning(
                f"titan_ledger: SPIKE at step {row['step']}: loss {row['loss']:.4f} (window mean "
                f"{ev['loss_mean']:.4f}, std {ev['loss_std']:.4f}), grad norm {row['grad_norm']:.4f} "
                f"(median {ev['grad_norm_median']:.4f}); rules {', '.join(ev['rules'])}; worst DP "
                f"rank {row['loss_max_rank']}; action: {self.config.on_spike}")
        if metrics_logger is not None:
            metrics_logger.log({"spike/flag": 1.0, **{f"spike/{r}": float(r in ev["rules"]) for r in RULES},
                                "spike/loss": float(row["loss"]), "spike/grad_norm": float(row["grad_norm"])},
                               row["step"])

    def spike_flag_now(self) -> bool:
        """Read this step's flag on the host (the update guard and rollback need it
        before ``optimizers.step()``: one device->host read)."""
        return bool(self.last_flag.item()) if self.last_flag is not None else False

    def rewind(self, *, from_step: int, to_step: int, window: tuple[int, int], metrics_logger=None) -> None:
        """In-process rollback: close this segment, open one that supersedes rows after
        ``to_step`` (readers treat it like a relaunch that resumed there)."""
        self.drain(block=True, metrics_logger=metrics_logger)
        if self._spike_writer is not None:
            self._spike_writer.write({"step": from_step, "rewind_to": to_step,
                                      "skip_window": list(window), "action": "rollback"})
        self.close()
        self.rewinds += 1
        self.skip_windows = parse_skip_steps(
            [f"{a}-{b}" for a, b in self.skip_windows] + [f"{window[0]}-{window[1]}"])
        self.open(resumed_from=to_step, rewind_from=from_step)

    def close(self) -> None:
        for w in (self._writer, self._rank_writer, self._data_writer, self._spike_writer,
                  self._rejected_writer):
            if w is not None:
                w.close()

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        # read at checkpoint time only (a checkpoint save synchronises anyway)
        return {"consumed_samples": self.consumed_samples,
                "consumed_tokens": int(self._consumed_tokens.item()),
                "skipped_samples": self.skipped_samples,
                "spike_detector": json.dumps(self.detector.state_dict()) if self.detector else ""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed_samples = int(state.get("consumed_samples", 0))
        self.skipped_samples = int(state.get("skipped_samples", 0))
        det = state.get("spike_detector")
        self._detector_state = json.loads(det) if det else None
        if self.detector is not None and self._detector_state is not None:
            self.detector.load_state_dict(self._detector_state)
        self._consumed_tokens = torch.tensor(float(state.get("consumed_tokens", 0)),
                                             dtype=torch.float64, device=self._consumed_tokens.device)


@dataclass
class _Pending:
    step: int
    host: list[torch.Tensor]
    event: Any
    lr: float
    skipped: bool
    step_time_s: float
    data_loading_s: float
    consumed_samples: int
    update_skipped: bool = False


def _forget_pp_metadata_inference(schedule, recorders: list[MaxLogitRecorder]) -> None:
    """Drop logits seen during PP metadata inference (synthetic activations).

    torch 2.14's pipeline schedules run one real forward/backward on made-up
    inputs to infer stage shapes, inside the first ``schedule.step()``; the stage
    then calls ``_post_metadata_inference_cleanup``. We extend that cleanup to
    forget what the attention recorders saw. Private torch API: if it moves, the
    PP exactness test fails rather than a wrong max_logit going unnoticed.
    """
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
        if cleanup is None:
            continue

        def wrapped(*args, _cleanup=cleanup, **kwargs):
            try:
                return _cleanup(*args, **kwargs)
            finally:
                for r in recorders:
                    r.max_logit = None

        stage._post_metadata_inference_cleanup = wrapped


def _dashboard(row: dict[str, Any]) -> dict[str, float]:
    """Row -> ``ledger/<key>`` scalars for torchtitan's TensorBoard / W&B loggers."""
    out = {}
    for k, v in row.items():
        if k == records.PER_LAYER_KEY:
            out.update({f"ledger/grad_norm_per_layer/{g}": x for g, x in v.items()})
        elif k != "step" and v is not None:
            out[f"ledger/{k}"] = float(v)
    return out


def _digest(config) -> str:
    """SHA-256 of the config, stable across processes (no object addresses)."""
    blob = json.dumps(config.to_dict(), sort_keys=True, default=repr)
    blob = re.sub(r" at 0x[0-9a-f]+", "", blob)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def parse_inject(spec: str) -> tuple[int, int, str] | None:
    """``"STEP:DP_RANK:KIND"`` -> (step, dp_rank, kind)."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        step, rank, kind = int(parts[0]), int(parts[1]), parts[2]
    except (IndexError, ValueError):
        raise ValueError(f"--ledger.inject {spec!r}: write STEP:DP_RANK:KIND, e.g. 8:1:repeat") from None
    if kind not in ("repeat", "random") or step < 1 or rank < 0:
        raise ValueError(f"--ledger.inject {spec!r}: KIND is repeat or random; STEP >= 1; DP_RANK >= 0")
    return step, rank, kind


def read_rejected(folder: Path) -> list[int]:
    """Steps flagged by earlier launches (``rejected_steps.jsonl``, current history)."""
    path = folder / "rejected_steps.jsonl"
    if not path.exists():
        return []
    return sorted({int(r["step"]) for r in records.read_ledger(path).history if "rules" in r})


def _asdict(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
