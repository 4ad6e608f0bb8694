"""The signal recorder: per-step signals reduced on device, written a step late.

Design decision: one collective per step and no blocking device->host copy.
Every rank packs what it owns into one fp64 vector -- loss sum, token count,
zeros in grads, param sum of squares, max attention logit, per-layer grad sums
of squares -- and ONE all-gather gives every rank the whole ``[world, K]`` table.
Sums (per DP rank for loss and tokens, over the world for the rest) and the max
are then local tensor ops in rank order, so every rank holds the same reduced
values (the spike rules need that, with no further collective) and the result
is deterministic. The reduced vector is copied ``non_blocking`` into pinned
memory behind a CUDA event and turned into a row when the event has completed
(usually at the next step). On torchtitan's logging steps, which synchronise
anyway, pending rows are drained first so loggers see steps in order.

Rows have exactly :data:`records.SIGNAL_KEYS`, in that order; the writer of ``signals.jsonl`` is
rank 0, and every rank that owns tokens writes its own ``rank<r>.jsonl`` (its DP
group's loss, for per-rank forensics). The reduced vector's fixed slots are named, not
counted: the table's (:data:`titan_ledger.format.signal_columns.DEVICE_SLOTS`, one per
column the device reduces) then the recorder's scratch (:data:`SLOTS`); the recorder fills
them by name and the row reads them back by name, so a column added to the table is a slot
here without any position to keep in step by hand.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.sums import ParamPlan, clip_coef, local_sums, snapshot, update_sq
from titan_ledger.components.signals.topology import Topology
from titan_ledger.format import records, signal_columns

# the local vector every rank contributes to the all-gather: one value per name, in this
# order, then per-layer grad sums of squares, this rank's per-document summary and QK-clip's
# heads; log Z's four are LogZStats.take's, in its order (loss-owning ranks)
_LOCAL = ("loss_sum", "tokens", "num_zeros", "param_sq", "max_logit", "masked_tokens",
          "logz_sq", "logz_sum", "logz_max", "logz_tokens")
_AT = {name: i for i, name in enumerate(_LOCAL)}
_LOGZ = _AT["logz_sq"]
_FIXED = len(_LOCAL)  # where the per-layer sums start

#: the reduced vector's fixed slots, after the loss and tokens by DP rank: the table's (each
#: holds a column's value), then the recorder's scratch -- what a row's value is computed
#: from that no column holds (log Z's token count divides z_loss and logz_mean)
SLOTS: tuple[str, ...] = (*signal_columns.DEVICE_SLOTS, "logz_tokens")
_SLOT_SET = frozenset(SLOTS)
_ROW_KEYS = frozenset(records.SIGNAL_KEYS)


@dataclass
class Reduced:
    """One step's reduced signals, on device, identical on every rank."""

    vector: torch.Tensor  # the row's values (see SignalRecorder.reduce)
    loss: torch.Tensor  # global mean loss
    dp_loss: torch.Tensor  # [dp] each DP rank's mean loss
    doc: torch.Tensor | None  # [dp, 5] median segment loss, highest and lowest segment mean, ranked
    # segments, distinct documents (see spikes.SpikeDetector.step)


class NonFiniteRow(RuntimeError):
    """A written signals row's loss is NaN/inf: training stops (the row is written first).
    Not :class:`titan_ledger.errors.NonFiniteLoss` (torchtitan's own loss check, which
    ``Recovery.settling`` answers by deciding a held step): this stop is the ledger's own,
    after the row."""


def check_finite(row: dict[str, Any], path: str) -> None:
    """Stop training at a written row whose loss is NaN/inf (``path``: where it is)."""
    if not math.isfinite(row["loss"]):
        raise NonFiniteRow(f"titan_ledger: loss is not finite ({row['loss']}) at step {row['step']}; the row "
                           f"is in {path}. Stopping training.")


@dataclass
class _Pending:
    rec: StepRecord  # the step's facts, carried untouched to the fan-out
    host: torch.Tensor  # the reduced vector (on the host once ``event`` completes)
    extra: torch.Tensor | None  # e.g. the spike rules' stats, copied with it
    event: Any


@dataclass(frozen=True)
class RowLayout:
    """How a reduced host vector reads (fixed for the run)."""

    dp_size: int
    dp_rank: int
    max_logit: bool
    qk_clip: bool
    per_layer_groups: list[str] | None  # the per-layer norm groups, when recorded
    #: whether the spike rules' stats say "a note, no acting rule" (detection's ``spikes.is_note``:
    #: the stats' layout is detection's, which sits above the signals)
    note_of: Callable[[list[float]], bool] | None = None


@dataclass
class Completed:
    """A step whose device->host copy is done: its rows, built, ready to fan out."""

    rec: StepRecord
    row: dict[str, Any]  # signals.jsonl (rank 0 writes it)
    rank_row: dict[str, Any]  # rank<r>.jsonl (every rank that owns tokens writes its own)
    doc: dict | None  # this DP rank's per-document summary (the data row's doc_loss)
    stats: list[float] | None  # the spike rules' stats


class SignalRecorder:
    def __init__(self, topo: Topology, *, device: torch.device, plan: ParamPlan, attn: list,
                 per_layer: bool, max_logit: bool, max_norm: float, global_batch: int, seq_len: int,
                 doc_loss=None, logz=None, qk_clip=None, note_of: Callable[[list[float]], bool] | None = None):
        self.topo = topo
        self.device = device
        self.plan = plan
        self.attn = attn
        self.per_layer = per_layer
        self.max_logit = max_logit
        self.max_norm = max_norm
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.consumed_samples = 0
        self.skipped_samples = 0
        self._consumed_tokens = torch.zeros((), dtype=torch.float64, device=device)
        self._dp_of = torch.tensor(topo.dp_rank_of, dtype=torch.long, device=device)
        # each DP rank's loss-owning rank, on device once (no per-step index copy)
        self._loss_rows = torch.tensor(topo.loss_rank_of_dp, dtype=torch.long, device=device)
        self._pending: deque[_Pending] = deque()
        self._cuda = device.type == "cuda"
        self._writer: records.RecordWriter | None = None
        self._rank_writer: records.RecordWriter | None = None
        self.collectives_per_step = 1 if topo.world > 1 else 0
        self.doc_loss = doc_loss  # a DocLossTracker, when per-document losses are on
        self.logz = logz  # a LogZStats, when the loss is titan_ledger's
        self._n_layers = len(plan.groups) if per_layer else 0
        self._before: list[torch.Tensor] | None = None  # [ledger] update_norm: the step's params before the update
        self.qk_clip = qk_clip  # a QKClip: per-head maxima ride along in the all-gather
        # QK-clip off: its two row values are NaN (made once, not a fill kernel every step)
        self._qk_off = torch.full((2,), float("nan"), dtype=torch.float64, device=device)
        self.layout = RowLayout(topo.dp_size, topo.dp_rank, max_logit, qk_clip is not None,
                                plan.groups if per_layer else None, note_of)

    # ------------------------------------------------------------------ files
    def open(self, folder: Path, header: records.Header) -> None:
        if self.topo.is_rank0:
            self._writer = records.RecordWriter(
                folder / records.SIGNALS_FILE,
                records.Header(**{**header.__dict__, "schema": records.SIGNALS.id,
                                  "extra": {**header.extra, "keys": list(records.SIGNAL_KEYS),
                                            "per_layer": self.plan.groups if self.per_layer else None}}))
        if self.topo.owns_tokens:
            self._rank_writer = records.RecordWriter(
                folder / records.rank_file(self.topo.rank),
                records.Header(**{**header.__dict__, "schema": records.RANK.id,
                                  "extra": {**header.extra, "rank": self.topo.rank,
                                            "dp_rank": self.topo.dp_rank}}))

    def close(self) -> None:
        for w in (self._writer, self._rank_writer):
            if w is not None:
                w.close()

    @property
    def rows_written(self) -> int:
        return self._writer.rows if self._writer is not None else 0

    # ------------------------------------------------------------------ per step
    def reduce(self, *, local_loss_sum: torch.Tensor | None, local_tokens: int,
               grad_norm: torch.Tensor, masked_tokens: int = 0) -> Reduced:
        """One all-gather; returns the reduced vector and what the spike rules read, on device.

        Reduced layout: ``[loss by DP rank (dp), tokens by DP rank (dp), the named
        SLOTS..., grad_sq per layer..., this DP rank's per-document summary...]``. With
        QK-clip the local vector also carries this rank's per-head max logits (``QKClip.place``).
        """
        topo, dev = self.topo, self.device
        sums = local_sums(self.plan, self.per_layer, dev)
        taken = [(m, m.take_max_logit(dev)) for m in self.attn]
        logits = [v.amax() for _, v in taken]
        n_doc = self.doc_loss.size if self.doc_loss is not None else 0
        doc0 = _FIXED + self._n_layers  # this rank's per-document summary, then QK-clip's heads
        qk0 = doc0 + n_doc
        loc = torch.zeros(qk0 + (self.qk_clip.size if self.qk_clip else 0), dtype=torch.float64, device=dev)
        if topo.owns_loss and local_loss_sum is not None:
            loc[_AT["loss_sum"]] = local_loss_sum.detach().double()
        if topo.owns_tokens:
            loc[_AT["tokens"]] = float(local_tokens)  # a host int: no copy
            loc[_AT["masked_tokens"]] = float(masked_tokens)
        loc[_AT["num_zeros"]] = sums["num_zeros"].double()
        loc[_AT["param_sq"]] = sums["param_sq"].double()
        loc[_AT["max_logit"]] = torch.stack(logits).amax().double() if logits else float("-inf")
        loc[_AT["logz_max"]] = float("-inf")
        if self.logz is not None:
            z = self.logz.take()  # every call of this step, also on ranks that own no loss
            if z is not None and topo.owns_loss:
                loc[_LOGZ:_LOGZ + 4] = z
        if self.per_layer:
            loc[_FIXED:_FIXED + self._n_layers] = sums["grad_sq"].double()
        if n_doc:
            with record_function("titan_ledger.doc_loss"):
                loc[doc0:qk0] = self.doc_loss.summary(dev)
        if self.qk_clip is not None:
            self.qk_clip.place(loc[qk0:], taken)
        if topo.world > 1:
            table = torch.empty(topo.world * loc.numel(), dtype=torch.float64, device=dev)
            dist.all_gather_single(table, loc)  # the step's one collective (all_gather_into_tensor)
            table = table.view(topo.world, -1)
        else:
            table = loc.view(1, -1)
        dp = topo.dp_size
        world = lambda name: table[:, _AT[name]]  # noqa: E731 (one local slot, every rank's)
        loss_by_dp = torch.zeros(dp, dtype=torch.float64, device=dev).index_add_(0, self._dp_of, world("loss_sum"))
        tok_by_dp = torch.zeros(dp, dtype=torch.float64, device=dev).index_add_(0, self._dp_of, world("tokens"))
        self._consumed_tokens = self._consumed_tokens + tok_by_dp.sum()
        gn = grad_norm.detach().double().reshape(1)
        coef = clip_coef(gn, self.max_norm)
        qk = self.qk_clip.reduce(table[:, qk0:]) if self.qk_clip is not None else self._qk_off
        logz = table[:, _LOGZ:_LOGZ + 2].sum(0)  # sum log Z^2 and sum log Z: one reduction
        slots = {"num_zeros": world("num_zeros").sum(), "param_sq": world("param_sq").sum(),
                 "max_logit": world("max_logit").amax(), "grad_norm": gn, "grad_norm_clipped": gn * coef,
                 "consumed_tokens": self._consumed_tokens, "masked_tokens": world("masked_tokens").sum(),
                 "logz_sq": logz[0], "logz_sum": logz[1], "logz_max": world("logz_max").amax(),
                 "logz_tokens": world("logz_tokens").sum(), "qk_clip_heads": qk[0], "qk_clip_eta_min": qk[1]}
        if slots.keys() != _SLOT_SET:  # a slot the table declares and nothing fills, or one it does not
            raise RuntimeError(f"SignalRecorder.reduce fills {sorted(slots)}, the reduced vector's slots are "
                               f"{sorted(SLOTS)} (signal_columns.DEVICE_SLOTS and the recorder's own)")
        # the gradients were read after the clip: per-layer sums of squares are
        # scaled back to their pre-clip values (the global norm is the clip's own)
        reduced = torch.cat([
            loss_by_dp, tok_by_dp, *(slots[name].reshape(1) for name in SLOTS),
            table[:, _FIXED:_FIXED + self._n_layers].sum(0) / coef.square(),
            # the per-document summary of this rank's DP group, from the rank that owns its loss
            table[topo.loss_rank_of_dp[topo.dp_rank], doc0:qk0]])
        doc = None
        if n_doc:
            d = table.index_select(0, self._loss_rows)[:, doc0:qk0]
            h, k = self.doc_loss.HEAD, self.doc_loss.k
            doc = torch.stack([d[:, 2], d[:, h + 1] / d[:, h + 2],
                               d[:, h + 3 * k + 1] / d[:, h + 3 * k + 2], d[:, 1], d[:, 3]], dim=1)
        return Reduced(reduced, loss_by_dp.sum() / tok_by_dp.sum(), loss_by_dp / tok_by_dp, doc)

    def queue(self, rec: StepRecord, reduced: torch.Tensor, extra: torch.Tensor | None) -> None:
        """Start the device->host copy of this step's row; never waits. ``rec`` rides along."""
        self.consumed_samples += self.global_batch
        rec.consumed_samples = self.consumed_samples
        rec.step_time_s = time.perf_counter() - rec.start
        event = None
        if self._cuda:
            reduced = reduced.to("cpu", non_blocking=True)
            extra = extra.to("cpu", non_blocking=True) if extra is not None else None
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_Pending(rec, reduced, extra, event))

    def attach_update(self, applied: bool, rec: StepRecord | None = None) -> None:
        """[ledger] update_norm, after ``optimizers.step``: the update norm of the newest
        queued step (or of ``rec``, a deferred decision's step) from the snapshot taken
        before it (:func:`signals.update_sq`; 0 when the update was not applied, on the
        host's word or the device's). One all-reduce of one scalar (the option's cost);
        the host copy rides with the row (a new event replaces the step's)."""
        p = next((q for q in self._pending if q.rec is rec), None) if rec is not None else \
            (self._pending[-1] if self._pending else None)
        if p is None or self._before is None:
            return
        sq = update_sq(self.plan, self._before, self.device) if applied else torch.zeros((), device=self.device)
        self._before = None
        if self.topo.world > 1:
            dist.all_reduce(sq)
        if self._cuda:
            sq = sq.to("cpu", non_blocking=True)
            p.event = torch.cuda.Event()
            p.event.record()
        p.rec.update_sq = sq

    def untrain(self, tokens: int) -> None:
        """``tokens`` counted as consumed that a proof's mask kept from training: the running
        ``consumed_tokens`` counts what trained (this step's row, :attr:`StepRecord.trained`,
        and every later one)."""
        self._consumed_tokens = self._consumed_tokens - float(tokens)

    def snapshot_params(self) -> None:
        """[ledger] update_norm, before ``optimizers.step``: this rank's owned parameter pieces."""
        self._before = snapshot(self.plan)

    def host_stats(self, rec: StepRecord) -> list[float] | None:
        """A queued step's spike stats on the host: waits for its own copy only (queued a
        step ago, behind the work since), never for the device's later work."""
        p = next((q for q in self._pending if q.rec is rec), None)
        if p is None or p.extra is None:
            return None
        if p.event is not None:
            p.event.synchronize()
        return p.extra.tolist()

    def completed(self, block: bool) -> Iterator[Completed]:
        """Every pending step whose copy is done, in step order, its rows built
        (``Ledger.drain`` writes them); ``block`` waits for the copies. A step whose
        decision is deferred (``rec.decided`` False) stops the queue until it is made."""
        with record_function("titan_ledger.drain"):
            while self._pending:
                p = self._pending[0]
                if not p.rec.decided:
                    return
                if p.event is not None and not block and not p.event.query():
                    return
                if p.event is not None:
                    p.event.synchronize()
                self._pending.popleft()
                if p.rec.update_sq is not None:  # on the host with the row (attach_update)
                    p.rec.update_sq = float(p.rec.update_sq)
                v = p.host.tolist()
                stats = p.extra.tolist() if p.extra is not None else None
                row, rest = signals_row(v, p.rec, self.layout, skipped_samples=self.skipped_samples, stats=stats)
                n = len(self.layout.per_layer_groups or ())
                doc = self.doc_loss.decode(rest[n:]) if self.doc_loss is not None else None
                yield Completed(p.rec, row, rank_row(v, p.rec, self.layout), doc, stats)

    def write(self, done: Completed) -> None:
        """The step's signals row (rank 0) and this rank's rank row."""
        if self._writer is not None:
            self._writer.write(done.row)
        if self._rank_writer is not None:
            self._rank_writer.write(done.rank_row)

    @property
    def path(self) -> str:
        return str(self._writer.path) if self._writer is not None else records.SIGNALS_FILE

    # ------------------------------------------------------------------ skipped windows
    def record_skip(self, *, first: int, last: int, n_samples: int, lr: float, step_start: float,
                    skip_lr: str, metrics_logger=None) -> None:
        """ONE signals row for a skipped window (its samples consumed, not trained)."""
        self.consumed_samples += n_samples
        self.skipped_samples += n_samples
        row = {k: None for k in records.SIGNAL_KEYS}
        row.update({"step": first, "last_step": last, "consumed_samples": self.consumed_samples,
                    # counts trained tokens only: a skipped window trains none
                    "consumed_tokens": int(self._consumed_tokens.item()), "lr": lr,
                    "skipped": True, "skipped_samples": self.skipped_samples, "skip_lr": skip_lr,
                    "update_skipped": False,
                    "step_time_s": time.perf_counter() - step_start, "data_loading_s": 0.0})
        if self._writer is not None:
            self._writer.write(row)
        if metrics_logger is not None:
            metrics_logger.log({"ledger/skipped": 1.0, "ledger/skipped_samples": float(self.skipped_samples),
                                "ledger/consumed_samples": float(self.consumed_samples)}, first)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        # read at checkpoint time only (a checkpoint save synchronises anyway)
        return {"consumed_samples": self.consumed_samples,
                "consumed_tokens": int(self._consumed_tokens.item()),
                "skipped_samples": self.skipped_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed_samples = int(state.get("consumed_samples", 0))
        self.skipped_samples = int(state.get("skipped_samples", 0))
        self._consumed_tokens = torch.tensor(float(state.get("consumed_tokens", 0)),
                                             dtype=torch.float64, device=self.device)


def reduced_slots(v: list[float], dp: int) -> dict[str, float]:
    """The named fixed slots (:data:`SLOTS`) of a reduced host vector (layout:
    :meth:`SignalRecorder.reduce`) of a run of ``dp`` DP ranks."""
    return dict(zip(SLOTS, v[2 * dp:2 * dp + len(SLOTS)]))


def signals_row(v: list[float], rec: StepRecord, layout: RowLayout, *, skipped_samples: int,
                stats: list[float] | None) -> tuple[dict[str, Any], list[float]]:
    """The ``signals.jsonl`` row of a step from its reduced host vector (layout:
    :meth:`SignalRecorder.reduce`) and its record, its keys in the table's order
    (:data:`records.SIGNAL_KEYS`); returns the row and the vector's tail (per-layer sums
    of squares, then the per-document summary). Pure."""
    dp = layout.dp_size
    loss_by_dp, tok_by_dp = v[:dp], v[dp:2 * dp]
    s = reduced_slots(v, dp)
    gn, gn_clip, ctok, masked = s["grad_norm"], s["grad_norm_clipped"], s["consumed_tokens"], s["masked_tokens"]
    ztok = s["logz_tokens"]
    if rec.trained is not None:  # a proof applied another execution's update: the row is what trained
        t = rec.trained
        loss_by_dp, tok_by_dp = t["loss_by_dp"], t["tok_by_dp"]
        ctok -= t["masked_tokens"]
        masked += t["masked_tokens"]
        gn, gn_clip = t["grad_norm"], t["grad_norm_clipped"]
    tokens = sum(tok_by_dp)
    loss = sum(loss_by_dp) / tokens if tokens else float("nan")
    local_avg = [lv / t if t else float("-inf") for lv, t in zip(loss_by_dp, tok_by_dp)]
    max_rank = max(range(dp), key=lambda r: (local_avg[r] if not math.isnan(local_avg[r])
                                             else float("inf")))
    values = {k: getattr(rec, k) for k in signal_columns.RECORD_KEYS}  # host facts, as the record has them
    values.update({
        "consumed_tokens": int(ctok),
        "loss": loss,
        "loss_max": local_avg[max_rank],
        "loss_max_rank": max_rank,
        "grad_norm": gn,
        "grad_norm_clipped": gn_clip,
        "num_zeros": int(s["num_zeros"]),
        "masked_tokens": int(masked),
        "param_norm": math.sqrt(s["param_sq"]),
        "update_norm": math.sqrt(rec.update_sq) if rec.update_sq is not None else None,
        "max_logit": s["max_logit"] if layout.max_logit else None,
        "z_loss": s["logz_sq"] / ztok if ztok else None,  # mean log Z^2 (before --loss.z_loss_weight)
        "logz_mean": s["logz_sum"] / ztok if ztok else None,
        "logz_max": s["logz_max"] if ztok else None,
        # QK-clip (None when off): query heads whose rows this step's clip scales, smallest eta
        "qk_clip_heads": int(s["qk_clip_heads"]) if layout.qk_clip else None,
        "qk_clip_eta_min": s["qk_clip_eta_min"] if layout.qk_clip else None,
        "skipped": False,
        "skipped_samples": skipped_samples,
        "spike": bool(stats[0]) if stats is not None else None,
        "spike_note": layout.note_of(stats) if stats is not None and layout.note_of is not None else None,
    })
    if values.keys() != _ROW_KEYS:  # a column nothing computes, or a value no column declares
        raise KeyError(f"signals_row: columns nothing computes {sorted(_ROW_KEYS - values.keys())}, values no "
                       f"column declares {sorted(values.keys() - _ROW_KEYS)} (format/signal_columns.py)")
    row = {k: values[k] for k in records.SIGNAL_KEYS}  # the table's order: the bytes on disk
    rest = v[2 * dp + len(SLOTS):]
    if layout.per_layer_groups is not None:
        row[records.PER_LAYER_KEY] = {g: math.sqrt(x) for g, x in zip(layout.per_layer_groups, rest)}
    return row, rest


def rank_row(v: list[float], rec: StepRecord, layout: RowLayout) -> dict[str, Any]:
    """The ``rank<r>.jsonl`` row: this rank's DP group's own loss and tokens (what trained). Pure."""
    lv, lt = v[layout.dp_rank], v[layout.dp_size + layout.dp_rank]
    if rec.trained is not None:
        lv, lt = rec.trained["loss_by_dp"][layout.dp_rank], rec.trained["tok_by_dp"][layout.dp_rank]
    return {"step": rec.step, "loss": lv / lt if lt else None, "tokens": int(lt)}


def dashboard(row: dict[str, Any]) -> dict[str, float]:
    """Row -> ``ledger/<key>`` scalars for torchtitan's TensorBoard / W&B loggers: the
    table's dashboard columns (:data:`signal_columns.DASHBOARD_KEYS`) that have a value."""
    out = {}
    for k, v in row.items():
        if k == records.PER_LAYER_KEY:
            out.update({f"ledger/grad_norm_per_layer/{g}": x for g, x in v.items()})
        elif k in signal_columns.DASHBOARD_KEYS and v is not None:
            out[f"ledger/{k}"] = float(v)
    return out
