"""THE table of causes and of the fixes that prove them: what every part of an answer reads.

Design decision: a cause used to be declared in four tables -- its words (the answer), the
window variant whose fix proves it (the answer, the window's verdict, the rerun), the
candidate fix a cause calls for (the answer) and the rerun's variants and plan -- and the
window's default fix settings were restated beside ``[ledger.window]``. Here a cause is one
row of :data:`CAUSES` and a fix one row of :data:`FIXES`; every other table (the window
variant -> cause map, the rerun's ``CAUSE_OF`` and ``PLAN_FOR``, the window's defaults, the
candidate of a cause) is derived from them, and :func:`derive` turns a fix row into a change
to a given run. Adding a cause with its fix is a row here, its override in the window proof
(``components/response/window_proof.py``) and in the rerun (``tools/rerun/variants.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class Cause:
    """One cause of an incident: its words, the fix of its own that a candidate names, the
    rerun plan a heuristic reading of it calls for, and its words as the driver of another
    mechanism's (``LR-driven attention-logit growth``)."""

    name: str
    words: str
    candidate: str | None = None  # the fix (a :data:`FIXES` name) that is its own
    plan: tuple[str, ...] = ("same",)  # replay rerun's variants for a heuristic verdict of it
    driver: str | None = None  # its words as the driver of another mechanism
    #: the fixes an episode of it is proven by over its horizon (``diagnose RUN --rerun``):
    #: (a :data:`FIXES` name, its settings); the LR's are tried for every episode (the driver)
    horizon: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class FixKind:
    """One fix: the cause it proves, its settings with their defaults (the window record's
    keys, ``[ledger.window]``'s fields), and where it is tried: the window proof from a host
    snapshot (``window``), ``replay rerun``'s ``--variant`` (``rerun``)."""

    name: str
    cause: str
    defaults: tuple[tuple[str, float], ...] = ()
    window: bool = False
    rerun: bool = False

    def default(self, key: str) -> float:
        return dict(self.defaults)[key]


#: the causes an answer names (its first line's words), in no particular order
CAUSES: dict[str, Cause] = {c.name: c for c in (
    Cause("lr", "the learning rate", candidate="lr", plan=("same", "lr"), driver="LR-driven",
          horizon=(("lr", (("lr_factor", 0.3),)), ("lr", (("lr_factor", 0.1),)))),
    Cause("optimizer_state", "Adam's state (its second moment lagging the gradients)", candidate="eps",
          plan=("same", "beta2", "eps=1e-6"), horizon=(("eps", ()),)),
    Cause("logit_growth", "attention-logit growth", candidate="logit_cap",
          plan=("same", "fp32", "logit_cap", "qk_clip"), horizon=(("logit_cap", ()),)),
    Cause("output_logits", "output-logit drift", candidate="zloss", plan=("same", "zloss=1e-4"),
          horizon=(("zloss", ()),)),
    Cause("bad_data", "bad data", plan=("same", "quarantine", "skip")),
    Cause("hardware", "a hardware fault (the step did not reproduce)"),
    Cause("bf16", "bf16 rounding", candidate="fp32", plan=("same", "fp32")),
    Cause("divergence", "divergence", plan=("same", "quarantine", "skip")),
    Cause("transient", "a transient"),
    Cause("embedding", "the embeddings' scale"),
    Cause("clip", "the gradient clip"),
    Cause("unknown", "an unknown cause"),
)}

#: the fixes, in the rerun's priority order (the first whose variant removed a spike names its
#: cause: bad data is proven only by ``quarantine``, the documents alone masked)
FIXES: dict[str, FixKind] = {f.name: f for f in (
    FixKind("quarantine", "bad_data", rerun=True),
    FixKind("skip", "bad_data", rerun=True),
    FixKind("lr", "lr", (("lr_factor", 0.1),), window=True, rerun=True),
    FixKind("fp32", "bf16", rerun=True),
    FixKind("beta2", "optimizer_state", rerun=True),
    FixKind("adam", "optimizer_state", (("beta2", 0.95), ("eps", 1e-8)), window=True),
    FixKind("eps", "optimizer_state", (("eps_fix", 1e-6),), window=True, rerun=True),
    FixKind("logit_cap", "logit_growth", (("logit_cap", 30.0),), window=True, rerun=True),
    FixKind("qk_clip", "logit_growth", rerun=True),
    FixKind("qk_norm", "logit_growth"),
    FixKind("clip", "clip", rerun=True),
    FixKind("zloss", "output_logits", (("zloss", 1e-4),), window=True, rerun=True),
)}

#: the window proof's fixes and the cause each proves (``[ledger.window] causes``)
WINDOW_CAUSE = {f.name: f.cause for f in FIXES.values() if f.window}
#: replay rerun's counterfactuals that remove a spike -> the cause each proves (priority order)
RERUN_CAUSE = {f.name: f.cause for f in FIXES.values() if f.rerun}
#: a cause -> the fix of its own (a candidate where it is not measured)
CANDIDATE_OF = {c.name: c.candidate for c in CAUSES.values() if c.candidate}


def default(key: str) -> float:
    """A window fix's default setting by its record key (``lr_factor``, ``eps_fix``, ...): the
    ``[ledger.window]`` field of the same name defaults to it."""
    return next(dict(f.defaults)[key] for f in FIXES.values() if key in dict(f.defaults))


def words(cause: str) -> str:
    c = CAUSES.get(cause)
    return c.words if c is not None else cause


def driver_words(cause: str) -> str:
    c = CAUSES.get(cause)
    return c.driver if c is not None and c.driver else cause


# --------------------------------------------------------------------------- a fix as a change to a run
@dataclass(frozen=True, slots=True)
class Knobs:
    """The run's settings a fix changes, as the launch had them (the segment header's
    ``knobs``): the first parameter group's LR, epsilon and betas (``--optimizer.lr`` is an
    alias of it), the LR warm-up, QK-norm, QK-clip, the z-loss weight and the training
    length. A reader of a ledger without them gets None values: no fix is derived from an
    unknown setting."""

    lr: float | None = None
    eps: float | None = None
    betas: tuple[float, float] | None = None
    warmup_steps: int | None = None
    qk_norm: bool | None = None
    qk_clip: float | None = None  # the threshold when QK-clip is on, else None
    z_loss: float | None = None
    snapshots: int | None = None  # --ledger.snapshots.every (QK-clip is refused beside the window proof)
    steps: int | None = None
    dtype: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v, tuple) else v) for f in fields(self)
                if (v := getattr(self, f.name)) is not None}

    @classmethod
    def of(cls, d: dict[str, Any] | None) -> Knobs:
        d = d or {}
        betas = d.get("betas")
        return cls(**{f.name: d.get(f.name) for f in fields(cls) if f.name != "betas"},
                   betas=tuple(float(b) for b in betas) if isinstance(betas, (list, tuple)) and len(betas) == 2
                   else None)


@dataclass(frozen=True, slots=True)
class Change:
    """A change to the run: the flags that make it, in words (``--optimizer.eps 1e-6 (now
    1e-8)``), and whether it can resume from a checkpoint (QK-norm adds weights: a new model)."""

    flags: tuple[str, ...]
    words: str
    resumes: bool = True


def flag_value(v: float) -> str:
    """A flag's value as a user types it: ``1e-6``, ``0.001``, ``30``."""
    text = f"{float(v):g}"
    mant, e, exp = text.partition("e")
    return f"{mant}e{int(exp)}" if e else text


_g = flag_value


def _lr(k: Knobs, p: dict[str, Any]) -> Change | None:
    f = float(p.get("lr_factor", default("lr_factor")))
    if k.lr is None or not 0 < f < 1:
        return None
    new = float(f"{k.lr * f:.3g}")
    return Change(("--optimizer.lr", _g(new)), f"--optimizer.lr {_g(new)} (now {_g(k.lr)})")


def _eps(k: Knobs, p: dict[str, Any]) -> Change | None:
    fix = float(p.get("eps_fix", default("eps_fix")))
    if k.eps is None:
        return None
    new = fix if k.eps < fix else k.eps * 100
    return Change(("--optimizer.eps", _g(new)), f"--optimizer.eps {_g(new)} (now {_g(k.eps)})")


def _adam(k: Knobs, p: dict[str, Any]) -> Change | None:
    if k.betas is None or k.eps is None:
        return None
    b2, eps = min(k.betas[1], float(p.get("beta2", default("beta2")))), max(k.eps, float(p.get("eps", default("eps"))))
    flags, said = [], []
    if b2 < k.betas[1]:
        flags += ["--optimizer.betas", _g(k.betas[0]), _g(b2)]
        said.append(f"--optimizer.betas {_g(k.betas[0])} {_g(b2)} (now {_g(k.betas[0])} {_g(k.betas[1])})")
    if eps > k.eps:
        flags += ["--optimizer.eps", _g(eps)]
        said.append(f"--optimizer.eps {_g(eps)} (now {_g(k.eps)})")
    return Change(tuple(flags), " ".join(said)) if flags else None


def _qk_norm(k: Knobs, p: dict[str, Any]) -> Change | None:
    if k.qk_norm is False:
        return Change(("--model.qk_norm",), "--model.qk_norm (now off; a new model: from scratch)", resumes=False)
    return None


def _logit_cap(k: Knobs, p: dict[str, Any]) -> Change | None:
    # the window soft-capped the attention scores at `cap`; QK-clip bounds the same logits
    # at a threshold and resumes from a checkpoint (QK-norm is a new model: from scratch).
    # QK-clip is refused beside host snapshots (the window proof cannot replay its rescale):
    # a run with them on turns them off with it, or the command would not run as printed
    cap = float(p.get("logit_cap", default("logit_cap")))
    if k.qk_clip is None:
        off = ("--ledger.snapshots.every", "0") if k.snapshots else ()
        return Change(("--qk_clip.enable", "--qk_clip.threshold", _g(cap), *off),
                      f"--qk_clip.enable --qk_clip.threshold {_g(cap)} (now off)"
                      + (" --ledger.snapshots.every 0 (QK-clip is refused beside the window proof)" if off else ""))
    if k.qk_clip > cap:
        return Change(("--qk_clip.threshold", _g(cap)), f"--qk_clip.threshold {_g(cap)} (now {_g(k.qk_clip)})")
    return _qk_norm(k, p)


def _zloss(k: Knobs, p: dict[str, Any]) -> Change | None:
    w = float(p.get("zloss", default("zloss")))
    if k.z_loss is None:
        return None
    new = w if k.z_loss < w else k.z_loss * 10
    return Change(("--loss.z_loss_weight", _g(new)), f"--loss.z_loss_weight {_g(new)} (now {_g(k.z_loss)})")


def _fp32(k: Knobs, p: dict[str, Any]) -> Change | None:
    if k.dtype in (None, "float32"):
        return None
    return Change(("--training.dtype", "float32"), f"--training.dtype float32 (now {k.dtype})")


#: each fix's change to a run (a fix without one -- quarantine, skip, beta2, clip -- is a
#: rerun's counterfactual, or a relaunch the answer builds itself)
_DERIVE = {"lr": _lr, "eps": _eps, "adam": _adam, "logit_cap": _logit_cap, "qk_norm": _qk_norm, "zloss": _zloss,
           "fp32": _fp32}


def derive(variant: str, knobs: Knobs, params: dict[str, Any] | None = None) -> Change | None:
    """The change to this run that the window's ``variant`` measured (or a candidate's), from
    the run's settings ``knobs`` and the window's parameters ``params`` (its record's
    ``lr_factor``, ``eps_fix``, ``beta2``, ``eps``, ``logit_cap``, ``zloss``); None when the
    run already has it or the setting is unknown. Never a value the run already has."""
    fn = _DERIVE.get(variant)
    return fn(knobs, params or {}) if fn is not None else None
