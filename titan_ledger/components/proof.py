"""Proof at the alarm: a flagged step re-executed in place, before its update.

Design decision: between the clip and ``optimizers.step()`` the flagged step is still
in memory -- its batches (``StepRecord.batches``), the parameters and the optimizer
state it was computed from -- so a counterfactual costs a forward/backward, not a
checkpoint reload on the run's whole world size. :class:`Prover` re-executes the step
through the trainer's own ``execute`` (the copied torchtitan body, so nothing about
the step differs but the labels a variant masks):

* ``same``: the step again. Unequal to the first execution (bit for bit, or past
  ``--ledger.on_spike.prove_rtol``) is a transient fault (``hardware``): a third
  execution decides which result is applied, and the ranks whose local loss or
  gradients changed are named. When all three differ, the machine does not execute
  the step bit for bit (a GPU without ``--debug.deterministic``: atomics in attention's
  and embeddings' backward) and the proof measures that noise itself instead of
  trusting a constant: the closest two executions give the floor, per parameter and
  rank, and an execution is a fault only when it stands farther from both others than
  ``--ledger.on_spike.prove_noise_factor`` times that floor (:func:`odd_one_out`);
  otherwise the step reproduced within this machine's noise, and the noise is recorded
  with the proof (the tolerance, measured at every proof that needs one).
* ``control`` then ``masked``: the evidence's suspect (one DP rank's whole batch, or
  the documents that stand out on it) loss-masked, and, as a control, as much other
  data masked (another DP rank's batch, or other documents of like size). ``bad_data``
  only when ``masked`` brings the *update* back under the grad-norm rules' bars of
  this run's own history and ``control`` does not: masking the data that defines a
  per-rank or per-document statistic always removes the statistic, so the statistic
  proves nothing.

The decision itself (:func:`judge`) is a pure function of the executions' numbers,
unit-tested without processes. An unflagged step costs nothing here: the trainer
asks :meth:`Prover.wanted` only with the flag the update guard reads anyway.

What the extra executions touch and this module restores: the gradients (the first
execution's are kept by reference and put back unless another result is applied),
the per-step accumulators they refill (per-document loss sums, log Z, max logits:
drained after each execution), the rehearsal's one-time faults (a bitflip happens in
the first execution only, as a transient fault would), the RNG state. The models
here draw no random numbers in forward/backward; a model with dropout would need the
step's starting RNG state, which is not kept (it would cost every step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from titan_ledger.components import signals
from titan_ledger.format.proofs import HARMFUL, VERDICTS, describe_proof  # noqa: F401  (re-exported)

#: what ``--ledger.on_spike.prove`` may say
PROVE_MODES = ("off", "acting", "all")


@dataclass
class Execution:
    """One execution of the flagged step: the global values and, per global rank,
    ``[local loss, local grad sum of squares (post-clip), valid tokens, equal, again]`` where
    ``equal`` is 1 when every local gradient equals the first execution's bit for bit (in
    the step; by per-parameter checksum when deferred) and ``again`` (a second repeat's)
    when they equal the first repeat's by checksum."""

    variant: str  # original | same | control | masked
    loss: float
    grad_norm: float
    ranks: list[list[float]] = field(default_factory=list)
    normal: bool | None = None  # under the grad-norm rules' bars (None: not judged)
    seconds: float = 0.0
    clip_coef: float = 1.0  # the clip's factor (the gradients were read after it)
    #: this rank's pre-clip gradient sum of squares per parameter (local; never written):
    #: the noise floor when three executions differ
    psq: Any = None
    sums: Any = None  # this rank's gradient sum per parameter (float64; with psq, a checksum)

    def pre_clip_sq(self, r: int) -> float:
        return self.ranks[r][1] / (self.clip_coef * self.clip_coef)

    def to_json(self) -> dict[str, Any]:
        out = {"variant": self.variant, "loss": _num(self.loss), "grad_norm": _num(self.grad_norm),
               "normal": self.normal, "seconds": round(self.seconds, 4),
               "per_rank": [{"loss": _num(r[0]), "grad_sq": _num(r[1]), "tokens": int(r[2])}
                            for r in self.ranks]}
        if self.variant == "same":
            out["bit_equal"] = all(r[3] == 1 for r in self.ranks)
        return out


@dataclass
class FirstExecution:
    """A flagged step's first execution as a deferred decision keeps it for a step
    (``OnSpikeConfig.defer``): its gradients are overwritten by the next step's, so what
    the proof compares is kept on the device instead -- per parameter the local
    gradient's sum of squares and its sum (a checksum: a changed bit changes one of them,
    a sign included) -- with the loss sum, tokens and grad norm ``Ledger.record`` saw."""

    loss_sum: Any
    local_tokens: int
    grad_norm: Any
    psq: Any
    sums: Any

    @classmethod
    def of(cls, trainer) -> FirstExecution:
        """The step just recorded, from the live gradients (device work only, no host read)."""
        grads = [p.grad for m in trainer.model_parts for p in m.parameters()]
        loss_sum, local_tokens, grad_norm = trainer.ledger.last_execution
        return cls(loss_sum, local_tokens, grad_norm, _per_param_sq(grads, trainer.device),
                   _per_param_sum(grads, trainer.device))


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _same(p: float, q: float) -> bool:
    """Equal, NaN included: a step that is NaN each time reproduced its NaN."""
    return p == q or (math.isnan(p) and math.isnan(q))


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN included (``torch.equal`` calls NaN unequal to itself, which made
    a step whose gradients were NaN every time look like a transient fault)."""
    if torch.equal(a, b):
        return True
    nan = a.isnan()
    return bool(nan.any()) and torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0),
                                                                           b.masked_fill(nan, 0))


def differing_ranks(a: Execution, b: Execution, rtol: float) -> list[int]:
    """Global ranks whose local loss or gradients differ between two executions of the
    same data: bit for bit (``rtol`` 0; ``b``'s equal flags, measured against the
    first execution, or its values) or past ``rtol`` relative; NaN equals NaN."""
    out = []
    for r, (x, y) in enumerate(zip(a.ranks, b.ranks)):
        if rtol == 0:
            # b's gradients against a's, bit for bit (a checksum per parameter): the first
            # execution's flag, or a second repeat's against the first repeat
            flag = y[3] if a.variant == "original" else (y[4] if len(y) > 4 else 1)
            same = _same(x[0], y[0]) and _same(x[1], y[1]) and flag == 1
        else:  # (inf is within no tolerance of a finite value)
            same = all(_same(p, q) or (math.isfinite(p) and math.isfinite(q) and
                                       abs(p - q) <= rtol * max(abs(p), abs(q), 1e-30)) for p, q in zip(x[:2], y[:2]))
        if not same:
            out.append(r)
    return out


def faulty_ranks(a: Execution, b: Execution, changed: list[int], rtol: float = 1e-5) -> list[int]:
    """Of the ``changed`` ranks, those whose own gradients or loss changed before the clip
    (a fault on one rank changes the global norm, so the clip changes every rank's
    gradients after it); all of them when none stands out. Behind a non-finite grad norm
    the clip multiplied every gradient by 0 (or NaN): the finite ones became 0, an inf
    one NaN, so the ranks left non-finite are the faulty ones, when some are not."""
    for x in (a, b):
        if not math.isfinite(x.grad_norm):
            odd = [r for r in changed if not math.isfinite(x.ranks[r][1])]
            return odd if 0 < len(odd) < len(changed) else changed
    own = [r for r in changed
           if not _same(a.ranks[r][0], b.ranks[r][0])
           or abs(a.pre_clip_sq(r) - b.pre_clip_sq(r)) > rtol * max(a.pre_clip_sq(r), b.pre_clip_sq(r), 1e-30)]
    return own or changed


def local_distance(a: Execution, b: Execution, rank: int) -> float:
    """How far two executions of the same data lie apart on this rank: the largest
    relative difference of its local loss and of any parameter's pre-clip gradient sum
    of squares (``psq``; one value per parameter, so that noise is measured in many
    coordinates and a fault in one parameter stands out). inf when either is not finite."""
    def rel(p, q):
        return abs(p - q) / max(abs(p), abs(q), 1e-30)

    d = rel(a.ranks[rank][0], b.ranks[rank][0])
    if a.psq is not None and b.psq is not None and a.psq.numel():
        pa = a.psq / (a.clip_coef * a.clip_coef)
        pb = b.psq / (b.clip_coef * b.clip_coef)
        both = torch.maximum(pa.abs(), pb.abs()).clamp_min(1e-30)
        rel_p = torch.nan_to_num((pa - pb).abs() / both, nan=math.inf)  # inf against inf is not close
        d = max(d, float(rel_p.max()))
    return d if math.isfinite(d) else math.inf


#: execution i (0: the first, 1 and 2: the repeats) -> the indices of its two distances in
#: a rank's ``[d(0,1), d(0,2), d(1,2)]``
_MINE = {0: (0, 1), 1: (0, 2), 2: (1, 2)}


def odd_one_out(distances: list[list[float]], factor: float) -> tuple[int | None, float]:
    """Of three executions (0: the first, 1 and 2: the repeats) that all differ, the one
    a fault changed, or None when all three agree within the execution noise (pure).

    ``distances``: per rank ``[d(0,1), d(0,2), d(1,2)]`` (:func:`local_distance`). The
    noise floor is the distance of the closest pair, the largest over ranks (the
    machine's noise where it is widest); an execution is the odd one when it stands
    farther than ``factor`` times that floor from both others on some rank. Returns
    (odd, floor). Under pure noise with one value per rank, a factor of 100 names an odd
    one in 1.6% of proofs at 1 rank and 0.02% at 2 (3 Gaussian draws, simulated); with
    one value per parameter it is far rarer."""
    if not distances:
        return None, 0.0
    pair_of = {0: 2, 1: 1, 2: 0}  # execution i -> the index of the pair distance without it
    mine = _MINE
    totals = [max(r[k] for r in distances) for k in range(3)]
    closest = min(range(3), key=lambda k: totals[k])  # the pair distance of the closest two
    odd = next(i for i, k in pair_of.items() if k == closest)
    floor = totals[closest]
    gap = max(min(r[mine[odd][0]], r[mine[odd][1]]) for r in distances)
    return (odd if gap > factor * floor else None), floor


@dataclass
class Verdict:
    verdict: str  # one of VERDICTS
    applied: str  # original | same | masked | none (no update: no two executions agreed)
    ranks: list[int] = field(default_factory=list)  # hardware: the ranks that changed
    why: str = ""
    noise: float | None = None  # the execution noise floor, when three executions differed


def reproduced(original: Execution, repeats: list[Execution], rtol: float,
               distances: list[list[float]] | None, factor: float) -> tuple[bool, float | None]:
    """Whether the step reproduced (pure): the first repeat equals the first execution,
    or three executions all differ and none stands out from the noise (then also the
    noise floor). A floor that is not finite (every pair infinitely apart: each execution
    inf or NaN where another is finite) is no noise: not reproduced. A step that is NaN
    in the same places each time reproduced (:func:`same_tensor`)."""
    if not differing_ranks(original, repeats[0], rtol):
        return True, None
    if len(repeats) < 2 or distances is None:
        return False, None
    if not differing_ranks(repeats[0], repeats[1], rtol) or not differing_ranks(original, repeats[1], rtol):
        return False, None
    odd, floor = odd_one_out(distances, factor)
    return odd is None and math.isfinite(floor), floor


def judge(original: Execution, repeats: list[Execution], masked: Execution | None,
          control: Execution | None, rtol: float = 0.0, suspect: bool = False,
          distances: list[list[float]] | None = None, noise_factor: float = 100.0) -> Verdict:
    """The verdict from the executions (pure). ``repeats``: one ``same`` execution, two
    when the first differed. ``masked``/``control``: None when no suspect was named, no
    control exists, or the first update was normal (then they are not executed);
    ``suspect``: whether the evidence named suspect data. ``distances``: when three
    executions all differ, per rank their pairwise distances (:func:`odd_one_out`)."""
    v = _judge(original, repeats, masked, control, rtol, suspect, distances, noise_factor)
    if len(repeats) > 1 and distances is not None and differing_ranks(repeats[0], repeats[1], rtol):
        v.noise = odd_one_out(distances, noise_factor)[1]
    return v


def _judge(original, repeats, masked, control, rtol, suspect, distances, noise_factor) -> Verdict:
    first = repeats[0]
    changed = differing_ranks(original, first, rtol)
    ok, _ = reproduced(original, repeats, rtol, distances, noise_factor)
    if changed and not ok:
        if len(repeats) < 2:
            raise ValueError("judge: the step changed between executions; a third decides")
        second = repeats[1]
        if not differing_ranks(first, second, rtol):
            return Verdict("hardware", "same", faulty_ranks(original, first, changed),
                           "the first execution differed from two that agree")
        again = differing_ranks(original, second, rtol)
        if not again:
            return Verdict("hardware", "original", faulty_ranks(first, second, differing_ranks(first, second, rtol)),
                           "the second execution differed from two that agree")
        odd, floor = odd_one_out(distances, noise_factor) if distances is not None else (None, math.inf)
        if odd is not None and math.isfinite(floor):  # not bit-reproducible, but one stands out of its noise
            return _odd_verdict(odd, floor, distances, noise_factor)
        return Verdict("hardware", "none", sorted(set(changed) | set(again)), "no two of three executions agree")
    if original.normal:
        if suspect:
            return Verdict("outlier", "original", why="reproducible; the update is normal with the suspect data")
        return Verdict("not_data", "original", why="reproducible; the update is normal and no data is suspect")
    if masked is None or control is None:
        return Verdict("not_data", "original", why="reproducible and abnormal; no suspect data to mask "
                                                   "against a control")
    if masked.normal and not control.normal:
        return Verdict("bad_data", "masked", why="masking the suspect data brings the update back to "
                                                 "normal; masking as much other data does not")
    if control.normal and not masked.normal:
        # two disjoint masks of equal size, one restores the update: the other is its control,
        # whichever the evidence named (at DP 2 a rank's loss cannot tell which rank it is)
        return Verdict("bad_data", "control", why="masking the control's data brings the update back to "
                                                  "normal; masking the suspect's does not: the control's "
                                                  "data is the bad data")
    if masked.normal and control.normal:
        return Verdict("not_data", "original", why="masking the suspect or the control data brings the "
                                                   "update back: removing data, not bad data")
    return Verdict("not_data", "original", why="reproducible, and abnormal without the suspect data")


def noise_record(floor: float, factor: float, distances: list[list[float]]) -> dict[str, Any]:
    """The proof's ``noise``: the floor, the factor and per rank the pairwise distances;
    an infinite one is written null (the ledger's JSON is strict)."""
    return {"floor": _num(floor), "factor": factor, "distances": [[_num(x) for x in row] for row in distances]}


def _odd_verdict(odd: int, floor: float, distances: list[list[float]], factor: float) -> Verdict:
    """``hardware`` when three executions differ and ``odd`` stands out of their noise
    ``floor``: the ranks where it does are named; the other two agree within the noise."""
    mine = _MINE[odd]
    ranks = [r for r, d in enumerate(distances) if min(d[mine[0]], d[mine[1]]) > factor * floor]
    who = "the first execution" if odd == 0 else "a repeat"
    return Verdict("hardware", "same" if odd == 0 else "original", ranks,
                   f"{who} stood {factor:g}x farther from the other two than their execution noise "
                   f"({floor:.2g} relative)")


# --------------------------------------------------------------------------- suspects
@dataclass(frozen=True)
class Suspect:
    """What a proof masks: one DP rank's whole batch (``docs`` None) or the named
    documents on it; ``evidence`` says which rule named it."""

    dp_rank: int
    docs: frozenset | None = None  # {(source, doc)}
    evidence: str = ""


def name_suspect(event: dict[str, Any], dp_loss: list[float] | None, doc_summary: dict | None,
                 tags: list | None, floor: float) -> Suspect | None:
    """The suspect of a flagged step (pure): the documents the document rules named on
    their rank (segments whose mean loss is past ``floor`` in log ratio to the rank's
    median, at least the extreme one) when that rank's per-document summary and row tags
    are at hand (``doc_summary``/``tags``: the suspect rank's, or None), else the rank a
    rule named, else at DP >= 2 the DP rank whose mean loss stands farthest from the
    others' median (log). ``event``: ``spikes.describe`` of the step's stats."""
    fired = [*event.get("rules", []), *event.get("notes", [])]
    for rule, key, side in (("doc_high", "doc_high_rank", "top"), ("doc_low", "doc_low_rank", "bottom")):
        if rule in fired and event.get(key) is not None and doc_summary and tags:
            median = doc_summary.get("median")
            docs = set()
            for i, (row, seg, s, t) in enumerate(doc_summary.get(side, [])):
                if not t or row >= len(tags) or seg >= len(tags[row].segments):
                    continue
                y = math.log(max(s / t, 1e-30)) - math.log(max(median or 1e-30, 1e-30))
                if i == 0 or (y if side == "top" else -y) > floor:
                    docs.add((tags[row].source, tags[row].segments[seg].doc))
            if docs:
                return Suspect(int(event[key]), frozenset(docs), rule)
    for rule, key in (("rank_separation", "separation_rank"), ("doc_high", "doc_high_rank"),
                      ("doc_low", "doc_low_rank")):
        if rule in fired and event.get(key) is not None and dp_loss and len(dp_loss) > 1:
            return Suspect(int(event[key]), None, rule)
    odd = [i for i, v in enumerate(dp_loss or []) if not math.isfinite(v)]
    if dp_loss and 0 < len(odd) < len(dp_loss):  # a rank's loss NaN/inf (or no tokens left): it, the masks decide
        return Suspect(odd[0], None, "rank_loss")
    if dp_loss and len(dp_loss) > 1 and all(v > 0 and math.isfinite(v) for v in dp_loss):
        logs = [math.log(v) for v in dp_loss]
        med = sorted(logs)[len(logs) // 2] if len(logs) % 2 else sum(sorted(logs)[len(logs) // 2 - 1:
                                                                                  len(logs) // 2 + 1]) / 2
        r = max(range(len(logs)), key=lambda i: abs(logs[i] - med))
        return Suspect(r, None, "rank_loss")
    return None


def control_of(suspect: Suspect, dp_size: int, tags_by_dp: dict[int, list] | None) -> Suspect | None:
    """As much other data (pure): another DP rank's whole batch for a rank suspect; for
    documents, as many other documents of the suspect's rank, those whose token counts
    in the step are closest to the suspects' (else the next DP rank's), None when there
    is nothing else to mask."""
    if suspect.docs is None:
        return Suspect((suspect.dp_rank + 1) % dp_size, None, "control") if dp_size > 1 else None
    tags_by_dp = tags_by_dp or {}
    for dp in (suspect.dp_rank, *[(suspect.dp_rank + k) % dp_size for k in range(1, dp_size)]):
        sizes = document_tokens(tags_by_dp.get(dp) or [])
        if dp == suspect.dp_rank:
            target = sorted(sizes.get(d, 0) for d in suspect.docs)
            others = {d: n for d, n in sizes.items() if d not in suspect.docs}
        else:
            target = sorted(document_tokens(tags_by_dp.get(suspect.dp_rank) or []).get(d, 0)
                            for d in suspect.docs)
            others = dict(sizes)
        if len(others) < len(target):
            continue
        picked = []
        for want in target:
            d = min(others, key=lambda k: (abs(others[k] - want), k))
            picked.append(d)
            del others[d]
        return Suspect(dp, frozenset(picked), "control")
    return None


def document_tokens(tags: list) -> dict[tuple[str, int], int]:
    """Tokens per (source, doc) over a step's rows."""
    out: dict[tuple[str, int], int] = {}
    for tag in tags:
        for seg in tag.segments:
            key = (tag.source, seg.doc)
            out[key] = out.get(key, 0) + len(seg)
    return out


def mask_labels(groups, tags: list, suspect: Suspect, ignore: int):
    """The step's microbatch groups with ``suspect``'s labels set to ``ignore`` (new
    label tensors; the inputs shared): every row for a rank suspect, the documents'
    segments otherwise. Returns (groups, [[row, segment], ...] masked)."""
    out, hits, row0 = [], [], 0
    for microbatches in groups:
        mbs = []
        for input_dict, labels in microbatches:
            labels = labels.clone()
            for r in range(labels.shape[0]):
                tag = tags[row0 + r] if row0 + r < len(tags) else None
                if suspect.docs is None:
                    labels[r] = ignore
                    hits.extend([row0 + r, i] for i in range(len(tag.segments) if tag else 1))
                    continue
                start = 0
                for i, seg in enumerate(tag.segments if tag else ()):
                    if (tag.source, seg.doc) in suspect.docs:
                        labels[r, start:start + len(seg)] = ignore
                        hits.append([row0 + r, i])
                    start += len(seg)
            row0 += labels.shape[0]
            mbs.append((input_dict, labels))
        out.append(mbs)
    return out, hits


def normal_update(detector, loss: float, grad_norm: float, held_loss: float | None = None) -> bool:
    """Whether an execution's update is normal for this run: the grad-norm rules
    (z-score with its material move, ratio, grad jump) would not fire on its loss and
    pre-clip grad norm against the history before this step, with every rule on its own
    bar (no novelty gate: the control stands in for it here) and finite. ``held_loss``
    (a masked or control execution: the first execution's loss): the loss the rules'
    loss conditions see -- masking data lowers the loss whatever it does to the update,
    and a mask is judged by its update alone."""
    from titan_ledger.components.spikes import STAT_KEYS, SpikeDetector

    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return False
    if held_loss is not None and math.isfinite(held_loss):
        loss = held_loss
    det = detector.before()
    raw = SpikeDetector(replace(detector.config, grad_novelty=0.0, notes=""), det.hist.device)
    for name in ("hist", "count", "ehist", "ecount", "jhist", "jcount"):
        setattr(raw, name, getattr(det, name))
    stats = dict(zip(STAT_KEYS, raw.step(torch.tensor(loss, dtype=torch.float64),
                                         torch.tensor(grad_norm, dtype=torch.float64)).tolist()))
    return not any(stats[r] for r in ("zscore_grad_norm", "ratio", "grad_jump", "non_finite"))


# --------------------------------------------------------------------------- the seam
class Prover:
    """Re-executes a flagged step of one ``LedgerTrainer`` (``Recovery`` asks it)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer  # (built before torchtitan's __init__: its config is read lazily)
        self.proofs = 0
        # what the gradients hold after the last proof (deferred decisions apply from them)
        self._rec = self._in_grads = None
        self._groups: dict[str, Any] = {}

    @property
    def config(self):
        return self.trainer.config.ledger.on_spike

    @property
    def mode(self) -> str:
        return self.config.prove

    def wanted(self, acting: bool, note: bool) -> bool:
        return (self.mode == "acting" and acting) or (self.mode == "all" and (acting or note))

    # ------------------------------------------------------------------ executions
    def release(self) -> None:
        """The decision is made: the proven step's record and batches (device tensors once
        executed) are not kept until the next proof."""
        self._rec = self._in_grads = None
        self._groups = {}

    def _params(self) -> list:
        return [p for m in self.trainer.model_parts for p in m.parameters()]

    def _execute(self, rec, groups):
        """The trainer's own ``execute`` on ``groups`` with fresh gradients, the per-step
        accumulators it refilled drained."""
        t = self.trainer
        for p in self._params():
            p.grad = None
        outer, t.step_record = t.step_record, rec  # the hooks see the step (a swap repeats; a bitflip is done)
        seen = t.ntokens_seen  # torchtitan counts every forward's tokens: an extra execution trains none
        counts = expert_counts(t.model_parts)
        kept = [c.clone() for c in counts]
        try:
            out = t.execute(groups, True)
        finally:
            t.step_record, t.ntokens_seen = outer, seen  # (a deferred proof runs inside the next step)
            for c, k in zip(counts, kept):
                c.copy_(k)
        t.ledger.discard_step_state()
        return out

    def _run(self, variant: str, rec, groups, first, prev: Execution | None = None) -> Execution:
        """One execution of the step on ``groups`` (:meth:`_execute`), gathered per rank;
        ``first``: the first execution's gradients (in the step) or its
        :class:`FirstExecution` (deferred), which ``equal`` is judged against; ``prev``: a
        second repeat's first repeat, compared by checksum (a fifth per-rank value)."""
        t = self.trainer
        t0 = time.perf_counter()
        params = self._params()
        loss, grad_norm, local_tokens, global_tokens = self._execute(rec, groups)
        self._in_grads = variant
        grads = [p.grad for p in params]
        psq, sums = _per_param_sq(grads, t.device), _per_param_sum(grads, t.device)
        if isinstance(first, FirstExecution):  # deferred: the first gradients are gone, their checksum is not
            equal = same_tensor(psq, first.psq) and same_tensor(sums, first.sums)
        else:
            equal = True
            for g0, g in zip(first, grads):
                if g0 is None or g is None:
                    equal = equal and (g0 is None) == (g is None)
                else:
                    equal = equal and same_tensor(_local(g0), _local(g))
        again = prev is None or (same_tensor(psq, prev.psq) and same_tensor(sums, prev.sums))
        ex = self._gathered(variant, signals.loss_sum(loss, global_tokens), psq, local_tokens, equal, grad_norm,
                            seconds=time.perf_counter() - t0, again=again)
        ex.sums = sums
        return ex

    def load_update(self, rec, applied: str) -> None:
        """After a deferred proof (or none): leave in the gradients the update ``applied``
        names (``original``/``same``: the step as it is; ``masked``/``control``: the proof's
        mask), executing the step once more when they are not already there."""
        want = {"original": "same", "same": "same", "masked": "masked", "control": "control"}.get(applied)
        if want is None or (self._rec is rec and self._in_grads == want):
            return
        groups = self._groups.get(want) if self._rec is rec else None
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if self.trainer.device.type == "cuda" else None
        self._execute(rec, groups if groups is not None else rec.batches)
        self._rec, self._in_grads = rec, want
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)
        if rec.proof is not None:
            rec.proof["update_recomputed"] = want  # its gradients were gone: executed once more to apply it

    def _distances(self, executions: list[Execution]) -> list[list[float]]:
        """Per global rank, the three executions' pairwise distances ``[d(0,1), d(0,2),
        d(1,2)]`` (:func:`local_distance`; one all-gather, a proof whose executions all
        differed only)."""
        import torch.distributed as dist

        topo = self.trainer.ledger.topo
        me = dist.get_rank() if dist.is_initialized() else 0
        a, b, c = executions
        loc = torch.tensor([local_distance(a, b, me), local_distance(a, c, me), local_distance(b, c, me)],
                           dtype=torch.float64, device=self.trainer.device)
        if topo.world == 1:
            return [loc.tolist()]
        table = torch.empty(topo.world * 3, dtype=torch.float64, device=self.trainer.device)
        dist.all_gather_into_tensor(table, loc)
        return table.view(topo.world, 3).tolist()

    def _gathered(self, variant: str, loss_sum, psq, local_tokens: int, equal: bool, grad_norm,
                  seconds: float = 0.0, again: bool = True) -> Execution:
        """One execution's per-rank ``[loss sum, grad sum of squares, tokens, equal, again]``
        (``again``: equal to the previous repeat), to every rank (one all-gather: a proven
        step only)."""
        import torch.distributed as dist

        t = self.trainer
        topo = t.ledger.topo
        f64 = {"dtype": torch.float64, "device": t.device}
        own = loss_sum.detach().double().reshape(()) if (loss_sum is not None and topo.owns_loss) else \
            torch.zeros((), **f64)
        grad_sq = psq.sum() if psq.numel() else torch.zeros((), **f64)
        loc = torch.stack([own, grad_sq, torch.tensor(float(local_tokens) if topo.owns_tokens else 0.0, **f64),
                           torch.tensor(1.0 if equal else 0.0, **f64), torch.tensor(1.0 if again else 0.0, **f64)])
        if topo.world > 1:
            table = torch.empty(topo.world * 5, **f64)
            dist.all_gather_into_tensor(table, loc)
            table = table.view(topo.world, 5)
        else:
            table = loc.view(1, 5)
        ranks = table.tolist()
        return Execution(variant, _mean_loss(ranks), float(_full(grad_norm)), ranks, seconds=seconds,
                         clip_coef=self._coef(grad_norm), psq=psq)

    def _coef(self, grad_norm) -> float:
        """torchtitan's clip factor for this norm (``clip_grads_with_norm_``)."""
        max_norm = float(self.trainer.config.training.max_norm)
        g = float(_full(grad_norm))
        return min(1.0, max_norm / (g + 1e-6)) if max_norm > 0 and math.isfinite(g) else 1.0

    # ------------------------------------------------------------------ the proof
    def prove(self, rec, *, acting: bool, event: dict[str, Any], first: FirstExecution | None = None
              ) -> dict[str, Any]:
        """Prove the flagged step ``rec`` (its first execution as ``Ledger.record`` saw
        it); in the step (``first`` None), leave in the gradients the update to apply;
        deferred (``first``: what was kept of the first execution), :meth:`load_update`
        does when an update is applied. Returns the proof record (the ``proof`` of the
        step's spike event) with ``verdict`` and ``applied``."""
        import torch.distributed as dist
        from torchtitan.components.loss import IGNORE_INDEX

        t = self.trainer
        ledger = t.ledger
        topo = ledger.topo
        start = time.perf_counter()
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if t.device.type == "cuda" else None
        params = self._params()
        if first is None:  # in the step: the first gradients, by reference (each execution gets fresh tensors)
            first_grads = [p.grad for p in params]
            loss_sum, local_tokens, grad_norm = ledger.last_execution
            psq = _per_param_sq(first_grads, t.device)
        else:
            first_grads = first
            loss_sum, local_tokens, grad_norm, psq = first.loss_sum, first.local_tokens, first.grad_norm, first.psq
        self._rec, self._in_grads, self._groups = rec, None, {"same": rec.batches}
        detector = ledger.guard.detector
        original = self._gathered("original", loss_sum, psq, local_tokens, True, grad_norm)
        original.normal = normal_update(detector, original.loss, original.grad_norm)
        rtol = float(self.config.prove_rtol)
        factor = float(self.config.prove_noise_factor)
        groups = rec.batches
        repeats = [self._run("same", rec, groups, first_grads)]
        masked = control = None
        suspect = ctrl = None
        hits: list = []
        tags_by_dp: dict[int, list] = {}
        distances = None
        if differing_ranks(original, repeats[0], rtol):
            repeats.append(self._run("same", rec, groups, first_grads, prev=repeats[0]))
            if differing_ranks(repeats[0], repeats[1], rtol) and differing_ranks(original, repeats[1], rtol):
                distances = self._distances([original, *repeats])  # not bit-reproducible: measure the noise
        if reproduced(original, repeats, rtol, distances, factor)[0]:
            tags_by_dp = _gather_tags(rec.tags if topo.data_writer else None, topo)
            summaries = _gather_by_dp(ledger.step_documents() if topo.owns_tokens else None, topo)
            fired = [*event.get("rules", []), *event.get("notes", [])]
            rank = next((event.get(k) for r, k in (("doc_high", "doc_high_rank"), ("doc_low", "doc_low_rank"))
                         if r in fired and event.get(k) is not None), None)
            suspect = name_suspect(event, ledger.last_dp_loss(),
                                   summaries.get(int(rank)) if rank is not None else None,
                                   tags_by_dp.get(int(rank)) if rank is not None else None,
                                   float(ledger.config.spike.doc_outlier_floor))
            if suspect is not None:
                ctrl = control_of(suspect, topo.dp_size, tags_by_dp)
            if suspect is not None and ctrl is not None and not original.normal:
                mine = topo.dp_rank
                c_groups = mask_labels(groups, rec.tags, ctrl, IGNORE_INDEX)[0] if ctrl.dp_rank == mine else groups
                control = self._run("control", rec, c_groups, first_grads)
                control.normal = normal_update(detector, control.loss, control.grad_norm, original.loss)
                if suspect.dp_rank == mine:
                    m_groups, hits = mask_labels(groups, rec.tags, suspect, IGNORE_INDEX)
                else:
                    m_groups = groups
                masked = self._run("masked", rec, m_groups, first_grads)
                masked.normal = normal_update(detector, masked.loss, masked.grad_norm, original.loss)
                self._groups.update(masked=m_groups, control=c_groups)
        v = judge(original, repeats, masked, control, rtol, suspect=suspect is not None,
                  distances=distances, noise_factor=factor)
        if v.applied == "control":  # the control's data convicted: its update again (no grads kept)
            again = self._run("control", rec, c_groups, first_grads)
            again.normal = normal_update(detector, again.loss, again.grad_norm, original.loss)
            repeats_after = [again]
            suspect, ctrl = ctrl, suspect
            hits = mask_labels(groups, rec.tags, suspect, IGNORE_INDEX)[1] if suspect.dp_rank == topo.dp_rank else []
        else:
            repeats_after = []
        last = (repeats_after or [masked or control or repeats[-1]])[-1].variant
        if first is None and (v.applied in ("original", "none") or (v.applied == "same" and last != "same") or
                              (v.applied == "masked" and last != "masked")):
            for p, g in zip(params, first_grads):
                p.grad = g
            self._in_grads = "original"
        elif first is not None and v.verdict == "hardware" and v.applied == "original":
            self._in_grads = None  # the last repeat may be the odd one: executed again if applied
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)
        if v.verdict == "bad_data" and suspect is not None:
            docs = suspect.docs
            if docs is None:  # the whole batch of the suspect rank: its documents
                docs = frozenset(document_tokens(tags_by_dp.get(suspect.dp_rank) or []))
            if suspect.dp_rank == ledger.topo.dp_rank:
                rec.masked.setdefault("proof", []).extend(hits)
            ledger.quarantine_proven(sorted(docs), rec.step)
            suspect = replace(suspect, docs=frozenset(docs))
        self.proofs += 1
        executions = [original, *repeats, *(e for e in (control, masked) if e is not None), *repeats_after]
        out = {"verdict": v.verdict, "applied": v.applied, "why": v.why, "acting": acting,
               "executions": [e.to_json() for e in executions],
               "seconds": round(time.perf_counter() - start, 4)}
        if v.verdict == "hardware" and not math.isfinite(original.grad_norm):
            named = v.ranks and all(not math.isfinite(original.ranks[r][1]) for r in v.ranks) and \
                len(v.ranks) < len(original.ranks)
            out["why"] += ("; the first execution's grad norm was not finite, so its clip zeroed every rank's "
                           "finite gradients: " + ("the faulty rank's were left non-finite" if named else
                                                   "the ranks it changed cannot be told apart"))
        if v.noise is not None:  # the machine's execution noise, measured by this proof
            out["noise"] = noise_record(v.noise, factor, distances)
        if v.ranks:
            out["ranks"] = v.ranks
            out["dp_ranks"] = sorted({ledger.topo.dp_rank_of[r] for r in v.ranks})
        if suspect is not None:
            out["suspect"] = {"dp_rank": suspect.dp_rank, "evidence": suspect.evidence}
            if suspect.docs is not None:
                out["documents"] = [[s, int(d)] for s, d in sorted(suspect.docs)]
        if ctrl is not None and control is not None:
            out["control"] = {"dp_rank": ctrl.dp_rank, "evidence": ctrl.evidence,
                              **({"documents": [[s, int(d)] for s, d in sorted(ctrl.docs)]} if ctrl.docs else {})}
        if dist.is_initialized():
            dist.barrier()  # every rank leaves the proof together (its collectives are done)
        return out


def _mean_loss(ranks: list[list[float]]) -> float:
    """The global mean loss from every rank's (loss sum, tokens): loss owners add their
    sums (CP pieces included), token owners their tokens (once per DP rank)."""
    tokens = sum(r[2] for r in ranks)
    return sum(r[0] for r in ranks) / tokens if tokens else float("nan")


def _per_param_sq(grads, device) -> torch.Tensor:
    """This rank's gradient sum of squares per parameter (0 for a parameter without
    gradient), as float64: one vector, so that executions compare parameter by parameter.
    One fused norm over the local pieces, accumulated in float32: a deferred decision
    computes it every step, and float64 cost 3.5x as much on the CPU (2.1 against 0.6 ms
    for the debug model's 6.2M parameters). Equal gradients give equal values; a noise
    floor is resolved down to float32's rounding, about 1e-7 relative."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=device)
    have = [_local(g) for g in grads if g is not None]
    norms = iter(torch._foreach_norm(have, 2, dtype=torch.float32) if have else ())
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([next(norms) if g is not None else zero for g in grads]).double().square()


def _per_param_sum(grads, device) -> torch.Tensor:
    """This rank's gradient sum per parameter, accumulated in float64 (with the sums of
    squares, a deferred decision's checksum of the first execution's gradients: a
    flipped sign leaves the squares alone, not the sum; float64, so that a change in a
    value's last bit is not rounded away -- 1.7 ms a step for the debug model on the CPU,
    a pass over the gradients on a GPU)."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([_local(g).sum(dtype=torch.float64) if g is not None else zero for g in grads])


def expert_counts(model_parts) -> list[torch.Tensor]:
    """MoE layers' ``tokens_per_expert_E`` buffers (torchtitan's MoE): every forward adds
    its routing counts, and the load-balancing hook turns them into the expert-bias update
    at ``optimizers.step()``, so an extra execution's counts are taken back out."""
    return [b for m in model_parts for name, b in m.named_buffers() if name.rsplit(".", 1)[-1] == "tokens_per_expert_E"]


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if hasattr(g, "to_local") else g


def _full(g) -> torch.Tensor:
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _gather_by_dp(value, topo) -> dict[int, Any]:
    """One value per DP rank (from the rank that holds it; None elsewhere), to every rank."""
    import torch.distributed as dist

    every = [value]
    if topo.world > 1:
        every = [None] * topo.world
        dist.all_gather_object(every, value)  # a flagged step only
    out: dict[int, Any] = {}
    for r, v in enumerate(every):
        if v is not None:
            out.setdefault(topo.dp_rank_of[r], v)
    return out


def _gather_tags(tags, topo) -> dict[int, list]:
    return _gather_by_dp(list(tags) if tags is not None else None, topo)
