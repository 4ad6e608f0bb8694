"""Spike rules: what each rule measures, as pure tensor functions of a step and its histories.

Design decision: a rule is a function of the step's values and of histories its caller
keeps (:class:`titan_ledger.components.detection.spikes.SpikeDetector`: the window, the
evidence rows); nothing here holds state or writes to the histories it is given. So the
detector alone owns what a checkpoint saves and what ``before`` restores (the proof at the
alarm judges a step by exactly the run's own history), and a rule's arithmetic is read in
one place, apart from the tiers that decide whether its flag acts. Every function is
on-device tensor math with no host read (it runs every step on every rank).

Rules (each can be switched off):

* z-score (OLMo-core's SkipStep rule): ``value - mean > k * std`` over the last
  ``window`` accepted steps (current step excluded), active once ``window/2``
  steps are in the window. Applied to loss and grad norm.
* ratio (the design article §2.7 / §4.5): grad norm > ``ratio`` x the window's
  median grad norm *and* loss > (1 + ``loss_jump``) x the median loss of the last
  2 x ``min_history`` accepted steps (a window-long median lags a falling loss),
  active after ``min_history`` steps (a median needs fewer steps than a std).
* a non-finite loss or grad norm is always a spike.

Evidence rules (the design article §4: bad data is two-sided, and at DP = N one
bad rank moves the global loss by 1/N -- so these look at per-rank and
per-document values, which do not shrink with N):

* rank separation (DP >= 2; no history, so active from step 1 and free of any
  trend): every document of one DP rank has a higher mean loss than every
  document of every other rank, or every one a lower loss, by more than
  ``separation`` times the ranks' own document spread (and ``separation_floor``).
  Clean ranks' document losses overlap; a batch of random text (high) or of
  repeated text (low) does not, and its documents hardly differ from each other.
  Each rank needs ``min_docs`` ranked documents. A rank whose rows are all slices of one
  document (the host counts distinct documents from the sample ids) is measured with the
  run's between-document spread, not its own (``one_doc_spread``): a long document barely
  differs from itself, and two such ranks looked "separated" on clean training.
* document outliers (any DP size): per DP rank, the highest-loss document's log
  mean loss over the rank's median segment loss (``doc_high``), and the median
  over the lowest-loss document (``doc_low``); the maximum over ranks > its own
  history's median + ``doc_outlier`` x its spread (the MAD, or (q90 - median) / 1.9
  where the MAD is degenerate), and > ``doc_outlier_floor``.
* grad jump: grad norm > ``grad_jump`` x the median of the last accepted steps
  (a skewed gradient: repeated tokens), active after ``min_history`` steps instead
  of the z-score rule's window/2.
History-based statistics are compared with their own recent history (median and
MAD of the last ``window`` steps, every step included, so a trend cannot lock
them into flagging), active after ``min_history`` steps.

Sensitive notes (issue 52: a note costs a proof, not a false action), never acting by
themselves (``NOTE_ONLY``); with ``--ledger.proof.scope all`` each is proven in step and
acts only when its proof finds a harmful cause:

* grad move: the grad norm ``grad_move`` (1.8) x its recent median or more with the loss
  unmoved (under ``loss_jump`` over its recent median) -- a finite fault's shape: a flipped
  bit moves the gradient, not its own step's loss. The grad-norm rules above see 3-4x moves.
* rank loss (DP >= 2): one DP rank's mean loss stands farther from the ranks' median (log)
  than ``rank_loss`` (8) x this statistic's own median over the window, and by at least
  ``rank_loss_floor`` (6%): a DP-4 random batch moved its rank's loss 8.13 against 7.29-7.38 on
  the others, where rank separation (documents, with its warm-up) and the global loss
  (1/4 of the move) stay silent.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

RULES = ("zscore_loss", "zscore_grad_norm", "ratio", "non_finite", "rank_separation", "doc_high",
         "doc_low", "grad_jump", "grad_move", "rank_loss")
#: rules that are notes whatever ``notes`` says: sensitive, so each costs a proof
#: (``--ledger.proof.scope all``), never a false action; a proof that finds them harmful acts
NOTE_ONLY = ("grad_move", "rank_loss")
#: the default note-only rules (measured: ``docs/benchmarks.md``, "False alarms")
DEFAULT_NOTES = "doc_high,doc_low"
#: rows of the evidence histories (``SpikeDetector.ehist``): log grad norm, doc high, doc
#: low, rank separation, between-document spread, rank-loss distance
EROWS = 6


class Window(NamedTuple):
    """The window rules over (loss, grad norm): their statistics and flags (tensors)."""

    mean: torch.Tensor  # [2] over the window's accepted steps
    std: torch.Tensor  # [2]
    median: torch.Tensor  # [2]
    n: torch.Tensor  # 0-d: values in the window
    finite: torch.Tensor  # [2] bool: the step's values are finite
    z: torch.Tensor  # [2] bool: the z-score rule fired (loss, grad norm)
    recent_loss: torch.Tensor  # 0-d: median loss of the last 2 x min_history accepted steps
    loss_up: torch.Tensor  # 0-d bool: the loss ``loss_jump`` over ``recent_loss``
    ratio: torch.Tensor  # 0-d bool: the ratio rule fired
    material: torch.Tensor  # [2] bool: a z-score move large enough to act


class Evidence(NamedTuple):
    """The evidence rules' flags and statistics, and the values for their histories."""

    fired: torch.Tensor  # [5] bool: rank_separation, doc_high, doc_low, grad_jump, rank_loss
    decisive: torch.Tensor  # 0-d bool: rank separation past its own history's upper tail
    log_jump: torch.Tensor  # 0-d: the log grad-jump ratio (NaN before ``min_history``)
    stats: torch.Tensor  # [10]: separation_y ... separation_bound (``spikes.STAT_KEYS``)
    rl_stats: torch.Tensor  # [3]: rank_loss_y, rank_loss_rank, rank_loss_median
    values: torch.Tensor  # [EROWS]: this step's value of each history (NaN: none)


def window_rules(c: Any, hist: torch.Tensor, count: torch.Tensor, arange: torch.Tensor,
                 v: torch.Tensor) -> Window:
    """The z-score and ratio rules for ``v`` = (loss, grad norm) against the window
    ``hist`` [2, window] holding ``count`` accepted steps (``arange``: 0..window-1, kept by
    the caller so no step allocates it). ``c``: ``SpikeDetector.Config`` (not imported:
    the detector's module imports this one)."""
    w = hist.shape[1]
    n = torch.clamp(count, max=w)
    valid = arange < n
    nf = n.clamp(min=1).double()
    masked = torch.where(valid, hist, torch.zeros_like(hist))
    mean = masked.sum(1) / nf
    var = (torch.where(valid, hist - mean[:, None], torch.zeros_like(hist)) ** 2).sum(1) / nf
    std = var.sqrt()
    median = torch.where(valid, hist, torch.full_like(hist, float("nan"))).nanmedian(1).values
    active = n >= (w // 2)
    finite = torch.isfinite(v)
    z = (v - mean > c.zscore * std) & active & finite if c.zscore > 0 else torch.zeros(2, dtype=torch.bool, device=v.device)
    # a median is meaningful long before a std is: the ratio rule starts after
    # min_history steps (the zoo's LR jump at step 21 spiked at 25, before window/2).
    # Its loss reference is the median of the last 2 x min_history accepted steps:
    # a window-long median lags a falling loss (the zoo's held-out LR ramp rose 15%
    # over the recent level and stayed under 1.1 x the 128-step median)
    age = (count - 1 - arange) % w
    recent = valid & (age < 2 * c.min_history)
    recent_loss = torch.where(recent, hist[0], torch.full_like(hist[0], float("nan"))).nanmedian()
    loss_up = v[0] > (1 + c.loss_jump) * recent_loss
    if c.ratio > 0:
        ratio = (n >= c.min_history) & (v[1] > c.ratio * median[1]) & loss_up
    else:
        ratio = torch.zeros((), dtype=torch.bool, device=v.device)
    # a z-score acts only on a material move (the loss loss_jump over its recent
    # median, the grad norm zscore_min_ratio x its window median): a tight history
    # makes a 1.6x grad norm 9 std (measured on a clean DP-4 run); smaller moves are notes
    material = torch.stack([loss_up, v[1] > c.zscore_min_ratio * median[1]])
    return Window(mean, std, median, n, finite, z, recent_loss, loss_up, ratio, material)


def grad_move(c: Any, log_jump: torch.Tensor, loss_up: torch.Tensor, grad_fired: torch.Tensor) -> torch.Tensor:
    """The grad-move note: the grad norm ``grad_move`` x its recent median or more
    (``log_jump``: the grad-jump rule's log ratio; NaN: no) with the loss unmoved; silent
    where a grad-norm rule fired (``grad_fired``, acting or noted): it is their lower bar."""
    # (a Python-float bound: no host-to-device copy per step)
    move = (log_jump >= math.log(c.grad_move)) & ~loss_up if c.grad_move > 0 \
        else torch.zeros((), dtype=torch.bool, device=loss_up.device)
    return move & ~grad_fired


def evidence(c: Any, ehist: torch.Tensor, ecount: torch.Tensor, arange: torch.Tensor, grad_norm: torch.Tensor,
             doc: torch.Tensor | None, dp_loss: torch.Tensor | None = None) -> Evidence:
    """The rank-separation, document, grad-jump and rank-loss rules against the evidence
    histories ``ehist`` [EROWS, window] (``ecount`` values each). ``doc``, ``dp_loss``: as
    ``SpikeDetector.step`` takes them. The caller enters ``Evidence.values`` into the
    histories (every finite one: a statistic that trends cannot lock its rule into flagging)."""
    dev = ehist.device
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=dev)
    fired = torch.zeros(5, dtype=torch.bool, device=dev)
    # history-based: log grad norm, doc high, doc low, rank separation, between-doc
    # spread, rank-loss distance
    y = torch.full((EROWS,), float("nan"), dtype=torch.float64, device=dev)
    y[0] = grad_norm.double().reshape(()).log()
    w = ehist.shape[1]
    n_h = ecount.clamp(max=w)
    valid = arange[None, :] < n_h[:, None]
    hist = torch.where(valid, ehist, nan)
    hmed = hist.nanmedian(1).values
    mad = (hist - hmed[:, None]).abs().nanmedian(1).values
    sep, sep_rank = nan, nan
    ranks = torch.full((2,), float("nan"), dtype=torch.float64, device=dev)
    if doc is not None:
        d = doc.double()
        lg = d[:, :3].log()
        med, hi, lo, n = lg[:, 0], lg[:, 1], lg[:, 2], d[:, 3].nan_to_num(nan=0.0)
        if d.shape[0] > 1 and c.separation > 0:
            # rank r above all: its lowest doc over the others' highest; below: the reverse
            eye = torch.eye(d.shape[0], dtype=torch.bool, device=dev)
            others_hi = torch.where(eye, -torch.inf, hi[None, :].expand(d.shape[0], -1)).amax(1)
            others_lo = torch.where(eye, torch.inf, lo[None, :].expand(d.shape[0], -1)).amin(1)
            gap = torch.maximum(lo - others_hi, others_lo - hi)
            # in units of the ranks' own document spread (natural text varies a lot from
            # document to document; random or repeated text hardly at all)
            own = hi - lo
            if d.shape[1] > 4:
                # ...but a rank holding ONE document (its rows slice one long document)
                # shows how much a document differs from itself: the run's between-document
                # spread stands in where it is larger (fmax: its own until one is known). So
                # the spread only grows: this never makes a separation larger
                one = d[:, 4] < 2  # NaN (not counted): several
                y[4] = torch.where(one, nan, own).nanmean()
                if c.one_doc_spread:
                    own = torch.where(one, torch.fmax(own, hmed[4]), own)
            spread = own.nanmean().clamp(min=1e-6)
            enough = (n >= c.min_docs).all()
            gap = torch.where(enough, gap.nan_to_num(nan=-torch.inf), -torch.inf)
            # DP 2: both ranks are "separated" by the same gap; the suspect is the one
            # whose documents hardly differ from each other (random or repeated text)
            own_raw = (hi - lo).nan_to_num(nan=torch.inf)
            sep_rank = (gap - 1e-9 * own_raw).argmax().double()
            sep = gap.max() / spread
            fired[0] = (sep > c.separation) & (gap.max() > c.separation_floor)
            sep = torch.where(torch.isfinite(sep), sep, nan)
            y[3] = sep
        if c.doc_outlier > 0:
            h = (hi - med).nan_to_num(nan=-torch.inf)
            l_ = (med - lo).nan_to_num(nan=-torch.inf)
            y[1], ranks[0] = h.max(), h.argmax().double()
            y[2], ranks[1] = l_.max(), l_.argmax().double()
            y[1:3] = torch.where(torch.isfinite(y[1:3]), y[1:3], nan)
    rl_rank = nan
    if dp_loss is not None and dp_loss.numel() > 1 and c.rank_loss > 0:
        # rank loss: each DP rank's log loss against the ranks' median (the mean of the
        # middle two at an even count: at DP 2 both stand half the gap off)
        lg = dp_loss.double().reshape(-1).log()
        dist_ = (lg - lg.quantile(0.5)).abs()
        y[5], rl_rank = dist_.max(), dist_.argmax().double()
        y[5] = torch.where(torch.isfinite(y[5]), y[5], nan)  # a rank without tokens: non_finite's
    active = (n_h[:4] >= c.min_history) & torch.isfinite(y[:4])
    if c.doc_outlier > 0:
        # the spread is the MAD, or where the history is degenerate (at 2 rows a rank's
        # median of two is its lower document: doc_low is 0 on most steps and its MAD
        # 0) the upper tail's (q90 - median) / 1.9, the same number for normal data
        scale = mad[1:3]
        if c.doc_tail_spread:
            q90d = hist[1:3].nanquantile(0.9, dim=1)
            scale = torch.maximum(scale, (q90d - hmed[1:3]) / 1.9)
        fired[1:3] = active[1:3] & (y[1:3] > hmed[1:3] + c.doc_outlier * scale) & (y[1:3] > c.doc_outlier_floor)
    # rank separation's own upper tail in this run (a quantile, robust to its
    # outliers); before min_history values there is no tail to be past
    q90 = hist[3].nanquantile(0.9)  # NaN while the history is empty (no host read)
    bound = hmed[3] + c.separation_gate * (q90 - hmed[3])
    decisive = active[3] & (n_h[3] >= c.separation_warmup) & (y[3] > bound) if c.separation_gate > 0 \
        else torch.ones((), dtype=torch.bool, device=dev)
    jump = (y[0] - hmed[0]).exp()
    if c.grad_jump > 0:
        fired[3] = active[0] & (jump > c.grad_jump)
    rl_active = (n_h[5] >= c.min_history) & torch.isfinite(y[5])
    if c.rank_loss > 0:
        fired[4] = rl_active & (y[5] > c.rank_loss * hmed[5]) & (y[5] > c.rank_loss_floor)
    stats = torch.stack([sep, sep_rank, y[1], y[2], hmed[1], hmed[2], ranks[0], ranks[1],
                         torch.where(active[0], jump, nan), torch.where(active[3], bound, nan)])
    rl_stats = torch.stack([y[5], torch.where(torch.isfinite(y[5]), rl_rank, nan),
                            torch.where(rl_active, hmed[5], nan)])
    log_jump = torch.where(active[0], y[0] - hmed[0], nan)
    return Evidence(fired, decisive, log_jump, stats, rl_stats, y)
