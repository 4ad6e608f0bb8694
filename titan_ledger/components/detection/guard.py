"""The spike guard: the spike rules on device, the event logs, and what a flag does.

Design decision: detection is separated from recording. The rules
(:class:`titan_ledger.components.detection.spikes.SpikeDetector`) run on the reduced loss and grad norm
every rank already holds after the recorder's one collective, so every rank
reaches the same flag with no further collective and no host read; the flag's
stats ride in the recorder's device->host copy and become an event in
``spikes.jsonl`` (and ``rejected_steps.jsonl``, the auto-skip list) when the row
is written. A response that must act before ``optimizers.step()`` (a proof, ``skip_update``,
``rollback``) withholds the update on the device (:meth:`SpikeGuard.hold`, the fused
AdamW's ``found_inf``) and reads the flag a step later; only steps where torchtitan
synchronises anyway read it in the step (:mod:`titan_ledger.components.response.recovery`).
Event logs are never superseded: a spike that caused a rewind stays on record.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from titan_ledger.components.detection.spikes import STAT_KEYS, SpikeDetector, describe, is_note
from titan_ledger.components.signals.topology import Topology
from titan_ledger.format import answers, records
from titan_ledger.format.answers import episodes, health, render
from titan_ledger.format.proofs import ProofRecord

_NOTE = STAT_KEYS.index("note")


class SpikeGuard:
    def __init__(self, topo: Topology, config: SpikeDetector.Config, on_spike: str,
                 device: torch.device | str = "cpu"):
        self.topo = topo
        self.config = config
        self.on_spike = on_spike
        self.detector = SpikeDetector(config, device)
        self.last_stats: torch.Tensor | None = None
        self.flagged = 0
        self.noted = 0
        self._spikes: records.RecordWriter | None = None
        self._rejected: records.RecordWriter | None = None
        self.folder: Path | None = None
        #: the run's context for an incident's answer (``format.answers.Context``), set by the
        #: ledger at setup: called once per incident, on rank 0 (it lists the checkpoints)
        self.answer_context: Callable[[], answers.Context] | None = None
        #: the last fix an incident of this process measured (``(step, Fix)``)
        self.measured: tuple[int, answers.Fix] | None = None
        #: the episode open now, as the console groups incidents (the views' episodes: format.answers.episodes)
        self.live = episodes.Live()

    def open(self, folder: Path, header: records.Header) -> None:
        self.folder = folder
        if not self.topo.is_rank0:
            return
        # event logs, not step histories: no resumed_from, so no event is ever superseded
        extra = {**header.extra, "started_after_step": header.resumed_from}
        # the ledger records the model's health here (format.answers.health: the views read its spans)
        hdr = records.Header(schema=records.SPIKES.id, run_id=header.run_id, seq=header.seq,
                             time=header.time, extra={**extra, "rules": _asdict(self.config),
                                                      "on_spike": self.on_spike, **health.header()})
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
            self.last_stats = stats
            return stats

    def hold(self, acting: bool, notes: bool) -> torch.Tensor:
        """This step's update guard on the device, no host read: 1.0 when an acting rule
        fired (``acting``) or a note did (``notes``), else 0.0 -- the fused AdamW's
        ``found_inf``, which then leaves parameters, moments and the step count as they
        were (``[ledger.response] defer``)."""
        stats = self.last_stats
        fired = (stats[0] > 0) if acting else torch.zeros((), dtype=torch.bool, device=stats.device)
        if notes:
            fired = fired | (stats[_NOTE] > 0)
        return fired.to(torch.float32)

    def on_row(self, row: dict[str, Any], stats: list[float] | None, proof: ProofRecord | None = None,
               unproven: str | None = None, proof_failed: dict | None = None,
               stall: dict | None = None, broken_since: int | None = None) -> tuple[str, dict[str, Any]] | None:
        """A written signals row: if it was flagged, record the event; a note (weaker
        evidence, no acting rule) is recorded, never alerted or acted on -- unless its
        proof at the alarm (``proof``) found a harmful cause: then it is an alarm. A proof
        rides in the event; a step it resolved (anything but ``not_data``) is not on the
        auto-skip list. An incident (an acting flag, a promoted note, or ``stall``: the
        stall event a forced proof answers) gets its answer (:mod:`titan_ledger.format.answers`),
        written in the event and said on the console in its three lines. Returns
        ``("spike", event)`` or ``("note", event)`` for the dashboards (the ledger charts
        it), ``("answer", event)`` for a stall's answered proof, None when the row was neither."""
        from titan_ledger.format.proofs import HARMFUL, resolves

        record, proof = proof, (proof.to_json() if proof is not None else None)  # (typed for the answer; on disk)
        promoted = bool(stats) and is_note(stats) and proof is not None and proof["verdict"] in HARMFUL
        if stats and is_note(stats) and not promoted:
            return "note", self._note(row, stats, proof, unproven, proof_failed)
        if proof is not None and not (stats and stats[0]) and not promoted and self._spikes is not None:
            # a forced proof of a step nothing flagged (--ledger.rehearsal.prove_at; a stall's): its own event
            forced: dict[str, Any] = {"step": row["step"], "proof": proof, "forced": True}
            if stall is not None:  # the stall's answer, at the stall's step
                answer = self._answer(int(stall["step"]), "stall", stall, record)
                forced["answer"] = answer.to_json()
                self._say(answer, None, broken_since)
            self._spikes.write(forced)
            if "answer" in forced:
                return "answer", forced
        if not stats or not (stats[0] or promoted):
            return None
        self.flagged += 1
        ev = {"step": row["step"], "loss": row["loss"], "grad_norm": row["grad_norm"],
              "loss_max": row["loss_max"], "loss_max_rank": row["loss_max_rank"],
              "max_logit": row["max_logit"], **describe(stats), "action": self.on_spike}
        if promoted:  # the notes act: the proof convicted their step
            ev["rules"], ev["promoted_by_proof"] = list(ev["notes"]), True
        _name_suspect(ev)
        if proof is not None:
            ev["proof"] = proof
            ev["action"] = self.on_spike if not resolves(proof) else f"proof: {proof['verdict']}"
            first = (proof.get("executions") or [{}])[0]
            if proof.get("applied") not in (None, "original") and first.get("loss") is not None:
                # the row records what trained (the applied execution); the flag was the first execution's
                ev["trained"] = {"loss": ev["loss"], "grad_norm": ev["grad_norm"]}
                # (a non-finite value is written null in the proof: the event's is NaN, as the row's was)
                ev["loss"] = first["loss"]
                ev["grad_norm"] = first["grad_norm"] if first.get("grad_norm") is not None else float("nan")
        if proof_failed is not None:
            ev["proof_failed"] = proof_failed
        answer = None
        if self.topo.is_rank0:
            why = (f"the proof failed ({proof_failed.get('error')}); the step was decided as without a proof"
                   if proof_failed else None)
            answer = self._answer(int(row["step"]), "spike", ev, record, unproven=why)
            ev["answer"] = answer.to_json()
        if self._spikes is not None:
            self._spikes.write(ev)
            if proof is None or not resolves(proof):
                self._rejected.write({"step": row["step"], "rules": ev["rules"]})
        if answer is not None:
            self._say(answer, ev, broken_since)
            if "readmitted" in ev:  # --ledger.spike.readmit_after: a change of level, not a spike
                from torchtitan.tools.logging import logger

                logger.warning(  # (one of an episode's two alarms: its first incident's, and this one)
                    f"titan_ledger: {int(ev['readmitted'])} steps in a row flagged up to step {row['step']}: a "
                    f"lasting change of level (a new data mixture, an easy stretch's end), not a spike; the spike "
                    f"rules' history starts again from these steps (--ledger.spike.readmit_after)")
        return "spike", ev

    def _answer(self, step: int, kind: str, event: dict, proof: ProofRecord | None,
                unproven: str | None = None) -> answers.Answer:
        ctx = self.answer_context() if self.answer_context is not None else answers.Context()
        a = answers.build(step, kind, event, proof, ctx, unproven=unproven, earlier=self.measured)
        if a.fix is not None and a.fix.flags and a.fix.effect in ("removed", "lowered") and \
                a.cause not in ("bad_data", "hardware"):
            self.measured = (step, a.fix)  # a later incident's candidate, where its own is not measured
        return a

    def _say(self, answer: answers.Answer, ev: dict | None, broken_since: int | None = None) -> None:
        """An incident on the console (rank 0): its answer as every view says it -- a WARNING
        where it opens an episode, one INFO line where it is a symptom of the episode open
        (``episodes.Live``: a broken model's, a burst's, a shift's), so a user reads one alarm
        per episode, not one per flagged step."""
        from torchtitan.tools.logging import logger

        opens, onset = self.live.see(answer, broken_since)
        if opens:
            logger.warning("titan_ledger: " + render.console(answer, ev))
        else:
            logger.info(f"titan_ledger: {render.headline(answer)} -- part of the episode from step {onset} "
                        f"(python -m titan_ledger.diagnose <dump> names its cause)")

    def _note(self, row: dict[str, Any], stats: list[float], proof: dict | None,
              unproven: str | None = None, proof_failed: dict | None = None) -> dict[str, Any]:
        from torchtitan.tools.logging import logger

        self.noted += 1
        ev = {"step": row["step"], "loss": row["loss"], "grad_norm": row["grad_norm"],
              "loss_max_rank": row["loss_max_rank"], **describe(stats)}
        del ev["rules"]  # a note event has no acting rules: readers tell the tiers apart by this key
        _name_suspect(ev)
        if proof is not None:
            ev["proof"] = proof
        elif proof_failed is not None:
            ev["proof_failed"] = proof_failed
        elif unproven:  # scope = "all", past the note budget ([ledger.proof] notes_rate)
            ev["unproven"] = unproven
        if self._spikes is not None:
            self._spikes.write(ev)
        if self.topo.is_rank0:
            logger.info(f"titan_ledger: note at step {row['step']}: {', '.join(ev['notes'])} (recorded, "
                        f"not acted on)")
        return ev

    def record_event(self, ev: dict) -> None:
        """An event of the response itself (a ladder's action ``{..., "ladder": true}``,
        ``{"step", "breaker": ...}``, ``{"step", "response_failure": ...}``)."""
        if self._spikes is not None:
            self._spikes.write(ev)

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
