"""What carries a ``Ledger`` across a relaunch or a rewind: :class:`LedgerResume`.

Design decision: a run is a sequence of segments (one ``seq`` per launch or in-process
rewind, a header in every ledger file; the folder's rules are
:mod:`titan_ledger.components.run.run_folder`), and a segment resumes from two sources
only: the checkpoint (the recorder's counters, the spike and stall rules' histories, Adam's
level; it also records the quarantine digest the model was masked with) and the run's own
quarantine file, read back up to the step the segment resumes from (later convictions
happen again when their steps train again). torchtitan may load the checkpoint before or
after ``setup`` builds the components, so the loaded state is kept and applied to whichever
exist. ``LedgerResume`` is a mixin of ``Ledger``: it reads and fills the attributes
``Ledger.__init__`` declares, and the response keeps asking the ledger, not it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from titan_ledger.data.filters import Quarantine
from titan_ledger.format import records


class LedgerResume:
    """Segments (``open``, ``close``) and the checkpointed state."""

    def open(self, resumed_from: int, rewind_from: int | None = None) -> None:
        """Start this segment in every ledger file (after the checkpoint load)."""
        self._seq += 1
        header = records.Header(schema="", run_id=self.run_id, seq=self._seq, resumed_from=resumed_from,
                                time=time.time(),
                                extra={"config_digest": self.config_digest, "world_size": self.topo.world,
                                       "dp_size": self.topo.dp_size, "param_dtype": self.param_dtype,
                                       "precision": self.precision, "param_groups": self.param_groups,
                                       "knobs": self.knobs.to_json(), **self.launch.header()})
        # the documents proofs convicted up to the step this segment resumes from stay masked
        # (later convictions happen again when their steps are trained again)
        self.quarantine = Quarantine(self.config.filter.quarantine)
        self.proven = [e for e in read_proven(self.folder) if e[2] <= resumed_from]
        self.quarantine.add((s, d) for s, d, _ in self.proven)
        if self.quarantine:
            # recorded, not refused: quarantining documents after a spike is the normal use
            header.extra["quarantine"] = {"files": self.quarantine.paths, "digest": self.quarantine.digest,
                                          "documents": len(self.quarantine.docs),
                                          "proven": len(self.proven)}
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

    def state_dict(self) -> dict[str, Any]:
        state = self.recorder.state_dict() if self.recorder else dict(self._state)
        state["spike_detector"] = json.dumps(self.guard.state_dict()) if self.guard else \
            self._state.get("spike_detector", "")
        state["quarantine_digest"] = self.quarantine.digest  # what the checkpointed model was masked with
        if self.stall is not None:
            state["stall"] = json.dumps(self.stall.state_dict())
        state["health"] = json.dumps(self.health.state_dict())
        if self.adam_level is not None:
            state["adam_level"] = json.dumps(self.adam_level.state_dict())
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
        if self._state.get("stall") and self.stall is not None:
            self.stall.load_state_dict(json.loads(self._state["stall"]))
        if self._state.get("health"):
            self.health.load_state_dict(json.loads(self._state["health"]))
        if self._state.get("adam_level") and self.adam_level is not None:
            self.adam_level.load_state_dict(json.loads(self._state["adam_level"]))


def read_proven(folder: Path) -> list[list]:
    """``[source, doc, step]`` of the run's own quarantine file (``records.PROVEN_FILE``)."""
    path = Path(folder) / records.PROVEN_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            out.append([str(e["source"]), int(e["doc"]), int(e["step"])])
    return out
