"""The spike guard: the spike rules on device, the event logs, and what a flag does.

Design decision: detection is separated from recording. The rules
(:class:`titan_ledger.spikes.SpikeDetector`) run on the reduced loss and grad norm
every rank already holds after the recorder's one collective, so every rank
reaches the same flag with no further collective and no host read; the flag's
stats ride in the recorder's device->host copy and become an event in
``spikes.jsonl`` (and ``rejected_steps.jsonl``, the auto-skip list) when the row
is written. Only a response that must act before ``optimizers.step()``
(``on_spike = skip_update | rollback``) reads the flag on the host, once per step.
Event logs are never superseded: a spike that caused a rewind stays on record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from titan_ledger import records
from titan_ledger.spikes import RULES, SpikeDetector, describe
from titan_ledger.topology import Topology


class SpikeGuard:
    def __init__(self, topo: Topology, config: SpikeDetector.Config, on_spike: str,
                 device: torch.device | str = "cpu"):
        self.topo = topo
        self.config = config
        self.on_spike = on_spike
        self.detector = SpikeDetector(config, device)
        self.last_flag: torch.Tensor | None = None
        self.flagged = 0
        self._spikes: records.RecordWriter | None = None
        self._rejected: records.RecordWriter | None = None
        self.folder: Path | None = None

    def open(self, folder: Path, header: records.Header) -> None:
        self.folder = folder
        if not self.topo.is_rank0:
            return
        # event logs, not step histories: no resumed_from, so no event is ever superseded
        extra = {**header.extra, "started_after_step": header.resumed_from}
        hdr = records.Header(schema=records.SPIKES_SCHEMA, run_id=header.run_id, seq=header.seq,
                             time=header.time, extra={**extra, "rules": _asdict(self.config),
                                                      "on_spike": self.on_spike})
        self._spikes = records.RecordWriter(folder / records.SPIKES_FILE, hdr)
        self._rejected = records.RecordWriter(
            folder / records.REJECTED_FILE,
            records.Header(schema=records.REJECTED_SCHEMA, run_id=header.run_id, seq=header.seq,
                           time=header.time, extra=extra))

    def observe(self, red, grad_norm: torch.Tensor) -> torch.Tensor:
        """The rules on this step's reduced values (a ``recorder.Reduced``: global loss,
        per-DP-rank losses, per-document summaries); returns the stats vector (device)."""
        with record_function("titan_ledger.spike_rules"):
            stats = self.detector.step(red.loss, grad_norm.detach(), red.dp_loss, red.doc)
            self.last_flag = stats[0] > 0
            return stats

    def flag_now(self) -> bool:
        """This step's flag on the host (one device->host read; only the update guard
        and rollback need it, before ``optimizers.step()``)."""
        return bool(self.last_flag.item()) if self.last_flag is not None else False

    def on_row(self, row: dict[str, Any], stats: list[float] | None, metrics_logger=None) -> None:
        """A written signals row: if it was flagged, record the event."""
        if not stats or not stats[0]:
            return
        from torchtitan.tools.logging import logger

        self.flagged += 1
        ev = {"step": row["step"], "loss": row["loss"], "grad_norm": row["grad_norm"],
              "loss_max": row["loss_max"], "loss_max_rank": row["loss_max_rank"],
              "max_logit": row["max_logit"], **describe(stats), "action": self.on_spike}
        ranks = {"rank_separation": ev.get("separation_rank"), "doc_high": ev.get("doc_high_rank"),
                 "doc_low": ev.get("doc_low_rank")}
        named = [ranks[r] for r in ev["rules"] if ranks.get(r) is not None]
        if named:
            ev["suspect_dp_rank"] = named[-1]  # the document rules name it most reliably
        if self._spikes is not None:
            self._spikes.write(ev)
            self._rejected.write({"step": row["step"], "rules": ev["rules"]})
        if self.topo.is_rank0:
            logger.warning(
                f"titan_ledger: SPIKE at step {row['step']}: loss {row['loss']:.4f} (window mean "
                f"{ev['loss_mean']:.4f}, std {ev['loss_std']:.4f}), grad norm {row['grad_norm']:.4f} "
                f"(median {ev['grad_norm_median']:.4f}); rules {', '.join(ev['rules'])}; "
                + (f"suspect DP rank {ev['suspect_dp_rank']}; " if "suspect_dp_rank" in ev else
                   f"highest-loss DP rank {row['loss_max_rank']}; ")
                + f"action: {self.on_spike}")
        if metrics_logger is not None:  # spike/* scalars; W&B: an alert and a spike/events table row
            from titan_ledger.dashboards import log_spike

            log_spike(metrics_logger, row, ev)

    def record_rewind(self, *, from_step: int, to_step: int, window: tuple[int, int]) -> None:
        if self._spikes is not None:
            self._spikes.write({"step": from_step, "rewind_to": to_step, "skip_window": list(window),
                                "action": "rollback"})

    def close(self) -> None:
        for w in (self._spikes, self._rejected):
            if w is not None:
                w.close()

    def state_dict(self) -> dict[str, Any]:
        return self.detector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state)


def _asdict(cfg) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
