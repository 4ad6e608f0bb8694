"""The spike detector: the rules' histories on device, their two tiers, the stats vector.

Design decision: the rules are tensor math on values that are already reduced
(global loss, global pre-clip grad norm), so every rank computes the same flag
on its own device, with no collective and no host read. The same class runs
offline over a ledger's rows (CPU tensors, identical code), which is how
``replay drill`` and ``diagnose`` find spikes in a finished run.

What each rule measures is :mod:`titan_ledger.components.detection.spike_rules` (pure
functions of the step and its histories). This module is the state those rules read: the
window of accepted steps, the evidence histories, ``grad_novelty``'s memory, a lasting
change of level's pending steps -- kept in one object, because a checkpoint saves it and
``before`` restores it as it stood before a step (the proof at the alarm judges another
execution of that step by the run's own history) -- and it decides which flags act.

Two tiers (an alarm is a promise). A rule's flag either *acts* -- the step is a spike:
an alert, the ``on_spike`` ladder, the auto-skip list -- or is recorded as a *note*:
in spikes.jsonl (``notes``) and on the dashboards, nothing else. Which rules may act
is measured, not assumed: ``bench/false_alarms.py`` counts every rule on clean runs
(docs/benchmarks.md, "False alarms", 21,000 recorded clean steps: 796 acting flags before
the tiers; 18 with the tiers but no ``grad_novelty``, all grad-norm rules; 1 with it). By
default the document rules are notes (``notes``: a corpus whose documents are learned
at different times makes clean outliers), and rank separation acts only when it is
decisive for *this run*: past ``separation`` and past its own history's upper tail,
``median + separation_gate x (q90 - median)`` of the statistic over the last
``window`` steps (every step's value enters, so the bound is a quantile of what this
run has seen), with at least ``separation_warmup`` (64) values behind it; a separation
in early training, or one that only passes the constant, is a note. A z-score acts only on
a material move (grad norm ``zscore_min_ratio`` (3) x its window median, loss
``loss_jump`` over its recent median): unusual but small moves are notes. The
grad-norm rules (z-score, ratio, grad jump) act only on a move the run has not shown:
more than ``grad_novelty`` (2) x the largest grad-jump ratio of its last ``grad_memory``
(1,024) accepted steps, once 64 are remembered (clean training has a heavy tail of its
own: a copy-corpus run from the warm base moved 3.4-5.5x at a dozen clean steps, the
zoo's faults 3-21x; no constant separates them, the run's own history does). The
non-finite rule always acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.config import Configurable

from titan_ledger.components.detection.spike_rules import (
    DEFAULT_NOTES,
    EROWS,
    NOTE_ONLY,
    RULES,
    evidence,
    grad_move,
    window_rules,
)
from titan_ledger.errors import ConfigError

#: layout of the stats vector ``SpikeDetector.step`` returns (all float64). ``flag``: an
#: acting rule fired (the step is a spike); each RULES entry: that rule fired *and acts*;
#: ``note``: a rule fired as a note only; ``note_mask``: which (bit i = RULES[i]).
STAT_KEYS = ("flag", *RULES, "note", "note_mask", "loss_mean", "loss_std", "loss_median", "grad_norm_mean",
             "grad_norm_std", "grad_norm_median", "n", "separation_y", "separation_rank",
             "doc_high_y", "doc_low_y", "doc_y_median_high", "doc_y_median_low", "doc_high_rank",
             "doc_low_rank", "grad_jump_ratio", "separation_bound", "grad_jump_bound", "readmitted",
             "rank_loss_y", "rank_loss_rank", "rank_loss_median", "loss_recent")


class SpikeDetector(Configurable):
    """On-device sliding-window spike rules over (loss, grad_norm)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enable: bool = True
        """Run the spike rules every step (results in signals.jsonl ``spike`` and spikes.jsonl)."""

        window: int = 128
        """Steps in the sliding window (OLMo-core: 128). Rules start after window/2 steps."""

        zscore: float = 6.0
        """z-score rule: value - mean > zscore * std (0 disables it)."""

        zscore_min_ratio: float = 3.0
        """...and it acts only when the move is material: the grad norm at least this many
        times its window median, the ratio rule's bar (the loss: ``loss_jump`` over its
        recent median); a smaller z-score move is a note. Measured on clean runs: a
        1.56x grad norm at 9 std, a 2.2x one at step 740 of a clean DP-2 run (the clip
        at max_norm 1 already bounds such an update)."""

        ratio: float = 3.0
        """Ratio rule: grad norm > ratio x window median (0 disables it)..."""

        loss_jump: float = 0.05
        """...and loss > (1 + loss_jump) x the median loss of the last 2 x min_history steps
        (0.05: a grad norm 3x its median with the loss 5% over its recent level; the zoo's
        held-out LR ramp was 3.4x and +9.6%, and no clean run here reaches 3x after step 9)."""

        separation: float = 2.5
        """Rank-separation rule: one DP rank's documents all above (or all below) every
        other rank's, by this many times the ranks' own document spread (log hi - log
        lo); 0 disables; needs DP >= 2."""

        separation_floor: float = 0.05
        """...and by at least this log ratio (5%)."""

        min_docs: int = 3
        """Rank separation: ranked documents each rank needs (fewer: the rule abstains)."""

        one_doc_spread: bool = True
        """Rank separation: a DP rank whose rows are all slices of ONE document (counted from
        the sample ids) is measured with the run's between-document spread (the median of the
        spread of ranks holding several documents), not its own: its own is how much a
        document differs from itself. Measured: a clean warm DP-2 run at 4 x 256 tokens per
        rank, each rank holding one long document, separated by 3.1-3.4 and acted twice in 300
        steps. False: every rank's own spread (before; also for ledgers recorded without
        document counts)."""

        doc_outlier: float = 6.0
        """Document rule: a rank's highest (or lowest) document log loss over its median
        segment log loss > history median + doc_outlier x history MAD (0 disables)."""

        doc_outlier_floor: float = 0.7
        """...and > this log ratio (0.7: a document at 2x or 1/2 its batch's median loss)."""

        doc_tail_spread: bool = True
        """Document rules: the history's spread is max(MAD, (q90 - median) / 1.9), so a
        degenerate history (MAD 0: at 2 rows per rank doc_low is 0 on most steps) is
        judged by its upper tail; False: the MAD alone (before the tiers)."""

        grad_jump: float = 4.0
        """Grad-jump rule: grad norm > grad_jump x the median of recent steps (0 disables)."""

        min_history: int = 8
        """The evidence rules (rank spread, documents, grad jump) and the ratio rule start
        after this many steps (the z-score rule after window/2)."""

        notes: str = DEFAULT_NOTES
        """Rules recorded as notes only (comma-separated names of spike_rules.RULES): in
        spikes.jsonl and on the dashboards, never an alert, an on_spike action or the
        auto-skip list. Empty: every rule acts (the behaviour before the tiers);
        non_finite always acts."""

        separation_gate: float = 3.0
        """Rank separation acts only past median + separation_gate x (q90 - median) of its
        own last ``window`` values (and after ``separation_warmup`` of them); below that
        bound, or earlier, it is a note. 0: it acts whenever it passes ``separation``."""

        separation_warmup: int = 64
        """...and only with at least this many values of its history (half the default
        window, as the z-score rule): early training's fast descent separates clean ranks
        (2.81 at step 16 of a clean DP-2 run, with injected random batches at 2.6-2.9),
        so an early separation is a note."""

        grad_novelty: float = 2.0
        """The grad-norm rules (``zscore_grad_norm``, ``ratio``, ``grad_jump``) act only on a
        move this many times larger than any this run has shown: the grad norm over its
        recent median (the grad-jump ratio) must exceed ``grad_novelty`` x the largest such
        ratio of the last ``grad_memory`` accepted steps; a smaller move is a note. 0: off,
        they act on their own bars. Clean training has a heavy tail of its own (copy-corpus
        training from the warm base: 3.4-5.5x moves at steps 591-1333 of a clean run; a
        heterogeneous one 3.0-3.3x), which no constant bar separates from a fault's 3-6x."""

        grad_memory: int = 1024
        """...the accepted steps whose grad-jump ratios ``grad_novelty`` remembers (8 windows:
        a run's clean tail recurs over hundreds of steps)."""

        grad_novelty_warmup: int = 64
        """...remembered from this many accepted steps on, and used once this many are
        remembered (from about step 2 x 64): before, the grad-norm rules act on their own bars
        (early training's descent is no tail to compare with: a cold start's 3.2x moves at
        steps 9-11 would double the bar for 1,000 steps)."""

        grad_move: float = 1.8
        """Note only (never acts by itself; proven under ``--ledger.proof.scope all``): the
        grad norm at least this many times the median of its recent steps with the loss
        unmoved (under ``loss_jump`` over its recent median), after ``min_history`` steps --
        the shape of a finite hardware fault. 0 disables it."""

        rank_loss: float = 8.0
        """Note only (DP >= 2): one DP rank's mean loss farther from the ranks' median (log)
        than this many times the median of that distance over the window, after
        ``min_history`` steps (no warm-up beyond: a rank's share of the loss is comparable
        from the first steps on). 0 disables it."""

        rank_loss_floor: float = 0.06
        """...and by at least this log ratio. Measured (``bench/false_alarms.py --quick --prove
        all``, 1,000 clean steps, replayed under other settings): 6 / 3% noted 22 clean steps,
        8 / 6% 7 (5 of them before step 18 of a cold run); the DP-4 random batch stood 9.0x
        its median distance off (0.097)."""

        dip_note: bool = True
        """A grad-norm flag on a falling loss is a note: the grad-norm rules (z-score, ratio,
        grad jump) do not act when the step's loss fell more than ``loss_jump`` under its
        recent median (the ratio rule never did: it asks the loss to rise). A note is still
        proven under ``--ledger.proof.scope all`` and acts when its proof finds a harmful
        cause (a batch of repeated text lowers the loss and convicts itself). Measured on the
        memorisation plateau (issue 67): the dip at step 123 (the loss at 15% of its median,
        the grad norm 4x) was flagged again at the same step under the fix its proof pointed at
        (Adam's epsilon 1e-6, from scratch): a batch the model finds easy, not an instability.
        False: they act as before."""

        readmit_after: int = 64
        """A lasting change of level: after this many consecutive acting-flagged steps
        (finite ones), their values enter the history and the run's new level becomes its
        normal, instead of an alarm -- and a proof -- at every step for the rest of the run
        (measured: a switch from an easy corpus to text flagged all 841 steps after it;
        docs/benchmarks.md, "Real instabilities"). The readmitting step is still flagged;
        its event says ``readmitted``, and the history starts again from those steps. A
        spike is over long before this (clean training had 1 acting flag in 21,000 steps;
        the tiny model's real instabilities flag at most 15 steps in a row), and an acting
        ``action`` or the ladder has acted by then. 0: flagged steps never enter the
        history. Capped at ``window``."""

        def note_rules(self) -> tuple[str, ...]:
            return tuple(r.strip() for r in self.notes.split(",") if r.strip())

        def __post_init__(self) -> None:
            # checked when the config is parsed, before any process group exists
            if self.window < 2:
                raise ConfigError(f"--ledger.spike.window must be >= 2, got {self.window}")
            if self.min_history < 1:
                raise ConfigError(f"--ledger.spike.min_history must be >= 1, got {self.min_history}")
            for name in ("separation_warmup", "grad_novelty_warmup"):
                if getattr(self, name) < 0:
                    raise ConfigError(f"--ledger.spike.{name} must be >= 0, got {getattr(self, name)}")
            if self.readmit_after < 0:
                raise ConfigError(f"--ledger.spike.readmit_after must be >= 0 (0: never), got {self.readmit_after}")
            if self.grad_memory < 1:
                raise ConfigError(f"--ledger.spike.grad_memory must be >= 1, got {self.grad_memory}")
            if self.min_docs < 1:
                raise ConfigError(f"--ledger.spike.min_docs must be >= 1, got {self.min_docs}")
            bad = [r for r in self.note_rules() if r not in RULES or r == "non_finite"]
            if bad:
                raise ConfigError(f"--ledger.spike.notes {self.notes!r}: {', '.join(bad)} is not a rule that can "
                                  f"be a note; give comma-separated names from "
                                  f"{', '.join(r for r in RULES if r != 'non_finite')} (or '' for none)")
            for name in ("zscore", "ratio", "loss_jump", "separation", "separation_floor", "doc_outlier",
                         "doc_outlier_floor", "grad_jump", "separation_gate", "zscore_min_ratio", "grad_novelty",
                         "grad_move", "rank_loss", "rank_loss_floor"):
                if getattr(self, name) < 0:
                    raise ConfigError(f"--ledger.spike.{name} must be >= 0 (0 switches the rule off), "
                                      f"got {getattr(self, name)}")

    def __init__(self, config: Config, device: torch.device | str = "cpu") -> None:
        self.config = config
        w = int(config.window)
        self.hist = torch.zeros(2, w, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self._arange = torch.arange(w, device=device)
        # evidence rules: histories of [log grad norm, doc high, doc low, rank separation,
        # between-document spread, rank-loss distance], their counts
        self.ehist = torch.zeros(EROWS, w, dtype=torch.float64, device=device)
        self.ecount = torch.zeros(EROWS, dtype=torch.int64, device=device)
        notes = set(config.note_rules())
        # static per rule: may its flag act? (a note rule's flag is only recorded)
        # grad_novelty's memory: the log grad-jump ratios of the last grad_memory accepted steps
        self.jhist = torch.full((int(config.grad_memory),), -torch.inf, dtype=torch.float64, device=device)
        self.jcount = torch.zeros((), dtype=torch.int64, device=device)
        # readmission (``readmit_after``): the current run of consecutive flagged steps' values
        k = max(min(int(config.readmit_after), w), 1)
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.pend = torch.zeros(2, k, dtype=torch.float64, device=device)
        self._rundo = None
        self._acts = torch.tensor([r not in notes and r not in NOTE_ONLY for r in RULES], dtype=torch.bool,
                                  device=device)
        self._bits = torch.tensor([float(2 ** i) for i in range(len(RULES))], dtype=torch.float64, device=device)

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor, dp_loss: torch.Tensor | None = None,
             doc: torch.Tensor | None = None) -> torch.Tensor:
        """Judge this step and update the windows. Returns STAT_KEYS values.

        ``loss``, ``grad_norm``: the global values (0-d). ``dp_loss``: each DP rank's
        mean loss ``[dp]``. ``doc``: per DP rank ``[dp, 4]`` = (median segment loss,
        highest segment mean loss, lowest segment mean loss, ranked segments), NaN where
        absent, optionally a 5th column: distinct documents (NaN: unknown, taken as several).
        (The rules call a segment -- a document's span in one row -- a document.)
        """
        c = self.config
        w = self.hist.shape[1]
        v = torch.stack([loss.double().reshape(()), grad_norm.double().reshape(())])
        win = window_rules(c, self.hist, self.count, self._arange, v)
        finite, z, ratio, recent_loss = win.finite, win.z, win.ratio, win.recent_loss
        non_finite = ~finite.all()
        ev = evidence(c, self.ehist, self.ecount, self._arange, grad_norm, doc, dp_loss)
        self._enter_evidence(ev.values)
        log_jump = ev.log_jump
        # grad_novelty: a grad-norm move acts only past the largest this run has shown
        c_j = self.jcount.clamp(max=self.jhist.shape[0])
        if c.grad_novelty > 0:
            jbound = self.jhist.max() + torch.log(torch.tensor(c.grad_novelty, dtype=torch.float64, device=v.device))
            grad_decisive = (c_j < c.grad_novelty_warmup) | ~(log_jump <= jbound)  # NaN jump: the bars alone
        else:
            jbound = torch.tensor(float("nan"), dtype=torch.float64, device=v.device)
            grad_decisive = torch.ones((), dtype=torch.bool, device=v.device)
        # grad move (a note): silent where a grad-norm rule fired (z-score, ratio, grad jump)
        move = grad_move(c, log_jump, win.loss_up, z[1] | ratio.reshape(()) | ev.fired[3])
        fired = torch.cat([torch.stack([z[0], z[1], ratio.reshape(()), non_finite]), ev.fired[:4], move.reshape(1), ev.fired[4:]])
        # the tiers: a rule acts if it may (``notes``), rank separation only when decisive
        acts = self._acts.clone()
        acts[RULES.index("rank_separation")] &= ev.decisive
        dip = v[0] < (1 - c.loss_jump) * recent_loss if c.dip_note else torch.zeros((), dtype=torch.bool,
                                                                                      device=v.device)
        for r in ("zscore_grad_norm", "ratio", "grad_jump"):
            acts[RULES.index(r)] &= grad_decisive & ~dip
        acts[:2] &= win.material
        acting = fired & acts
        noted = fired & ~acts
        flag = acting.any()
        # accepted steps enter the window; a spike does not (a note does: it is not a spike)
        idx = self.count % w
        col = self.hist[:, idx].clone()  # what ``before`` restores (a 0-d index is a view)
        undo = (idx, col, self.count, self.jcount, self._eundo)
        self.hist[:, idx] = torch.where(flag, col, v)
        self.count = self.count + (~flag).long()
        # ...and so does its grad-jump ratio into grad_novelty's memory
        # (from the grad_novelty_warmup-th accepted step on: early training's descent is
        # no part of the run's clean tail, and would halve the rules' reach for 1,000 steps)
        keep = ~flag & torch.isfinite(log_jump) & (self.count > c.grad_novelty_warmup)
        jdx = self.jcount % self.jhist.shape[0]
        jold = self.jhist[jdx].clone()
        self.jhist[jdx] = torch.where(keep, log_jump, jold)
        self.jcount = self.jcount + keep.long()
        self._undo = (*undo, jdx, jold)
        readmitted = self._readmit(flag & finite.all(), v, w)
        shown = torch.where((c_j >= c.grad_novelty_warmup) & torch.isfinite(jbound), jbound.exp(),
                            torch.tensor(float("nan"), dtype=torch.float64, device=v.device))
        return torch.cat([flag.double().reshape(1), acting.double(),
                          torch.stack([noted.any().double(), (noted.double() * self._bits).sum()]),
                          torch.stack([win.mean[0], win.std[0], win.median[0], win.mean[1], win.std[1], win.median[1],
                                       win.n.double()]),
                          ev.stats, shown.reshape(1), readmitted.reshape(1), ev.rl_stats, recent_loss.reshape(1)])

    def _readmit(self, flagged: torch.Tensor, v: torch.Tensor, w: int) -> torch.Tensor:
        """``readmit_after``: keep this step's values while the flagged steps run on; at the
        n-th in a row the history starts again from them (a change of level, not a spike):
        the window holds those n steps, and so does the grad-jump rule's grad-norm history,
        so that the medians the ratio and grad-jump rules use are the new level's (writing n
        values into a 128-step window would leave its median at the old level). Returns n
        on that step, NaN otherwise (no host read)."""
        n = min(int(self.config.readmit_after), w)
        nan = torch.full_like(v[0], float("nan"))  # (constants by fill kernels: no host-to-device copy)
        if n == 0:
            return nan
        sidx = self.streak % n
        pold = self.pend[:, sidx].clone()
        self.pend[:, sidx] = torch.where(flagged, v, pold)
        streak = torch.where(flagged, self.streak + 1, torch.zeros_like(self.streak))
        readmit = streak >= n
        # what ``before`` restores (small copies: 2 x window and one evidence row)
        self._rundo = (sidx, pold, self.streak, self.hist.clone(), self.ehist[0].clone(), self.ecount[0].clone())
        self.hist[:, :n] = torch.where(readmit, self.pend, self.hist[:, :n])
        self.count = torch.where(readmit, torch.full_like(self.count, n), self.count)
        self.ehist[0, :n] = torch.where(readmit, self.pend[1].log(), self.ehist[0, :n])
        self.ecount[0] = torch.where(readmit, torch.full_like(self.ecount[0], n), self.ecount[0])
        self.streak = torch.where(readmit, torch.zeros_like(streak), streak)
        return torch.where(readmit, torch.full_like(v[0], float(n)), nan)

    def _enter_evidence(self, y: torch.Tensor) -> None:
        """Every finite value of the evidence rules (``y`` [EROWS]) enters its history: one
        outlier barely moves a median, and a statistic that trends cannot lock the rule into
        flagging."""
        take = torch.isfinite(y)
        idx = self.ecount % self.ehist.shape[1]
        rows = torch.arange(EROWS, device=self.ehist.device)
        eold = self.ehist[rows, idx]  # (a tensor index: a copy)
        self._eundo = (idx, eold, self.ecount)
        self.ehist[rows, idx] = torch.where(take, y, eold)
        self.ecount = self.ecount + take.long()

    def before(self) -> SpikeDetector:
        """A copy of this detector as it stood before its last ``step``: the run's own
        history, to judge another execution of that step by the same rules (the proof at
        the alarm). The step kept references to what it overwrote (no copy per step)."""
        det = SpikeDetector(self.config, self.hist.device)
        idx, col, count, jcount, (eidx, eold, ecount), jdx, jold = self._undo
        det.hist, det.count = self.hist.clone(), count
        det.streak, det.pend = self.streak.clone(), self.pend.clone()
        det.ehist, det.ecount = self.ehist.clone(), self.ecount.clone()
        if self._rundo is not None:  # undone in reverse order: the readmission wrote last
            sidx, pold, streak, hist, ehist0, ecount0 = self._rundo
            det.hist = hist.clone()
            det.ehist[0], det.ecount[0] = ehist0, ecount0
            det.pend[:, sidx] = pold
            det.streak = streak
        det.hist[:, idx] = col
        det.ecount = ecount
        det.ehist[torch.arange(EROWS, device=eold.device), eidx] = eold
        det.jhist, det.jcount = self.jhist.clone(), jcount
        det.jhist[jdx] = jold
        return det

    def state_dict(self) -> dict[str, Any]:
        return {"hist": self.hist.tolist(), "count": int(self.count),
                "ehist": self.ehist.tolist(), "ecount": self.ecount.tolist(),
                "jhist": self.jhist.tolist(), "jcount": int(self.jcount),
                "streak": int(self.streak), "pend": self.pend.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        hist = torch.tensor(state["hist"], dtype=torch.float64, device=self.hist.device)
        if hist.shape != self.hist.shape:  # window changed: keep the most recent values
            return
        self.hist = hist
        self.count = torch.tensor(int(state["count"]), device=self.count.device)
        if "ehist" in state:  # checkpoints before the evidence rules have none
            eh = torch.tensor(state["ehist"], dtype=torch.float64, device=self.hist.device)
            ec = torch.tensor(state["ecount"], dtype=torch.int64, device=self.hist.device)
            k = eh.shape[0]  # checkpoints before the tiers have no separation history
            self.ehist[:k], self.ecount[:k] = eh, ec
        if "jhist" in state and len(state["jhist"]) == self.jhist.shape[0]:  # before grad_novelty: none
            self.jhist = torch.tensor(state["jhist"], dtype=torch.float64, device=self.hist.device)
            self.jcount = torch.tensor(int(state["jcount"]), device=self.hist.device)
        pend = state.get("pend")  # checkpoints before readmission have none: no run of flags
        if pend is not None and torch.tensor(pend).shape == self.pend.shape:
            self.pend = torch.tensor(pend, dtype=torch.float64, device=self.hist.device)
            self.streak = torch.tensor(int(state["streak"]), device=self.hist.device)


def describe(stats: list[float]) -> dict[str, Any]:
    """STAT_KEYS values (host floats) -> an event dict: ``rules`` (the acting rules that
    fired: the step is a spike when there is one), ``notes`` (rules that fired as notes
    only), the statistics (NaN ones, e.g. the rank spread at DP 1, left out)."""
    d = dict(zip(STAT_KEYS, stats))
    mask = int(d["note_mask"])
    out = {"rules": [r for r in RULES if d[r]], "notes": [r for i, r in enumerate(RULES) if mask >> i & 1]}
    for k in STAT_KEYS[1 + len(RULES) + 2:]:
        v = d[k]
        if v == v:
            out[k] = int(v) if k.endswith("_rank") else v
    return out


def is_note(stats: list[float]) -> bool:
    """A step with notes and no acting rule (host floats, STAT_KEYS layout)."""
    return bool(stats[STAT_KEYS.index("note")]) and not stats[0]


def detect_offline(rows: list[dict], config: SpikeDetector.Config) -> list[dict]:
    """Run the rules over ledger rows (trained steps only), as the trainer would have
    (acting flags only: the loss and grad-norm rules, which these rows carry)."""
    det = SpikeDetector(config)
    events = []
    for r in rows:
        if r.get("skipped") or r.get("loss") is None:
            continue
        stats = det.step(torch.tensor(float(r["loss"]), dtype=torch.float64),
                         torch.tensor(float(r["grad_norm"]), dtype=torch.float64)).tolist()
        if stats[0]:
            events.append({"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"],
                           **describe(stats)})
    return events
