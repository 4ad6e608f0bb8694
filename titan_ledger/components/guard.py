"""The spike guard: the spike rules on device, the event logs, and what a flag does.

Design decision: detection is separated from recording. The rules
(:class:`titan_ledger.components.spikes.SpikeDetector`) run on the reduced loss and grad norm
every rank already holds after the recorder's one collective, so every rank
reaches the same flag with no further collective and no host read; the flag's
stats ride in the recorder's device->host copy and become an event in
``spikes.jsonl`` (and ``rejected_steps.jsonl``, the auto-skip list) when the row
is written. A response that must act before ``optimizers.step()`` (a proof, ``skip_update``,
``rollback``) withholds the update on the device (:meth:`SpikeGuard.hold`, the fused
AdamW's ``found_inf``) and reads the flag a step later; only steps where torchtitan
synchronises anyway read it in the step (:mod:`titan_ledger.components.recovery`).
Event logs are never superseded: a spike that caused a rewind stays on record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from titan_ledger.components.spikes import STAT_KEYS, SpikeDetector, describe, is_note
from titan_ledger.components.topology import Topology
from titan_ledger.format import records

_NOTE = STAT_KEYS.index("note")


class SpikeGuard:
    def __init__(self, topo: Topology, config: SpikeDetector.Config, on_spike: str,
                 device: torch.device | str = "cpu"):
        self.topo = topo
        self.config = config
        self.on_spike = on_spike
        self.detector = SpikeDetector(config, device)
        self.last_flag: torch.Tensor | None = None
        self.last_stats: torch.Tensor | None = None
        self.flagged = 0
        self.noted = 0
        self._spikes: records.RecordWriter | None = None
        self._rejected: records.RecordWriter | None = None
        self.folder: Path | None = None

    def open(self, folder: Path, header: records.Header) -> None:
        self.folder = folder
        if not self.topo.is_rank0:
            return
        # event logs, not step histories: no resumed_from, so no event is ever superseded
        extra = {**header.extra, "started_after_step": header.resumed_from}
        hdr = records.Header(schema=records.SPIKES.id, run_id=header.run_id, seq=header.seq,
                             time=header.time, extra={**extra, "rules": _asdict(self.config),
                                                      "on_spike": self.on_spike})
        self._spikes = records.RecordWriter(folder / records.SPIKES_FILE, hdr)
        self._rejected = records.RecordWriter(
            folder / records.REJECTED_FILE,
            records.Header(schema=records.REJECTED.id, run_id=header.run_id, seq=header.seq,
                           time=header.time, extra=extra))

    def observe(self, red, grad_norm: torch.Tensor) -> torch.Tensor:
        """The rules on this step's reduced values (a ``recorder.Reduced``: global loss,
        per-DP-rank losses, per-document summaries); returns the stats vector (device)."""
        with record_function("titan_ledger.spike_rules"):
            stats = self.detector.step(red.loss, grad_norm.detach(), red.dp_loss, red.doc)
            self.last_flag = stats[0] > 0
            self.last_stats = stats
            return stats

    def hold(self, acting: bool, notes: bool) -> torch.Tensor:
        """This step's update guard on the device, no host read: 1.0 when an acting rule
        fired (``acting``) or a note did (``notes``), else 0.0 -- the fused AdamW's
        ``found_inf``, which then leaves parameters, moments and the step count as they
        were (``OnSpikeConfig.defer``)."""
        stats = self.last_stats
        fired = (stats[0] > 0) if acting else torch.zeros((), dtype=torch.bool, device=stats.device)
        if notes:
            fired = fired | (stats[_NOTE] > 0)
        return fired.to(torch.float32)

    def flag_now(self) -> bool:
        """This step's flag on the host (one device->host read; only the update guard
        and rollback need it, before ``optimizers.step()``)."""
        return bool(self.last_flag.item()) if self.last_flag is not None else False

    def on_row(self, row: dict[str, Any], stats: list[float] | None, metrics_logger=None,
               proof: dict | None = None) -> None:
        """A written signals row: if it was flagged, record the event; a note (weaker
        evidence, no acting rule) is recorded and charted, never alerted or acted on --
        unless its proof at the alarm (``proof``) found a harmful cause: then it is an
        alarm. A proof rides in the event; a step it resolved (anything but ``not_data``)
        is not on the auto-skip list."""
        from titan_ledger.format.proofs import HARMFUL, describe_proof

        promoted = bool(stats) and is_note(stats) and proof is not None and proof["verdict"] in HARMFUL
        if stats and is_note(stats) and not promoted:
            self._note(row, stats, metrics_logger, proof)
        elif proof is not None and not (stats and stats[0]) and not promoted and self._spikes is not None:
            # a forced proof of a step nothing flagged (--ledger.rehearsal.prove_at): its own event
            self._spikes.write({"step": row["step"], "proof": proof, "forced": True})
        if not stats or not (stats[0] or promoted):
            return
        from torchtitan.tools.logging import logger

        self.flagged += 1
        ev = {"step": row["step"], "loss": row["loss"], "grad_norm": row["grad_norm"],
              "loss_max": row["loss_max"], "loss_max_rank": row["loss_max_rank"],
              "max_logit": row["max_logit"], **describe(stats), "action": self.on_spike}
        if promoted:  # the notes act: the proof convicted their step
            ev["rules"], ev["promoted_by_proof"] = list(ev["notes"]), True
        _name_suspect(ev)
        if proof is not None:
            ev["proof"] = proof
            ev["action"] = self.on_spike if proof["verdict"] == "not_data" else f"proof: {proof['verdict']}"
        if self._spikes is not None:
            self._spikes.write(ev)
            if proof is None or proof["verdict"] == "not_data":
                self._rejected.write({"step": row["step"], "rules": ev["rules"]})
        if self.topo.is_rank0:
            logger.warning(
                f"titan_ledger: SPIKE at step {row['step']}: loss {row['loss']:.4f} (window mean "
                f"{ev['loss_mean']:.4f}, std {ev['loss_std']:.4f}), grad norm {row['grad_norm']:.4f} "
                f"(median {ev['grad_norm_median']:.4f}); rules {', '.join(ev['rules'])}; "
                + (f"suspect DP rank {ev['suspect_dp_rank']}; " if "suspect_dp_rank" in ev else
                   f"highest-loss DP rank {row['loss_max_rank']}; ")
                + f"action: {ev['action']}" + (f"; {describe_proof(proof)}" if proof is not None else ""))
            if "readmitted" in ev:  # --ledger.spike.readmit_after: a change of level, not a spike
                logger.warning(
                    f"titan_ledger: {int(ev['readmitted'])} steps in a row flagged up to step {row['step']}: a "
                    f"lasting change of level (a new data mixture, an easy stretch's end), not a spike; the spike "
                    f"rules' history starts again from these steps (--ledger.spike.readmit_after)")
        if metrics_logger is not None:  # spike/* scalars; W&B: an alert and a spike/events table row
            from titan_ledger.components.dashboards import log_spike

            log_spike(metrics_logger, row, ev)

    def _note(self, row: dict[str, Any], stats: list[float], metrics_logger, proof: dict | None) -> None:
        from torchtitan.tools.logging import logger

        self.noted += 1
        ev = {"step": row["step"], "loss": row["loss"], "grad_norm": row["grad_norm"],
              "loss_max_rank": row["loss_max_rank"], **describe(stats)}
        del ev["rules"]  # a note event has no acting rules: readers tell the tiers apart by this key
        _name_suspect(ev)
        if proof is not None:
            ev["proof"] = proof
        if self._spikes is not None:
            self._spikes.write(ev)
        if self.topo.is_rank0:
            logger.info(f"titan_ledger: note at step {row['step']}: {', '.join(ev['notes'])} (recorded, "
                        f"not acted on)")
        if metrics_logger is not None:
            from titan_ledger.components.dashboards import log_note

            log_note(metrics_logger, row, ev)

    def record_action(self, rec: dict) -> None:
        """A recovery-ladder decision (what was done about a flagged step)."""
        if self._spikes is not None:
            self._spikes.write({**rec, "ladder": True})

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


def _name_suspect(ev: dict[str, Any]) -> None:
    """``suspect_dp_rank``: the rank an evidence rule named, in either tier (a note that
    agrees with a spike names it too); the document rules name it most reliably."""
    ranks = {"rank_separation": ev.get("separation_rank"), "doc_high": ev.get("doc_high_rank"),
             "doc_low": ev.get("doc_low_rank")}
    named = [ranks[r] for r in (*ev.get("rules", []), *ev.get("notes", [])) if ranks.get(r) is not None]
    if named:
        ev["suspect_dp_rank"] = named[-1]


def _asdict(cfg) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


# --------------------------------------------------------------------------- the recovery ladder
ACTIONS = ("none", "skip_update", "rollback", "rollback_lr", "stop")


@dataclass(frozen=True)
class Rung:
    """One response: ``action`` (``rollback_lr`` carries the LR factor), tried
    ``attempts`` times (0: without limit) before the ladder escalates."""

    action: str
    attempts: int = 1
    lr: float | None = None

    @property
    def rolls_back(self) -> bool:
        return self.action in ("rollback", "rollback_lr")

    @property
    def name(self) -> str:
        s = self.action + (f":{self.lr:g}" if self.lr is not None else "")
        return s + (f"*{self.attempts}" if self.attempts > 1 else "")  # 0: a lone action, no limit


def parse_ladder(spec: str) -> list[Rung]:
    """``--ledger.on_spike.action`` -> rungs. One action repeats without limit (rollbacks
    are capped by ``--ledger.on_spike.max_rollbacks``); a comma-separated list escalates:
    ``skip_update*2,rollback,rollback_lr:0.5,stop`` (``*N``: attempts of that rung,
    default 1; ``rollback_lr:X``: roll back and scale the LR by X from then on)."""
    from titan_ledger.errors import ConfigError

    entries = [e.strip() for e in str(spec).split(",") if e.strip()]
    if not entries:
        raise ConfigError("--ledger.on_spike.action: give an action (none, skip_update, rollback, "
                          "rollback_lr:X, stop) or a comma-separated ladder of them")
    rungs = []
    for e in entries:
        body, _, times = e.partition("*")
        action, _, arg = body.partition(":")
        try:
            attempts = int(times) if times else (0 if len(entries) == 1 else 1)
            lr = float(arg) if arg else None
        except ValueError:
            attempts, lr = -1, None
        bad = (action not in ACTIONS or attempts < 0 or (action == "rollback_lr") != (lr is not None)
               or (lr is not None and not 0 < lr < 1) or (action in ("none", "stop") and times))
        if bad:
            raise ConfigError(f"--ledger.on_spike.action {spec!r}: {e!r} is not an action; use none, skip_update, "
                              f"rollback, rollback_lr:X (0 < X < 1) or stop, each optionally *N attempts, "
                              f"e.g. skip_update*2,rollback,rollback_lr:0.5,stop")
        rungs.append(Rung(action, attempts, lr))
    if any(r.action == "stop" for r in rungs[:-1]):
        raise ConfigError(f"--ledger.on_spike.action {spec!r}: stop can only be the last rung")
    return rungs


class Ladder:
    """Which response a flagged step gets: a spike within ``horizon`` steps of the
    previous one is a repeat and uses the next attempt, then the next rung; a spike
    after a quiet ``horizon`` starts again at the first rung. Past the last rung the
    run stops. Pure bookkeeping (the trainer acts); its state survives an in-process
    rollback and is checkpointed."""

    def __init__(self, rungs: list[Rung], horizon: int):
        self.rungs = rungs
        self.horizon = horizon
        self.rung = 0
        self.used = 0
        self.last_step: int | None = None
        self.history: list[dict] = []

    @property
    def acts(self) -> bool:
        return any(r.action != "none" for r in self.rungs)

    @property
    def rolls_back(self) -> bool:
        return any(r.rolls_back for r in self.rungs)

    def on_spike(self, step: int) -> tuple[Rung | None, dict]:
        """The response to a flagged ``step`` (None: the ladder is exhausted)."""
        repeat = self.last_step is not None and step - self.last_step <= self.horizon
        if not repeat:
            self.rung, self.used = 0, 0
        self.last_step = step
        while self.rung < len(self.rungs):
            r = self.rungs[self.rung]
            if r.attempts == 0 or self.used < r.attempts:
                self.used += 1
                rec = {"step": step, "rung": self.rung, "action": r.name, "attempt": self.used,
                       "repeat_within_horizon": repeat}
                self.history.append(rec)
                return r, rec
            self.rung, self.used = self.rung + 1, 0
        rec = {"step": step, "rung": len(self.rungs), "action": "exhausted", "repeat_within_horizon": repeat}
        self.history.append(rec)
        return None, rec

    def would_act(self, step: int) -> bool:
        """Whether a flag at ``step`` would get an action that withholds the update
        (anything but a ``none`` rung), asked without recording it: a deferred step's
        update is held on the device only when its flag would act."""
        saved = (self.rung, self.used, self.last_step, len(self.history))
        rung, _ = self.on_spike(step)
        self.rung, self.used, self.last_step = saved[:3]
        del self.history[saved[3]:]
        return rung is None or rung.action != "none"

    def state_dict(self) -> dict:
        return {"rung": self.rung, "used": self.used, "last_step": self.last_step, "history": self.history}

    def load_state_dict(self, s: dict) -> None:
        if s:
            self.rung, self.used = int(s.get("rung", 0)), int(s.get("used", 0))
            self.last_step, self.history = s.get("last_step"), list(s.get("history", []))
