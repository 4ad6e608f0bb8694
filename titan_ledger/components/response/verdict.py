"""The proof's verdict: pure functions of the executions' numbers.

Design decision: everything the proof at the alarm *decides* lives here, apart from
what executes the step (``prover``), so that each rule is unit-tested without
processes: whether two executions agree (bit for bit, by checksum, or within a
tolerance), which execution of three stands out of the machine's noise
(:func:`odd_one_out`), the verdict (:func:`judge`: ``hardware``, ``bad_data``,
``outlier``, ``not_data``), the suspect data and its control (:func:`name_suspect`,
:func:`control_of`), the masks (:func:`mask_labels`) and whether an update is normal
for this run (:func:`normal_update`: the grad-norm rules against the run's history).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from titan_ledger.format.answers.causes import WINDOW_CAUSE
from titan_ledger.format.answers.records import REMOVED_SHARE
from titan_ledger.format.proofs import Applied, Finding


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
        if self.variant == Applied.SAME:
            out["bit_equal"] = all(r[3] == 1 for r in self.ranks)
        return out


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
            flag = y[3] if a.variant == Applied.ORIGINAL else (y[4] if len(y) > 4 else 1)
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
    verdict: str  # one of format.proofs.VERDICTS
    applied: str  # original | same | masked | control | none (no update: no two executions agreed)
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
            return Verdict(Finding.HARDWARE, Applied.SAME, faulty_ranks(original, first, changed),
                           "the first execution differed from two that agree")
        again = differing_ranks(original, second, rtol)
        if not again:
            return Verdict(Finding.HARDWARE, Applied.ORIGINAL, faulty_ranks(first, second, differing_ranks(first, second, rtol)),
                           "the second execution differed from two that agree")
        odd, floor = odd_one_out(distances, noise_factor) if distances is not None else (None, math.inf)
        if odd is not None and math.isfinite(floor):  # not bit-reproducible, but one stands out of its noise
            return _odd_verdict(odd, floor, distances, noise_factor)
        return Verdict(Finding.HARDWARE, Applied.NONE, sorted(set(changed) | set(again)), "no two of three executions agree")
    if original.normal:
        if suspect:
            return Verdict(Finding.OUTLIER, Applied.ORIGINAL, why="reproducible; the update is normal with the suspect data")
        return Verdict(Finding.NOT_DATA, Applied.ORIGINAL, why="reproducible; the update is normal and no data is suspect")
    if masked is None or control is None:
        return Verdict(Finding.NOT_DATA, Applied.ORIGINAL, why="reproducible and abnormal; no suspect data to mask "
                                                   "against a control")
    if masked.normal and not control.normal:
        return Verdict(Finding.BAD_DATA, Applied.MASKED, why="masking the suspect data brings the update back to "
                                                 "normal; masking as much other data does not")
    if control.normal and not masked.normal:
        # two disjoint masks of equal size, one restores the update: the other is its control,
        # whichever the evidence named (at DP 2 a rank's loss cannot tell which rank it is)
        return Verdict(Finding.BAD_DATA, Applied.CONTROL, why="masking the control's data brings the update back to "
                                                  "normal; masking the suspect's does not: the control's "
                                                  "data is the bad data")
    if masked.normal and control.normal:
        return Verdict(Finding.NOT_DATA, Applied.ORIGINAL, why="masking the suspect or the control data brings the "
                                                   "update back: removing data, not bad data")
    return Verdict(Finding.NOT_DATA, Applied.ORIGINAL, why="reproducible, and abnormal without the suspect data")


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
    return Verdict(Finding.HARDWARE, Applied.SAME if odd == 0 else Applied.ORIGINAL, ranks,
                   f"{who} stood {factor:g}x farther from the other two than their execution noise "
                   f"({floor:.2g} relative)")


def optimizer_verdict(amplification: float, bar: float, restore: float) -> Verdict | None:
    """``optimizer_state`` when the updates Adam's state stood for, recomputed with its
    second moment restored to its long-run level (``restore`` x), are ``amplification`` x
    smaller and that is at least ``bar`` (pure; ``optimizer_state``'s module): the state,
    not the data, made the steps abnormal, so no data is masked. None otherwise."""
    if bar <= 0 or not (amplification >= bar):
        return None
    return Verdict(Finding.OPTIMIZER_STATE, Applied.ORIGINAL,
                   why=f"Adam's second moment stood {restore:.3g}x below its long-run level: with it restored, the "
                       f"updates it stood for are {amplification:.3g}x smaller (>= --ledger.adam_check.ratio "
                       f"{bar:g}); the optimizer's state, not the data, made the update abnormal")


def stands_out(original: Execution, masked: Execution) -> tuple[float | None, float | None, float | None]:
    """How far the convicted documents' own loss stands from the rest of their step's (pure):
    ``(their mean loss, the rest's, the log ratio)`` from the first execution and the one
    with them masked -- masking labels leaves every other token's loss as it was (the same
    inputs, the same forward), so the difference of the loss sums over the difference of the
    token counts is theirs, exactly, on every rank. None where a side has no token. Recorded
    with a conviction (how the data looked to the model), not a bar for one: a cold model
    gives every document the same loss, bad or not."""
    lo, to = sum(r[0] for r in original.ranks), sum(r[2] for r in original.ranks)
    lm, tm = sum(r[0] for r in masked.ranks), sum(r[2] for r in masked.ranks)
    if to - tm <= 0 or tm <= 0:
        return None, None, None
    theirs, rest = (lo - lm) / (to - tm), lm / tm
    if not (theirs > 0 and rest > 0 and math.isfinite(theirs) and math.isfinite(rest)):
        return theirs, rest, None
    return theirs, rest, math.log(theirs / rest)

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
                      ("doc_low", "doc_low_rank"), ("rank_loss", "rank_loss_rank")):
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
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return False
    if held_loss is not None and math.isfinite(held_loss):
        loss = held_loss
    stats = _rules_at(detector, loss, grad_norm)
    return not any(stats[r] for r in ("zscore_grad_norm", "ratio", "grad_jump", "non_finite"))


def flags_as_run(detector, loss: float, grad_norm: float) -> bool:
    """Whether the run's own acting rules -- the loss's and the grad norm's, with the
    novelty gate, as they judged the run -- flag this (loss, pre-clip grad norm) against
    the history before the step, or a value is not finite: whether a window re-run
    reproduced the flag."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return True
    return bool(_rules_at(detector, loss, grad_norm, gate=True)["flag"])


def window_effect(detector, same: tuple[float, float], variant: tuple[float, float]) -> tuple[str, float | None]:
    """The window proof's one judge of a variant's flagged step (``same``: the unchanged
    re-run's (loss, grad norm); ``variant``: the fix's): ``removed`` when the run's own
    acting rules at that step -- its history and novelty gate included, as they judged the
    run -- do not flag it and at most :data:`~titan_ledger.format.answers.records.REMOVED_SHARE` of
    the flagged signal's excess over its pre-onset median is left; ``lowered`` when that
    much is gone but the rules still flag it; else ``not removed``. Returns (effect, the
    share left: the largest over the signals that stood out, None when none did). Measured
    on the memorisation plateau (issue 67): the run recorded grad norms of 0.012-0.014 as
    notes (its novelty gate), and a window without the gate judged fixes at 0.0146-0.0165
    "spiked"; an LR cut that left 79% of a grad-norm jump's excess had "removed" it."""

    loss, norm = variant
    if not (math.isfinite(loss) and math.isfinite(norm)):
        return "not removed", None
    stats = _rules_at(detector, loss, norm, gate=True)
    cfg = detector.config
    shares = []
    for i, (med, bar) in enumerate(((stats["loss_median"], 1 + cfg.loss_jump),
                                    (stats["grad_norm_median"], max(cfg.grad_move, 1.0)))):
        ref = same[i]
        if not (math.isfinite(med) and math.isfinite(ref)) or med <= 0 or ref <= bar * med:
            continue  # this signal did not stand out in the unchanged re-run
        shares.append(max(0.0, variant[i] - med) / (ref - med))
    share = max(shares) if shares else None
    flagged = bool(stats["flag"])
    if share is not None and share <= REMOVED_SHARE:
        return ("lowered" if flagged else "removed"), round(share, 6)
    if share is None and not flagged:
        return "removed", None
    return "not removed", None if share is None else round(share, 6)


def _rules_at(detector, loss: float, grad_norm: float, gate: bool = False) -> dict[str, float]:
    """Every rule's statistic for (loss, grad norm) as the step's own detector, as it stood
    before the step, would compute it: no notes, and no novelty gate unless ``gate`` (the
    window's judge: the run's own rules as they judged the run)."""
    from titan_ledger.components.detection.spikes import STAT_KEYS, SpikeDetector

    det = detector.before()
    # the update's own bars (normal_update): no novelty gate, no notes, and a grad-norm move on a
    # falling loss is abnormal too (dip_note decides whether a flag acts, not whether an update is normal)
    cfg = detector.config if gate else replace(detector.config, grad_novelty=0.0, notes="", dip_note=False)
    raw = SpikeDetector(cfg, det.hist.device)
    for name in ("hist", "count", "ehist", "ecount", "jhist", "jcount"):
        setattr(raw, name, getattr(det, name))
    return dict(zip(STAT_KEYS, raw.step(torch.tensor(loss, dtype=torch.float64),
                                        torch.tensor(grad_norm, dtype=torch.float64)).tolist()))


def mean_loss(ranks: list[list[float]]) -> float:
    """The global mean loss from every rank's (loss sum, tokens): loss owners add their
    sums (CP pieces included), token owners their tokens (once per DP rank)."""
    tokens = sum(r[2] for r in ranks)
    return sum(r[0] for r in ranks) / tokens if tokens else float("nan")


def window_verdict(same_normal: bool, removed: dict[str, bool],
                   costs: dict[str, float | None] | None = None,
                   prior: str | None = None, control: str | None = None) -> tuple[str | None, str, list[dict]]:
    """The in-process window proof's decision (pure): the window re-run from a host
    snapshot unchanged (``same_normal``: its flagged step's update came out normal) and
    once per candidate fix (``removed``: variant -> its flagged step came out normal;
    ``costs``: variant -> its loss over the window's last steps minus the unchanged
    run's, what the fix cost in learning). Nothing is proven unless the unchanged window
    reproduces the spike. Every fix that removes it is listed, the cheapest first (an
    unknown cost last); the cause is the mechanism of the cheapest, and where several
    remove it the others are said too ("LR-driven logit growth" is a true answer).
    ``prior``: the cause the step's own proof already measured (``optimizer_state``: the
    updates recomputed under a restored second moment were that much smaller): where a
    fix of that mechanism removes it as well, it names the cause -- confirmed by its own
    fix -- and the cheapest fix is still listed first. An LR cut removes almost any
    instability; it names the cause only where no fix of a measured mechanism does.
    ``control``: the effect of the window's control (every step's LR raised: no fix); where
    it removed (or lowered) the spike as well, the spike hangs on the trajectory's details
    and no fix names a cause (the fixes are still listed).
    Returns (variant of the fix that names the cause or None, why, fixes)."""
    costs = costs or {}
    fixes = sorted(({"variant": c, "cause": WINDOW_CAUSE.get(c, c), "cost": costs.get(c)}
                    for c, ok in removed.items() if ok),
                   key=lambda f: (f["cost"] is None, f["cost"] if f["cost"] is not None else 0.0, f["variant"]))
    if same_normal:
        return None, "the window re-run unchanged did not reproduce the spike: nothing to prove against", []
    if not fixes:
        return None, f"no variant ({', '.join(sorted(removed)) or 'none run'}) removed the spike from this window", []

    def cost(f):
        return "cost unknown" if f["cost"] is None else f"loss {f['cost']:+.3g} over the window's last steps"

    if control in ("removed", "lowered"):
        return None, (f"the window's control (the LR raised: no fix) {control} it as well: the spike hangs on the "
                      f"trajectory's details, and the variants that removed it ("
                      f"{', '.join(f['variant'] for f in fixes)}) prove no cause"), fixes
    best, others = fixes[0], fixes[1:]
    failed = sorted(c for c, ok in removed.items() if not ok)
    why = (f"the window re-run unchanged reproduced the spike; the {best['variant']} variant removed it "
           f"({cost(best)})")
    if others:
        why += "; also removed by " + ", ".join(f"{f['variant']} ({cost(f)})" for f in others)
    if failed:
        why += f"; not by {', '.join(failed)}"
    own = next((f for f in fixes if prior is not None and f["cause"] == prior), None)
    if own is not None and own is not best:
        why += (f"; the step's own proof measured {prior}, and its fix ({own['variant']}) removes it: "
                f"{prior} is the cause, {best['variant']} the cheapest fix")
        return own["variant"], why, fixes
    return best["variant"], why, fixes
