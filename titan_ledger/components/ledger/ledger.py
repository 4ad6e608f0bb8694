"""``Ledger``: the ``[ledger]`` config section and the ledger components one run uses.

Design decision: one Configurable, ``Ledger``, owns the ``ledger`` config section
(torchtitan's pattern: nested ``@dataclass(kw_only=True, slots=True) Config``,
attribute docstrings as ``--help``; its sub-sections are
:mod:`titan_ledger.components.ledger.sections`; checks of values against each other are
launch checks, :func:`titan_ledger.config.validate.validate`). At run time it is a
thin composition of three components, each built from a :class:`Topology` and
unit-testable in-process without torchrun:

* :class:`~titan_ledger.components.signals.recorder.SignalRecorder` -- per-step signals, one
  collective, rows built a step late (``signals.jsonl``, ``rank<r>.jsonl``);
* :class:`~titan_ledger.components.ledger.data_writer.DataLedgerWriter` -- the data ledger
  (``data_dp<r>.jsonl``);
* :class:`~titan_ledger.components.detection.guard.SpikeGuard` -- the spike rules, events, and the
  host read the update guard / rollback need.

A step is one :class:`~titan_ledger.components.signals.step_record.StepRecord`, handed in
whole at ``record`` and fanned out to every writer in one place, :meth:`Ledger.drain`.
``Ledger`` itself owns what spans the components: the skip windows, rewinds, and, through
two mixins, its start (:mod:`titan_ledger.components.ledger.start`: ``setup`` binds it to
the built trainer) and what carries across a relaunch or a rewind
(:mod:`titan_ledger.components.ledger.resume`: the segments, one ``seq`` per launch or
rewind, and the checkpointed counters). ``LedgerTrainer`` calls it at
``open`` (first step), ``record`` (after the clip, before ``optimizers.step``),
``drain`` and ``close``; what a flagged step does is
:mod:`titan_ledger.components.response.recovery`'s.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.profiler import record_function
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import Configurable

from titan_ledger.components.detection.guard import SpikeGuard
from titan_ledger.components.detection.spikes import STAT_KEYS, SpikeDetector, describe
from titan_ledger.components.detection.stall import StallConfig, StallWatch, describe_stall
from titan_ledger.components.ledger import dashboards
from titan_ledger.components.ledger.data_writer import DataLedgerWriter
from titan_ledger.components.ledger.resume import LedgerResume, read_proven
from titan_ledger.components.ledger.sections import DocLossConfig, FilterConfig, RehearsalConfig, SkipConfig
from titan_ledger.components.ledger.start import LedgerStart
from titan_ledger.components.response.config import ResponseSections
from titan_ledger.components.response.host import History, Recorded
from titan_ledger.components.run.run_folder import Launch
from titan_ledger.components.signals.adam_level import AdamLevel
from titan_ledger.components.signals.doc_loss import DocLossTracker, LogZStats
from titan_ledger.components.signals.recorder import SignalRecorder, check_finite, dashboard
from titan_ledger.components.signals.step_record import StepRecord
from titan_ledger.components.signals.topology import Topology
from titan_ledger.data.content import ContentMemory, window_hashes
from titan_ledger.data.filters import Quarantine, mask_repetitive
from titan_ledger.data.layout import parse_skip_steps
from titan_ledger.errors import ConfigError, python_command
from titan_ledger.format import answers, records
from titan_ledger.format.answers.health import Health
from titan_ledger.rehearsal.faults import parse_inject

__all__ = ["DocLossConfig", "FilterConfig", "Ledger", "RehearsalConfig", "SkipConfig"]


_NOTE = STAT_KEYS.index("note")


class Ledger(LedgerStart, LedgerResume, Configurable):
    """Per-step signals: computed on device, reduced packed, written a step late.

    ``setup`` and ``attach_loss`` are :class:`LedgerStart`'s; ``open``, ``close`` and the
    checkpoint's ``state_dict`` / ``load_state_dict`` are :class:`LedgerResume`'s."""

    @dataclass(kw_only=True, slots=True)
    class Config(ResponseSections):
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

        update_norm: bool = False
        """Also record the norm of the update ``optimizers.step`` applied (``update_norm``:
        the parameters after it minus before, over the whole model; 0 on a step whose
        update was rejected). Adam's update spikes before the loss when its second moment
        lags the gradient (the optimizer-state cause). Costs a copy of this rank's
        parameter shards and one scalar all-reduce a step."""

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

        stall: StallConfig = field(default_factory=StallConfig)
        """The stall rule: the loss's trend against its own past, window by window (a run
        that stops learning while its attention logits grow, or slowly diverges), on the
        host from the written rows (``[ledger.stall]``)."""

        rehearsal: RehearsalConfig = field(default_factory=lambda: RehearsalConfig())
        """Fault injection and counterfactual reruns (``[ledger.rehearsal]``); rehearsal only."""

        def __post_init__(self) -> None:
            # the folder's own syntax; relations between values are launch checks (config.validate)
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
        self.launch = Launch()  # train.run sets the launch it received (segment headers)
        self.rewinds = 0
        self._state: dict[str, Any] = {}  # loaded before setup (checkpoint load order)
        self._seq = 0
        self.doc_loss: DocLossTracker | None = None  # when the loss is tracked per document (attach_loss)
        self.logz: LogZStats | None = None  # when the loss is titan_ledger's (attach_loss)
        self.qk_clip = None  # a QKClip when [qk_clip] enable (built in setup)
        self.quarantine = Quarantine(config.filter.quarantine)
        self.proven: list[list] = []  # [source, doc, step] a proof convicted (this process)
        self.last_reduced = self.last_execution = None  # the step just recorded (proofs)
        #: the last rows written (a proof reads the LR's fingerprint from them) and Adam's
        #: second-moment level (``optimizer_state``), both from the rows as they are written
        self.recent: deque = deque(maxlen=64)
        self.adam_level: AdamLevel | None = None
        #: the first sample position of every step this process flagged (a proof asks whether
        #: convicted documents trained before without a flag)
        self.flagged_at: set[int] = set()
        #: the steps this process flagged (acting), for the look-back by content
        self.flagged: set[int] = set()
        #: what trained recently, by content (a conviction's look-back: data/content.py); built at setup
        self.content: ContentMemory | None = None
        self.stall = StallWatch(config.stall) if config.stall.enable else None
        self.health = Health()  # the model's health from the written rows (format.answers.health)
        self.checkpoint_folder = "checkpoint"  # (setup: the run's own)
        self.stalls: list[dict] = []  # stall events this process raised (Recovery proves the newest)
        self.global_batch = 0
        self.knobs = answers.Knobs()  # the run's settings a fix changes (setup: from the config)

    # ------------------------------------------------------------------ per step
    def take_provenance(self, rec: StepRecord, input_dict: dict, labels: torch.Tensor) -> None:
        """One fetched microbatch: its rows' provenance into ``rec``, and the loss masks that
        use it (quarantine, repetition filter); the masked labels are then ignored like any
        other label."""
        if self.loader is None:
            return
        tags = self.loader.take_tags()
        base = len(rec.tags)
        rec.tags.extend(tags)
        if self.content is not None and input_dict["input"].device.type == "cpu":  # (the host's copy: no sync)
            self.content.record(rec.step, window_hashes(input_dict["input"].numpy()))
        filt = self.config.filter
        if not (self.quarantine or filt.repetition) or not tags:
            return
        valid = int((labels != IGNORE_INDEX).sum())
        if self.quarantine:
            hit = self.quarantine.mask(tags, labels)
            rec.masked.setdefault("quarantine", []).extend([base + r, s] for r, s in hit)
        if filt.repetition:
            hit = mask_repetitive(input_dict["input"], input_dict["positions"], labels,
                                  filt.repetition_min, filt.repetition_max_period)
            rec.masked.setdefault("repetition", []).extend([base + r, s] for r, s in hit)
        rec.masked_tokens += valid - int((labels != IGNORE_INDEX).sum())

    def provenance_ready(self, rec: StepRecord) -> None:
        """Every batch of the step has been fetched (the first forward is next). Without
        signals the data row is written now, before any forward can fail; with signals it
        goes out with the step's signals row, carrying its per-document losses."""
        if self.recorder is None and self.data is not None and not rec.data_written:
            self.data.record(rec)
            rec.data_written = True

    def record(self, rec: StepRecord, *, local_loss_sum: torch.Tensor | None, local_tokens: int,
               grad_norm: torch.Tensor) -> None:
        """Reduce this step's signals (one collective), run the spike rules, queue the step.

        Call after ``clip_grad_norm_`` and before ``optimizers.step()``: zeros and
        norms are read from the gradients about to be applied. No host read.
        """
        if self.recorder is None:
            return
        with record_function("titan_ledger.signals"):
            red = self.recorder.reduce(local_loss_sum=local_loss_sum, local_tokens=local_tokens,
                                       grad_norm=grad_norm, masked_tokens=rec.masked_tokens)
        stats = self.guard.observe(red, grad_norm) if self.guard is not None else None
        # kept by reference (no copy): a proof at the alarm reads them on a flagged step
        self.last_reduced, self.last_execution = red, (local_loss_sum, local_tokens, grad_norm)
        with record_function("titan_ledger.signals"):
            self.recorder.queue(rec, red.vector, stats)
            if self.config.update_norm:
                self.recorder.snapshot_params()

    # ------------------------------------------------------------------ what the response asks
    # (components/response reads the ledger through these, not its parts: tests/unit/test_seam.py)
    @property
    def clips_qk(self) -> bool:
        """Whether QK-clip rewrites Q and K after every update (``[qk_clip] enable``)."""
        return self.qk_clip is not None

    @property
    def owned_params(self) -> list | None:
        """The parameters' owned pieces, every logical element once (None: no signals): what
        Adam's level is measured on (the response reads it once, at build)."""
        return self.recorder.plan.params if self.recorder is not None else None

    @property
    def detector(self) -> SpikeDetector | None:
        """The spike rules' detector (a proof judges a re-execution by its bars); None
        where no rule runs."""
        return self.guard.detector if self.guard is not None else None

    def hold(self, *, acting: bool, notes: bool):
        """The device-side guard of a deferred update (``SpikeGuard.hold``)."""
        return self.guard.hold(acting=acting, notes=notes)

    def history(self) -> History:
        """What the rows written so far say: the ledger's own collections, by reference (asked
        every step by the snapshot ring's stall anchor: no copy), read-only by their types."""
        return History(recent=self.recent, flagged_at=self.flagged_at, flagged=self.flagged, stalls=self.stalls,
                       rewinds=self.rewinds, content=self.content,
                       stall_onset=self.stall.best_step if self.stall is not None else None,
                       skip_windows=self.skip_windows, adam=self.adam_level,
                       broken_since=self.health.broken_since)

    # ------------------------------------------------------------------ a flagged step (proofs)
    def flags(self, rec: StepRecord | None = None) -> tuple[bool, bool] | None:
        """(acting flag, note): this step's on the host, one device->host read (``rec``
        None; no rule ran: both False), or a deferred step's from the copy the recorder
        made (None: not queued)."""
        if rec is not None:
            stats = self.recorder.host_stats(rec)
            return None if stats is None else (bool(stats[0]), bool(stats[_NOTE]))
        if self.guard is None or self.guard.last_stats is None:
            return False, False
        acting, note = self.guard.last_stats[[0, _NOTE]].tolist()
        return bool(acting), bool(note)

    def recorded(self) -> Recorded:
        """The step the last record reduced: its execution (device values, by reference) and,
        read on the host when a proof first asks, its spike event, each DP rank's mean loss
        and this rank's per-document summary."""
        red, stats = self.last_reduced, self.guard.last_stats if self.guard is not None else None

        def read() -> tuple[dict, list[float], dict | None]:
            documents = None
            if self.doc_loss is not None and self.topo.owns_tokens:
                documents = self.doc_loss.decode(red.vector[-self.doc_loss.size:].tolist())
            return describe(stats.tolist()), red.dp_loss.tolist(), documents

        return Recorded(self.last_execution, read)

    def trained_as(self, rec: StepRecord, execution: dict) -> None:
        """A proof applied ``execution`` (its record: ``loss``, ``grad_norm``, ``per_rank``),
        not the step's first: the step's rows record what trained (``StepRecord.trained``)
        and the run's consumed tokens leave out the labels its masks removed."""
        import math

        topo = self.topo
        per = execution.get("per_rank") or []
        loss_by_dp, tok_by_dp = [0.0] * topo.dp_size, [0.0] * topo.dp_size
        for r, x in enumerate(per):
            dp = topo.dp_rank_of[r]
            loss_by_dp[dp] += float(x.get("loss") or 0.0)
            tok_by_dp[dp] += float(x.get("tokens") or 0)
        first = (rec.proof.executions[0].get("per_rank") if rec.proof is not None and rec.proof.executions else None)
        first_tokens = sum(float(x.get("tokens") or 0) for x in first or [])
        masked = max(0, int(round(first_tokens - sum(tok_by_dp)))) if first else 0
        gn = float(execution.get("grad_norm") or math.nan)
        max_norm = self.recorder.max_norm if self.recorder is not None else 0.0
        coef = min(1.0, max_norm / (gn + 1e-6)) if max_norm > 0 and math.isfinite(gn) else 1.0
        rec.trained = {"loss_by_dp": loss_by_dp, "tok_by_dp": tok_by_dp, "grad_norm": gn,
                       "grad_norm_clipped": gn * coef, "masked_tokens": masked}
        if masked and self.recorder is not None:
            self.recorder.untrain(masked)

    def discard_step_state(self) -> None:
        """Drain what an extra execution of the step refilled (per-document sums, log Z,
        max logits): the step's row was reduced from the first."""
        if self.doc_loss is not None:
            self.doc_loss.summary(self.device)
        if self.logz is not None:
            self.logz.take()
        for m in (self.recorder.attn if self.recorder is not None else ()):
            m.take_max_logit(self.device)

    def quarantine_proven(self, docs: list, step: int) -> None:
        """Documents a proof convicted at ``step``: masked from the next fetch on (every
        rank), appended to the run's own quarantine file (rank 0)."""
        self.quarantine.add(docs)
        new = [[str(s), int(d), int(step)] for s, d in docs]
        self.proven.extend(new)
        if self.topo.is_rank0:
            known = read_proven(self.folder)  # a resume before the step convicts them again
            with open(self.folder / records.PROVEN_FILE, "a") as f:
                for s, d, t in new:
                    if [s, d, t] not in known:
                        f.write(json.dumps({"source": s, "doc": d, "step": t}) + "\n")

    def remask(self, rec: StepRecord, docs: list) -> None:
        """A step fetched before a deferred proof convicted ``docs``: mask them in its
        batches now, as the fetch would have (its re-execution trains without them), and
        record the mask where the fetch records it."""
        if not docs or not rec.batches:
            return
        convicted = Quarantine([])
        convicted.add(docs)
        hits = rec.masked.setdefault("quarantine", [])
        base = 0
        for group in rec.batches:
            for _, labels in group:
                n = labels.shape[0]
                valid = int((labels != IGNORE_INDEX).sum())
                hits.extend([base + r, g] for r, g in convicted.mask(rec.tags[base:base + n], labels))
                rec.masked_tokens += valid - int((labels != IGNORE_INDEX).sum())
                base += n
        # row order, as the fetch's one pass writes them; a segment already masked is listed once
        hits[:] = [list(h) for h in sorted({tuple(h) for h in hits})]
        # and the fetch's key order (quarantine before repetition): the data row is the fetch's
        rec.masked = {"quarantine": hits, **{k: v for k, v in rec.masked.items() if k != "quarantine"}}

    def update(self, step: Callable[[], None] | None, rec: StepRecord | None = None) -> None:
        """The optimizer's update as the ledger measures it: ``step`` (``optimizers.step()``;
        None: the guard withheld it) and after it ``update_norm`` (the optimizer's update
        alone; ``rec``: a deferred step's update, applied a step late, whose parameters are
        snapshotted here first) and QK-clip, which scales the Q/K rows of the groups this
        step's logits put over the threshold (not when the update was withheld)."""
        measures = self.recorder is not None and self.config.update_norm
        if rec is not None and measures:
            self.recorder.snapshot_params()
        if step is not None:
            step()
        if measures:
            with record_function("titan_ledger.signals"):
                self.recorder.attach_update(step is not None, rec)
        if self.qk_clip is not None:
            if step is not None:
                with record_function("titan_ledger.qk_clip"):
                    self.qk_clip.apply()
            self.qk_clip.head_max = None

    def _on_stall(self, ev: dict, metrics_logger=None) -> None:
        """A stall flag: its event, a WARNING, a dashboard scalar and alert."""
        from torchtitan.tools.logging import logger

        self.stalls.append(ev)
        self.record_event(ev)
        if self.topo.is_rank0:
            onset = self.guard.live.open_at(int(ev["step"]), self.health.broken_since) if self.guard else None
            if onset is None:
                logger.warning(f"titan_ledger: {describe_stall(ev)}")
            else:  # a symptom of the episode open (one alarm per episode)
                logger.info(f"titan_ledger: {describe_stall(ev)} -- part of the episode from step {onset}")
        if metrics_logger is not None:
            metrics_logger.log({"stall/flag": 1.0, "stall/best_loss": float(ev["stall"]["best"])}, ev["step"])
            if self.topo.is_rank0:
                self.alert(f"titan_ledger: stall at step {ev['step']}", describe_stall(ev), metrics_logger)

    def _on_broken(self, step: int, span, metrics_logger=None) -> None:
        """The model left its healthy regime (no spike rule need have fired): its event, one
        WARNING naming the episode it opens, a dashboard scalar and alert."""
        from torchtitan.tools.logging import logger

        self.record_event({"step": step, "health": span.to_json()})
        text = (f"the model left its healthy regime at step {span.onset}: {span.words()}; an episode from step "
                f"{span.onset} (later flags are its symptoms; {python_command()} -m titan_ledger.diagnose "
                f"{self.folder.parent} --rerun proves its fix over the run's horizon)")
        if self.topo.is_rank0:
            logger.warning(f"titan_ledger: {text}")
        if metrics_logger is not None:
            metrics_logger.log({"health/broken": 1.0, "health/onset": float(span.onset)}, step)
            if self.topo.is_rank0:
                self.alert(f"titan_ledger: the model left its healthy regime at step {span.onset}", text,
                           metrics_logger)

    def alert(self, title: str, text: str, metrics_logger=None) -> None:
        """An alert of the response itself on the dashboards (W&B's alert, TensorBoard's
        ``response/events`` text)."""
        if metrics_logger is not None:
            dashboards.alert(metrics_logger, title, text)

    def record_event(self, ev: dict, alert: tuple[str, str] | None = None, metrics_logger=None) -> None:
        """An event of the response itself (the circuit breaker, a failure inside the
        response) in spikes.jsonl; ``alert`` (title, text): also an alert on this rank's
        dashboards (:meth:`alert`)."""
        if self.guard is not None:
            self.guard.record_event(ev)
        if alert is not None:
            self.alert(*alert, metrics_logger)

    def drain(self, block: bool, metrics_logger=None) -> None:
        """Write every step whose device->host copy is done, in step order: the one place a
        step fans out -- signals row, rank row, data row, dashboards, spike events."""
        if self.recorder is None:
            return
        for done in self.recorder.completed(block):
            self.recorder.write(done)  # signals.jsonl (rank 0), rank<r>.jsonl
            if self.data is not None:
                self.data.record(done.rec, doc_loss=done.doc)  # data_dp<r>.jsonl
            if metrics_logger is not None:
                metrics_logger.log(dashboard(done.row), done.rec.step)
            self.recent.append(done.row)
            if self.adam_level is not None:
                self.adam_level.observe(done.row)
            if done.row.get("spike") and isinstance(done.row.get("consumed_samples"), int):
                self.flagged_at.add(done.row["consumed_samples"] - self.global_batch)
            if done.row.get("spike"):
                self.flagged.add(int(done.rec.step))
            stall = self.stall.observe(done.row) if self.stall is not None else None
            if stall is not None:
                self._on_stall(stall, metrics_logger)
            self.health.observe(done.row)
            for kind, span in self.health.changes():  # every change recorded: the views read the spans
                if kind == "opened":
                    self._on_broken(int(done.row["step"]), span, metrics_logger)
                else:
                    self.record_event({"step": int(done.row["step"]), "health": span.to_json(),
                                       **({"recovered": True} if kind == "recovered" else {})})
            proof = done.rec.proof  # (typed: the answer is built from it; the guard writes its JSON)
            stall_ev = None
            if proof is not None and proof.stall:  # a forced proof answering the stall rule's flag
                stall_ev = next((e for e in reversed(self.stalls) if e["step"] == proof.stall["step"]), None)
            event = self.guard.on_row(done.row, done.stats, proof=proof, unproven=done.rec.unproven,
                                      proof_failed=done.rec.proof_failed, stall=stall_ev,
                                      broken_since=self.health.broken_since) \
                if self.guard is not None else None  # spikes.jsonl, rejected_steps.jsonl
            if event is not None and metrics_logger is not None:
                # spike/* and note/* scalars; W&B: a spike's alert and its spike/events table row
                if event[0] == "answer":  # a stall's answer (its forced proof's event)
                    dashboards.log_answer(metrics_logger, event[1])
                else:
                    (dashboards.log_spike if event[0] == "spike" else dashboards.log_note)(metrics_logger, done.row,
                                                                                           event[1])
            check_finite(done.row, self.recorder.path)

    # ------------------------------------------------------------------ data ledger, skips
    def record_skip(self, *, first: int, last: int, info, lr: float, step_start: float,
                    rec: StepRecord | None = None, metrics_logger=None) -> None:
        """Steps ``first..last`` consumed untrained: data consumed, no forward/backward, no
        update; one data row per DP rank and one signals row for the whole window. ``rec``:
        one step whose masks left no label token on any rank (``Recovery.first_execution``),
        whose data rows say why (``"why": "no_tokens"``) and hold the step's rows and masks."""
        self.drain(block=True, metrics_logger=metrics_logger)  # rows stay in step order
        if self.data is not None:
            self.data.record_skip(first=first, last=last, info=info, **(
                {"why": "no_tokens", "masked": rec.masked_or_none()} if rec is not None else {}))
        if self.recorder is not None:
            self.recorder.record_skip(first=first, last=last, n_samples=info.position_after - info.position_before,
                                      lr=lr, step_start=step_start, skip_lr=self.config.skip.lr,
                                      metrics_logger=metrics_logger)
        if rec is not None and self.topo.is_rank0 and self.guard is not None:
            self.guard.record_event({"step": rec.step, "no_tokens": True,
                                     "masked": sorted(k for k, v in rec.masked.items() if v)})

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
        if metrics_logger is not None:
            dashboards.log_rewind(metrics_logger, from_step=from_step, to_step=to_step, window=window)

    def finish(self, metrics_logger=None) -> None:
        """The run's end (a stop's too): every row written, the files closed, and the run's
        answer -- its episodes -- on the dashboards."""
        self.drain(block=True, metrics_logger=metrics_logger)
        self.close()
        self.episodes(metrics_logger)

    def episodes(self, metrics_logger=None) -> list | None:
        """The run's episodes at its end (rank 0, read back from what it wrote: one answer in
        every view), logged to the dashboards; None elsewhere, or where they cannot be read (a
        failure here never fails the run)."""
        if not self.topo.is_rank0 or getattr(self, "folder", None) is None or self.recorder is None \
                or not dashboards.writers(metrics_logger):
            return None  # (no signals, or no dashboard to show them: the end summary reads them itself)
        from torchtitan.tools.logging import logger

        from titan_ledger.format.answers.of_run import RunAnswers
        from titan_ledger.format.reader import RunLedger

        try:
            eps = RunAnswers(RunLedger(self.folder.parent, self.folder.name, self.checkpoint_folder)).episodes()
        except Exception as e:  # (the summary says so; the run's own outcome stands)
            logger.warning(f"titan_ledger: the run's episodes could not be read: {type(e).__name__}: {e}")
            return None
        if metrics_logger is not None:
            dashboards.log_episodes(metrics_logger, eps)
        return eps

    def summary(self) -> dict[str, Any]:
        """What this process wrote (for the end-of-run summary)."""
        return {"folder": str(getattr(self, "folder", "")), "run_id": getattr(self, "run_id", None),
                "signal_rows": self.recorder.rows_written if self.recorder else 0,
                "data_rows": self.data.rows_written if self.data else 0,
                "spikes": self.guard.flagged if self.guard else 0, "rewinds": self.rewinds}
