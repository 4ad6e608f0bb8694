"""The answer to an incident: one record, built by one function, rendered by every view.

Design decision: a flagged step used to be explained by three judges -- the proof at the
alarm, the window proof's fixes and ``diagnose``'s tree -- and every view (the console,
``diagnose``, the incident page, the dashboards, ``export``) combined them its own way: a
user read two causes, a recommended fix that was the run's own setting and a quarantine
offered for a document the proof had cleared. Here the answer is one typed record,
:class:`Answer`, built by :func:`build` from what was recorded (the step's event, its
proof, the run's settings and launch, the checkpoints on disk); the trainer writes it
into the step's ``spikes.jsonl`` event (``answer``) when it decides, and a reader builds
it with the same function for an incident that has none (a stall no proof followed, a
ledger from before answers). Views render it and derive nothing.

* **One cause**: the mechanism a proof measured (Adam's state in step, a data or hardware
  verdict) or the window's fixes; the LR as the *driver* where its cut removed it beside a
  mechanism's own fix ("LR-driven attention-logit growth"); then, for a spike, the fix is
  whichever of the two trained better in the window (a mechanism's fix leaves the driver in
  the run; a stall's window, judged by the loss alone, keeps the mechanism's). Where
  several mechanisms' fixes each remove it, the proof does not separate them (``separates``
  False): the fixes are ranked by effect and no cause is claimed.
* **One judge**: each fix's effect is the window proof's (``removed``: the run's own acting
  rules, novelty gate included, do not flag the step and at most half of the flagged
  signal's excess over its pre-onset median is left; ``lowered``: half or less left but still
  flagged, or a stall's loss lowered; :func:`titan_ledger.components.response.verdict.window_effect`).
* **A fix is a change to this run** (:func:`derive`): from the run's recorded settings
  (:class:`Knobs`) and the variant the window measured, never a value the run already has,
  as flags the trainer's own parser takes, and as a command (:func:`fix_command`) that
  relaunches the run with it from the last checkpoint at or before the onset (or from
  scratch) into a new dump folder -- never the run's own, whose checkpoints and ledger are
  the evidence. Only the answer's fix gets a command: a fix the window measured, or the fix
  of a cause proven in step (``not measured``). A candidate -- the decision tree's reading,
  a fix another incident of the run measured -- is listed, untested, without one.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from titan_ledger.format.spellings import renamed_argv

#: a cause in words (the first of the three lines)
CAUSE_WORDS = {
    "lr": "the learning rate", "optimizer_state": "Adam's state (its second moment lagging the gradients)",
    "logit_growth": "attention-logit growth", "output_logits": "output-logit drift", "bad_data": "bad data",
    "hardware": "a hardware fault (the step did not reproduce)", "bf16": "bf16 rounding",
    "divergence": "divergence", "transient": "a transient", "embedding": "the embeddings' scale",
}
#: the driver's words before a mechanism ("LR-driven attention-logit growth")
DRIVER_WORDS = {"lr": "LR-driven"}
#: how the answer was established, in words
ESTABLISHED = {
    "in_step": "proven in step", "window": "proven by its fix in the window",
    "in_step+window": "proven in step and by its own fix in the window", "rerun": "proven by a rerun",
    "unseparated": "every mechanism's fix tried in the window removed it: the proof does not separate them",
    "rerun_evidence": "evidence from a rerun, not proof",
    "tree": "not proven: the decision tree's reading", "none": "not established",
}
#: the cause each window variant's fix proves (the variant's mechanism)
VARIANT_CAUSE = {"lr": "lr", "adam": "optimizer_state", "eps": "optimizer_state", "logit_cap": "logit_growth",
                 "zloss": "output_logits"}
#: a tree cause -> the variant whose fix is its candidate
CANDIDATE_OF = {"lr": "lr", "optimizer_state": "eps", "logit_growth": "logit_cap", "output_logits": "zloss",
                "bf16": "fp32"}
#: the share of the flagged signal's excess over its pre-onset median a fix may leave and
#: still "remove" the spike (the window judge: one stated relative rule beside the run's rules)
REMOVED_SHARE = 0.5
#: the window judge's effects, best first
EFFECTS = ("removed", "lowered", "moved", "not removed", "not measured")


def num(v: Any, digits: int = 3) -> str:
    """A number rounded for a reader (3 significant digits, thousands grouped, no 1e+03)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e6:
        r = float(f"{v:.{digits}g}")
        return f"{r:,.0f}" if abs(r) >= 1000 else f"{r:g}"
    return f"{v:.{digits - 1}e}"


def times(v: Any) -> str:
    """A ratio in words: ``4.1x``, ``53x``, ``2,080x``."""
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return f"{v}x"
    return f"{v:.2g}x" if v < 10 else f"{round(v):,}x"


# --------------------------------------------------------------------------- the run's settings
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


def _g(v: float) -> str:
    """A flag's value as a user types it: ``1e-6``, ``0.001``, ``30``."""
    text = f"{float(v):g}"
    mant, e, exp = text.partition("e")
    return f"{mant}e{int(exp)}" if e else text


def derive(variant: str, knobs: Knobs, params: dict[str, Any] | None = None) -> Change | None:
    """The change to this run that the window's ``variant`` measured (or a candidate's), from
    the run's settings ``knobs`` and the window's parameters ``params`` (its record's
    ``lr_factor``, ``eps_fix``, ``beta2``, ``eps``, ``logit_cap``, ``zloss``); None when the
    run already has it or the setting is unknown. Never a value the run already has."""
    p = params or {}
    k = knobs
    if variant == "lr":
        f = float(p.get("lr_factor", 0.1))
        if k.lr is None or not 0 < f < 1:
            return None
        new = float(f"{k.lr * f:.3g}")
        return Change(("--optimizer.lr", _g(new)), f"--optimizer.lr {_g(new)} (now {_g(k.lr)})")
    if variant == "eps":
        fix = float(p.get("eps_fix", 1e-6))
        if k.eps is None:
            return None
        new = fix if k.eps < fix else k.eps * 100
        return Change(("--optimizer.eps", _g(new)), f"--optimizer.eps {_g(new)} (now {_g(k.eps)})")
    if variant == "adam":
        if k.betas is None or k.eps is None:
            return None
        b2, eps = min(k.betas[1], float(p.get("beta2", 0.95))), max(k.eps, float(p.get("eps", 1e-8)))
        flags, words = [], []
        if b2 < k.betas[1]:
            flags += ["--optimizer.betas", _g(k.betas[0]), _g(b2)]
            words.append(f"--optimizer.betas {_g(k.betas[0])} {_g(b2)} (now {_g(k.betas[0])} {_g(k.betas[1])})")
        if eps > k.eps:
            flags += ["--optimizer.eps", _g(eps)]
            words.append(f"--optimizer.eps {_g(eps)} (now {_g(k.eps)})")
        return Change(tuple(flags), " ".join(words)) if flags else None
    if variant == "logit_cap":
        # the window soft-capped the attention scores at `cap`; QK-clip bounds the same logits
        # at a threshold and resumes from a checkpoint (QK-norm is a new model: from scratch).
        # QK-clip is refused beside host snapshots (the window proof cannot replay its rescale):
        # a run with them on turns them off with it, or the command would not run as printed
        cap = float(p.get("logit_cap", 30.0))
        if k.qk_clip is None:
            off = ("--ledger.snapshots.every", "0") if k.snapshots else ()
            return Change(("--qk_clip.enable", "--qk_clip.threshold", _g(cap), *off),
                          f"--qk_clip.enable --qk_clip.threshold {_g(cap)} (now off)"
                          + (" --ledger.snapshots.every 0 (QK-clip is refused beside the window proof)" if off else ""))
        if k.qk_clip > cap:
            return Change(("--qk_clip.threshold", _g(cap)), f"--qk_clip.threshold {_g(cap)} (now {_g(k.qk_clip)})")
        if k.qk_norm is False:
            return Change(("--model.qk_norm",), "--model.qk_norm (now off; a new model: from scratch)", resumes=False)
        return None
    if variant == "qk_norm":
        if k.qk_norm is False:
            return Change(("--model.qk_norm",), "--model.qk_norm (now off; a new model: from scratch)", resumes=False)
        return None
    if variant == "zloss":
        w = float(p.get("zloss", 1e-4))
        if k.z_loss is None:
            return None
        new = w if k.z_loss < w else k.z_loss * 10
        return Change(("--loss.z_loss_weight", _g(new)), f"--loss.z_loss_weight {_g(new)} (now {_g(k.z_loss)})")
    if variant == "fp32":
        if k.dtype in (None, "float32"):
            return None
        return Change(("--training.dtype", "float32"), f"--training.dtype float32 (now {k.dtype})")
    return None


# --------------------------------------------------------------------------- the record
@dataclass(frozen=True, slots=True)
class Fix:
    """One fix tried by the window proof (or a candidate, ``effect`` ``not measured``)."""

    variant: str  # the window's variant (lr, adam, eps, logit_cap, zloss) or a candidate's
    cause: str  # the mechanism its fix proves
    flags: tuple[str, ...]  # the training flags (empty: no change to this run can make it)
    change: str  # the change in words, ``--optimizer.eps 1e-6 (now 1e-8)``
    effect: str  # :data:`EFFECTS`
    detail: str = ""  # the measured numbers, rounded
    share: float | None = None  # the flagged signal's excess left (0: all gone; 1: unchanged)
    cost: float | None = None  # the loss over the window's last steps against the unchanged re-run
    resumes: bool = True

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def of(cls, d: dict[str, Any]) -> Fix:
        return cls(**{f.name: (tuple(d.get(f.name) or ()) if f.name == "flags" else d.get(f.name))
                      for f in fields(cls) if f.name in d})


@dataclass(frozen=True, slots=True)
class Answer:
    """The answer to one incident (an acting flag, a note its proof promoted, a stall)."""

    step: int
    kind: str  # spike | stall
    title: str  # "loss spike", "grad-norm jump (the loss fell)", "stall", ...
    cause: str  # one name ("" when not established or not separated)
    driver: str | None  # the LR where its cut removed it beside the mechanism's own fix
    established: str  # an :data:`ESTABLISHED` key
    how: str  # how, with its numbers
    not_proven: str | None  # why no proof (or no window proof) established it
    separates: bool | None  # the window's fixes separate the causes (None: no window judged it)
    fixes: tuple[Fix, ...]  # every fix tried, best effect first
    fix: Fix | None  # the recommended fix: measured, or (``not measured``) the fix of a cause proven in step
    candidates: tuple[Fix, ...]  # untested, no command: the tree's readings, a fix another incident measured
    start: str | None  # where the command starts: "checkpoint step-K" | "scratch"
    command: str | None  # the relaunch with the fix, as printed
    new_dump: str | None  # the command's dump folder (new; never the run's own)
    did: str  # what the run did
    acting: str | None  # what acting would have done (observe), or None
    documents: tuple[str, ...] = ()  # convicted documents (bad data)
    quarantine: bool = False  # a quarantine is offered (bad data convicted, not quarantined)
    window_from: int | None = None  # the window proof's snapshot step
    onset: int | None = None  # the step the fix's relaunch must start at or before
    loss: float | None = None
    grad_norm: float | None = None
    version: int = 1

    # ---------------------------------------------------------------- words
    @property
    def cause_text(self) -> str:
        if not self.cause:
            return (ESTABLISHED["unseparated"] if self.established == "unseparated" else "cause not established")
        words = CAUSE_WORDS.get(self.cause, self.cause)
        if self.driver and self.driver != self.cause:
            return f"{DRIVER_WORDS.get(self.driver, self.driver)} {words}"
        return words

    def lines(self) -> list[str]:
        """The answer in three short lines: what and why, the fix, what was done."""
        head = f"{self.title} at step {self.step}: {self.cause_text}" + (
            "" if self.established in ("none", "unseparated") else f" -- {ESTABLISHED[self.established]}")
        if self.fix is not None:
            why = "; ".join(x for x in (self.fix.detail, self.not_proven if self.fix.effect == "not measured"
                                        else None) if x)
            fix = f"fix: {self.fix.change}: {self.fix.effect}" + (f" ({why})" if why else "")
        elif self.candidates:
            fix = ("fix: none measured" + (f" ({self.not_proven})" if self.not_proven else "")
                   + "; candidate (untested): " + "; ".join(c.change for c in self.candidates[:3]))
        elif self.quarantine:
            fix = f"fix: quarantine the convicted document(s) {', '.join(self.documents[:4])} (the command below)"
        elif self.cause == "bad_data" and not self.documents:
            fix = ("fix: the data of this step, documents not yet named (replay rerun --variant quarantine names "
                   "them; a rollback that skips the step avoids it)")
        elif self.cause == "bad_data":
            fix = "fix: the convicted data was quarantined by the trainer"
        elif self.cause == "hardware":
            fix = "fix: none in the configuration: a fault, not a setting (if it recurs on the ranks named, replace them)"
        elif self.established == "in_step" and not self.cause:
            fix = "fix: none needed (the update was normal with the data that stood out)"
        else:
            fix = "fix: none measured" + (f" ({self.not_proven})" if self.not_proven else "")
        done = f"done: {self.did}" + (f"; acting would have {self.acting}" if self.acting else "")
        return [head, f"  {fix}", f"  {done}"]

    def detail(self) -> list[str]:
        """What follows the three lines: how, every fix tried, the command, why not proven."""
        out = [f"  how: {self.how}"] if self.how else []
        if self.not_proven and self.not_proven not in self.lines()[1]:  # (said on the fix line already)
            out.append(f"  not proven: {self.not_proven}")
        if self.fixes:
            where = f" (the window from step {self.window_from})" if self.window_from is not None else ""
            out.append(f"  fixes tried{where}, best first: " + "; ".join(
                f"{f.change or f.variant} {f.effect}" + (f" ({f.detail})" if f.detail else "") for f in self.fixes))
        if self.separates is False:
            out.append("  the window alone does not separate the causes: more than one mechanism's fix removed it "
                       "(ranked above by effect)" + ("; the in-step measurement names the cause"
                                                     if self.established == "in_step+window" else ""))
        if self.command:
            out.append(f"  run it ({self.start}, into a new folder): {self.command}")
        elif self.fix is not None and self.fix.flags:
            out.append("  no command: the run records no launch (train with python -m titan_ledger.train)")
        elif self.candidates:
            out.append("  no command: a candidate is untested for this incident (diagnose --rerun proves a cause "
                       "from a checkpoint)")
        return out

    def headline(self) -> str:
        """One line (a W&B alert's title, a table cell)."""
        return f"{self.title} at step {self.step}: {self.cause_text}"

    # ---------------------------------------------------------------- record
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Fix):
                v = v.to_json()
            elif isinstance(v, tuple):
                v = [x.to_json() if isinstance(x, Fix) else x for x in v]
            out[f.name] = v
        out["cause_text"] = self.cause_text  # (derived; readers of the JSON alone want the words)
        return out

    @classmethod
    def of(cls, d: dict[str, Any]) -> Answer:
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name in ("fixes", "candidates"):
                v = tuple(Fix.of(x) for x in v or ())
            elif f.name == "fix":
                v = Fix.of(v) if v else None
            elif f.name == "documents":
                v = tuple(v or ())
            kw[f.name] = v
        return cls(**kw)

    def columns(self) -> dict[str, Any]:
        """The answer flattened (``export``'s ``answer_*`` columns, the dashboards' texts)."""
        return {"answer_title": self.title, "answer_cause": self.cause or None, "answer_driver": self.driver,
                "answer_cause_text": self.cause_text, "answer_established": self.established,
                "answer_separates": self.separates, "answer_fix": self.fix.change if self.fix else None,
                "answer_fix_effect": self.fix.effect if self.fix else None,
                "answer_fix_flags": list(self.fix.flags) if self.fix else None,
                "answer_candidates": [c.change for c in self.candidates],
                "answer_command": self.command, "answer_start": self.start, "answer_not_proven": self.not_proven,
                "answer_did": self.did, "answer_acting": self.acting}


# --------------------------------------------------------------------------- the run's context
@dataclass(frozen=True, slots=True)
class Context:
    """What the answer needs of the run beyond the step: its settings, its launch (the
    segment header's ``argv``, ``cwd``, ``python`` and world size), its dump folder and the
    complete checkpoints on disk, and the policy (``--ledger.response.policy``)."""

    knobs: Knobs = field(default_factory=Knobs)
    dump: str = ""
    argv: tuple[str, ...] | None = None
    cwd: str = ""
    python: str = "python"
    world_size: int = 1
    checkpoints: tuple[int, ...] = ()
    checkpoint_folder: str = "checkpoint"
    policy: str | None = None
    loss_jump: float = 0.05  # the rules' material loss move (a dip is under the median by more)


def title_of(kind: str, event: dict[str, Any] | None, ctx: Context) -> str:
    """What the incident was, from the rules that fired and the loss's direction: a flag on
    a falling loss is a grad-norm jump, not a loss spike."""
    ev = event or {}
    if kind == "stall":
        st = ev.get("stall") or {}
        return "loss climbing back (stall rule)" if st.get("kind") == "diverging" else "stall"
    rules = set(ev.get("rules") or ())
    # the rules' own reference: the recent median (``loss_recent``; older events: the window's)
    loss, med = ev.get("loss"), ev.get("loss_recent", ev.get("loss_median"))
    if "non_finite" in rules or (isinstance(loss, float) and not math.isfinite(loss)):
        return "non-finite loss or grad norm"
    up = isinstance(loss, (int, float)) and isinstance(med, (int, float)) and loss > (1 + ctx.loss_jump) * med
    down = isinstance(loss, (int, float)) and isinstance(med, (int, float)) and loss < (1 - ctx.loss_jump) * med
    grad = rules & {"zscore_grad_norm", "ratio", "grad_jump", "grad_move"}
    if ev.get("promoted_by_proof"):
        return "a note its proof convicted"
    if up or "zscore_loss" in rules:
        return "loss spike"
    if grad:
        return "grad-norm jump" + (" (the loss fell)" if down else " (the loss unmoved)")
    if rules & {"rank_separation", "doc_high", "doc_low", "rank_loss"}:
        return "data outlier"
    return "flagged step"


def _signal_detail(r: dict[str, Any], same: dict[str, Any] | None) -> str:
    if same is None:
        return ""
    if r.get("moved_to") is not None:
        return f"an earlier step of the window, {r['moved_to']}, flagged instead"
    return f"grad norm {num(same.get('grad_norm'))} -> {num(r.get('grad_norm'))}, loss {num(same.get('loss'))} -> " \
           f"{num(r.get('loss'))}"


def window_fixes(window: dict[str, Any], knobs: Knobs) -> tuple[list[Fix], dict[str, Any] | None]:
    """Every fix the window tried, with its effect under the window's one judge, best first
    (removed before lowered before not removed; then the loss over the window's last steps,
    lowest first -- a fix stays in the run for the rest of it, so of two that each remove the
    spike the one that trained better is the one to keep; then the excess left)."""
    runs = window.get("runs") or []
    same = next((r for r in runs if r.get("variant") == "same"), None)
    stall = bool(window.get("stall"))
    out = []
    for r in runs:
        v = r.get("variant")
        if v in ("same", "control"):
            continue
        effect = r.get("effect")
        if effect is None:  # a record from before the one judge: its "normal" (a stall: the fixes list)
            fixed = {f["variant"] for f in window.get("fixes") or []}
            effect = ("lowered" if v in fixed else "not removed") if stall else \
                ("removed" if r.get("normal") else "not removed")
        ch = derive(v, knobs, window)
        none = (f"{v} (this ledger records none of the run's settings: it is from before the answers)"
                if knobs == Knobs() else f"{v} (no change to this run's settings makes it)")
        detail = (f"the window's last losses {num(r.get('cost'), 2)} against the unchanged re-run"
                  if stall and r.get("cost") is not None else _signal_detail(r, same))
        if not stall and r.get("cost") is not None:
            detail += f"; learning cost {num(r['cost'], 2)}"
        out.append(Fix(v, VARIANT_CAUSE.get(v, v), ch.flags if ch else (), ch.words if ch else none, effect, detail,
                       r.get("share"), r.get("cost"), ch.resumes if ch else True))
    order = {e: i for i, e in enumerate(EFFECTS)}
    out.sort(key=lambda f: (order.get(f.effect, 9), f.cost if f.cost is not None else 0.0,
                            f.share if f.share is not None else 1.0, f.variant))
    return out, same


def _did(proof: dict[str, Any] | None, event: dict[str, Any] | None) -> tuple[str, str | None]:
    """What the run did about the step, and what acting would have done (held back: the
    policy ``observe`` or a bound)."""
    ev = event or {}
    action = ev.get("action")
    configured = (f"; then the configured action ({action})" if action not in (None, "none")
                  and not str(action).startswith("proof") else "")
    if proof is None:
        return (f"the configured action ({action})" if action not in (None, "none") else
                "nothing (the update was applied)"), None
    applied, wants, held = proof.get("applied"), proof.get("would_apply"), proof.get("held_back")
    # a deferred decision (the next step's data was the control): when, so a reader knows the update waited
    late = f" (decided at step {proof['decided_at']}, the update held until then)" if "decided_at" in proof else ""
    words = {"same": "applied the recomputed update", "original": "applied the first update",
             "none": "applied no update", "masked": "trained without the convicted data and quarantined it",
             "control": "trained without the convicted data and quarantined it"}
    if held is not None and wants:
        why = {"observe": "--ledger.response.policy observe", "quarantine_bound": "the quarantine bound",
               "breaker": "the circuit breaker", "fragile": "a fragile run",
               "novelty": "no control of the same novelty (decided in the step)"}.get(held, held)
        return f"nothing (the update was applied{late}; held back by {why})" + configured, words.get(wants, str(wants))
    if applied in (None, "original"):
        return f"nothing (the update was applied{late})" + configured, None
    return words.get(applied, str(applied)) + late, None


def _start(ctx: Context, onset: int | None, resumes: bool) -> tuple[int | None, str]:
    """The checkpoint a fix's relaunch starts from: the last complete one at or before the
    onset; None (scratch) when there is none or the change is a new model."""
    if not resumes or onset is None:
        return None, "scratch" + ("" if resumes else " (the change is a new model)")
    before = [c for c in ctx.checkpoints if 0 < c <= onset]
    if not before:
        return None, f"scratch (no checkpoint at or before the onset, step {onset})"
    return before[-1], f"checkpoint step-{before[-1]}"


def new_dump_folder(dump: str, step: int, variant: str, exists=None) -> str:
    """A dump folder beside the run's for a fix's relaunch, that does not exist yet."""
    exists = exists or (lambda p: Path(p).exists())
    base = f"{str(dump).rstrip('/')}-fix{step}-{variant}"
    path, n = base, 2
    while exists(path):
        path, n = f"{base}-{n}", n + 1
    return path


#: flags of the recorded launch a fix's relaunch sets itself
_OWN_FLAGS = ("--job.dump_folder", "--dump_folder", "--checkpoint.load_step", "--checkpoint.initial_load_path",
              "--checkpoint.initial_load_model_only", "--checkpoint.no_initial_load_model_only")


def _strip(argv: tuple[str, ...]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        key, eq, _ = str(argv[i]).partition("=")
        if key in _OWN_FLAGS:
            takes = key not in ("--checkpoint.initial_load_model_only", "--checkpoint.no_initial_load_model_only")
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            i += 1 if (eq or not takes or (nxt is not None and str(nxt).startswith("--"))) else 2
            continue
        out.append(str(argv[i]))
        i += 1
    return out


def fix_command(ctx: Context, flags: tuple[str, ...], start: int | None, new_dump: str) -> str | None:
    """The relaunch of this run with ``flags`` from checkpoint ``start`` (None: from scratch)
    into ``new_dump``, from the run's working directory with its interpreter: its own
    training flags (less its dump folder and checkpoint position), the checkpoint loaded
    whole (model, optimizer, data position, step: ``--checkpoint.initial_load_path`` with
    ``initial_load_model_only`` off) and the fix's flags last (the last spelling wins)."""
    if ctx.argv is None:
        return None
    args = renamed_argv(_strip(ctx.argv))  # an old run recorded old spellings: today's, so it runs as printed
    if start is not None:
        ck = Path(ctx.dump) / ctx.checkpoint_folder / f"step-{start}"
        args += ["--checkpoint.enable", "--checkpoint.initial_load_path", str(ck.absolute() if not ck.is_absolute()
                                                                             else ck),
                 "--checkpoint.no_initial_load_model_only"]
    args += ["--job.dump_folder", new_dump, *flags]
    cmd = [ctx.python or "python", "-m", "titan_ledger.launch", "--nproc", str(ctx.world_size), "--", *args]
    return (f"cd {shlex.quote(ctx.cwd)} && " if ctx.cwd else "") + shlex.join(cmd)


# --------------------------------------------------------------------------- the one builder
def build(step: int, kind: str, event: dict[str, Any] | None, proof: dict[str, Any] | None, ctx: Context,
          *, unproven: str | None = None, tree: dict[str, Any] | None = None,
          earlier: tuple[int, Fix] | None = None, exists=None) -> Answer:
    """THE answer to the incident at ``step`` (``kind`` ``spike`` or ``stall``): ``event`` is
    its ``spikes.jsonl`` event (the flag's rules and statistics, or the stall's), ``proof``
    the proof at the alarm (None: not proven; ``unproven`` says why), ``tree`` the decision
    tree's reading (``cause`` and ``certainty``: candidates only, never the answer's cause),
    ``earlier`` the fix an earlier incident of this run measured (``(step, fix)``: a
    candidate where none is measured here -- the window-proof budget is spent after two)."""
    ev = event or {}
    title = title_of(kind, ev, ctx)
    cause, driver, established, how = "", None, "none", ""
    not_proven = unproven
    separates: bool | None = None
    fixes: list[Fix] = []
    fix: Fix | None = None
    candidates: list[Fix] = []
    documents: tuple[str, ...] = ()
    quarantine = False
    window = (proof or {}).get("window") or {}
    window_from = window.get("from_step")
    onset = step - 1
    if proof is None:
        if not not_proven:
            not_proven = ("the stall rule's window proof needs host snapshots (--ledger.snapshots.every)"
                          if kind == "stall" else "no proof ran (--ledger.proof.scope off, or a run "
                          "without the response)")
        if kind == "stall":
            onset = int((ev.get("stall") or {}).get("since") or step)
            if (ev.get("stall") or {}).get("kind") == "stalled":  # the rule's own evidence (the logits), not the tree's
                tree = {"cause": "logit_growth", "certainty": "the stall rule's evidence: the max logit past its bar"}
    else:
        v = "not_data" if kind == "stall" else proof.get("verdict")  # a stall: the window alone answers
        if v == "hardware":
            cause, established = "hardware", "in_step"
            ranks = ", ".join(map(str, proof.get("dp_ranks") or []))
            how = f"the step executed again on the same data and state differed (DP rank(s) {ranks})"
        elif v == "bad_data":
            cause, established = "bad_data", "in_step"
            documents = tuple(f"{s}:{d}" for s, d in proof.get("documents") or [])
            how = "masking the convicted data brought the update back to normal; masking as much other data did not"
            quarantine = proof.get("applied") not in ("masked", "control")
            if quarantine and documents and ctx.dump:  # held back (observe, a bound): the quarantine, as a relaunch
                qfile = new_dump_folder(ctx.dump, step, "quarantine", exists) + ".jsonl"
                shown = ", ".join(documents[:4]) + (" ..." if len(documents) > 4 else "")
                fix = Fix("quarantine", "bad_data", ("--ledger.filter.quarantine", qfile),
                          f"--ledger.filter.quarantine {qfile} (the convicted document(s) {shown})", "removed",
                          "in step: the update normal with them masked, not with as much other data masked")
        elif v == "optimizer_state":
            cause, established = "optimizer_state", "in_step"
            opt = proof.get("optimizer") or {}
            how = (f"Adam's second moment stood {times(opt.get('restore'))} below its long-run level: with it "
                   f"restored the update is {times(opt.get('amplification'))} smaller"
                   if opt.get("amplification") else proof.get("why", ""))
        elif v == "outlier":
            established = "in_step"
            how = "the suspect data stood out and the update was normal with it: nothing to fix"
        elif kind == "stall":
            how = "the stall rule flagged the loss's trend"
        else:  # not_data: reproducible, not the suspect's data; the window decides which cause
            how = "in step: reproducible (not hardware) and not the suspect's data"
        if window.get("from_step") is not None:
            fixes, same = window_fixes(window, ctx.knobs)
            good = [f for f in fixes if f.effect in ("removed", "lowered")]
            mechanisms = {f.cause for f in good} - {"lr"}
            control = next((r for r in window.get("runs") or [] if r.get("variant") == "control"), None)
            if same is not None and same.get("normal") and not window.get("stall"):
                not_proven = (f"the window re-run from step {window_from} did not reproduce the spike: nothing to "
                              f"prove against")
            elif good and control is not None and control.get("effect") in ("removed", "lowered"):
                separates = False
                not_proven = (f"the window's control (every step's LR x {num(window.get('control'))}, no fix) "
                              f"{control['effect']} it as well: the spike hangs on the trajectory's details, and the "
                              f"fixes that removed it in the window from step {window_from} prove nothing")
            elif not good:
                not_proven = (f"no fix tried in the window from step {window_from} removed it"
                              + (" (the mechanism's own fix included)" if cause == "optimizer_state" else ""))
            else:
                separates = len(mechanisms) <= 1
                own = next((f for f in good if f.cause == cause), None) if cause else None
                if cause in ("bad_data", "hardware"):  # the data convicted; a fix as well: a fragile model
                    how += (f"; with the data unmasked, {good[0].change or good[0].variant} removed it in the window as "
                            f"well: the data triggered it in a model its configuration made fragile")
                elif cause:  # a mechanism measured in step: its own fix confirms it; the LR may drive it
                    if own is not None:
                        established, fix = "in_step+window", own
                        if separates and any(f.cause == "lr" for f in good) and cause != "lr":
                            driver = "lr"
                    else:
                        fix = good[0]
                        driver = "lr" if fix.cause == "lr" else None
                        how += (f"; its own fix did not remove it in the window, {fix.change or fix.variant} did"
                                if fix.cause != cause else "")
                        established = "in_step"
                        separates = None if len(mechanisms) <= 1 else separates
                elif separates:
                    established = "window"
                    mech = next(iter(mechanisms), "lr")
                    cause = mech
                    fix = next((f for f in good if f.cause == mech), good[0])
                    cut = next((f for f in good if f.cause == "lr"), None)
                    if mech != "lr" and cut is not None:
                        driver = "lr"
                        # the LR drives a spike: of the driver's cut and the mechanism's own fix, the
                        # one ranked first (the better effect, then the lower loss at the window's
                        # end). The mechanism's fix alone leaves the driver in the run: at
                        # logit_stall_lr02 seed 1, eps 1e-6 removed step 25 in the window and over
                        # 1,000 steps the run flagged 26 steps against 14 and ended higher. Not for a
                        # stall: its window is judged by the loss alone, which any LR cut lowers at
                        # once (the annealing drop) whatever drives the stall -- the same run's stall
                        # at step 350, given the cut (its window 0.11 lower against the logit cap's
                        # 0.08), ended 0.8% lower over the horizon, the logit cap 9.8%
                        # (docs/benchmarks.md, issue 67)
                        if not window.get("stall") and good.index(cut) < good.index(fix):
                            how += (f"; the driver's cut is the fix: it removed it as well and trained better "
                                    f"in the window (loss {num(cut.cost, 2)} against {num(fix.cost, 2)} for "
                                    f"{fix.change or fix.variant})")
                            fix = cut
                else:  # several mechanisms' fixes each remove it: no cause claimed, the best fix first
                    established, fix = "unseparated", good[0]
                how += ("; " if how else "") + (
                    f"the window re-run from step {window_from} ({window.get('steps')} steps) reproduced it"
                    + (" and stalled as the run did" if window.get("stall") else ""))
        elif window.get("cause") is None and window.get("why") and v in ("not_data", "optimizer_state", "bad_data"):
            not_proven = f"no window proof: {window['why']}"
            if window.get("error"):
                not_proven += f" (failed: {window['error']})"
        elif v in ("not_data", "optimizer_state") and not window:
            not_proven = "no window proof ran"
        if window_from is not None and cause not in ("bad_data", "hardware"):
            onset = window_from  # the fix was measured from there: its relaunch starts at or before it
    # a cause proven in step with no fix measured here: its own fix is the answer's (not
    # measured), unless the window tried it and it did not remove the spike (then a candidate)
    if fix is None and cause in CANDIDATE_OF:
        ch = derive(CANDIDATE_OF[cause], ctx.knobs)
        if ch is not None:
            tried = next((f for f in fixes if f.flags == ch.flags), None)
            own = Fix(CANDIDATE_OF[cause], cause, ch.flags, ch.words, "not measured",
                      "the fix of the cause proven in step" + (" (tried in the window, which did not discriminate)"
                                                               if tried else ""), resumes=ch.resumes)
            if established.startswith("in_step") and (tried is None or tried.effect in ("removed", "lowered")):
                fix = own
            else:
                candidates.append(replace(own, detail=f"the mechanism's own fix (tried in the window: "
                                                      f"{tried.effect})" if tried else "the mechanism's own fix"))
    if fix is None and cause in ("", "optimizer_state"):
        candidates += tree_candidates(tree, ctx, candidates)
    if fix is None and earlier is not None and cause not in ("bad_data", "hardware"):
        at, was = earlier
        if was.flags and not any(c.flags == was.flags for c in candidates):
            candidates.append(replace(was, effect="not measured",
                                      detail=f"measured at step {at} of this run ({was.effect} there)"))
    # the command applies the answer's fix only: a candidate (the tree's reading, a fix another
    # incident measured) is untested here -- measured at 304c3a5, 50 of 75 such relaunches helped
    start, command, new_dump = _command(step, fix, onset, ctx, exists)
    did, acting = _did(proof, ev)
    return Answer(step=step, kind=kind, title=title, cause=cause, driver=driver, established=established, how=how,
                  not_proven=not_proven, separates=separates, fixes=tuple(fixes), fix=fix,
                  candidates=tuple(candidates), start=start, command=command, new_dump=new_dump, did=did,
                  acting=acting, documents=documents, quarantine=quarantine, window_from=window_from,
                  onset=onset, loss=ev.get("loss"), grad_norm=ev.get("grad_norm"))


def tree_candidates(tree: dict[str, Any] | None, ctx: Context, known: list[Fix] | tuple[Fix, ...] = ()) -> list[Fix]:
    """The decision tree's reading as a candidate fix (never the answer's cause): the change
    its cause calls for, when this run does not have it already."""
    if not tree or tree.get("cause") not in CANDIDATE_OF:
        return []
    ch = derive(CANDIDATE_OF[tree["cause"]], ctx.knobs)
    if ch is None or any(c.flags == ch.flags for c in known):
        return []
    return [Fix(CANDIDATE_OF[tree["cause"]], tree["cause"], ch.flags, ch.words, "not measured",
                f"the decision tree's reading ({tree['cause']}, {tree.get('certainty', 'guess')})", resumes=ch.resumes)]


def with_tree(answer: Answer, tree: dict[str, Any] | None, ctx: Context) -> Answer:
    """A recorded answer without a fix, with the decision tree's candidate added: the tree's
    reading is a candidate (no command), never the answer's cause."""
    if answer.fix is not None or answer.cause in ("hardware", "bad_data"):
        return answer
    extra = tree_candidates(tree, ctx, answer.candidates)
    if not extra:
        return answer
    return replace(answer, candidates=(*answer.candidates, *extra))


def _command(step: int, chosen: Fix | None, onset: int | None, ctx: Context,
             exists=None) -> tuple[str | None, str | None, str | None]:
    """(start, command, new dump folder) of the relaunch that applies ``chosen``."""
    if chosen is None or not chosen.flags or not ctx.dump:
        return None, None, None
    ck, start = _start(ctx, onset, chosen.resumes)
    new_dump = new_dump_folder(ctx.dump, step, chosen.variant, exists)
    command = fix_command(ctx, chosen.flags, ck, new_dump)
    if command and chosen.variant == "quarantine":  # the file the flag names: the convicted documents, written first
        write = shlex.join([ctx.python or "python", "-m", "titan_ledger.diagnose", str(ctx.dump), "--step", str(step),
                            "--write-quarantine", chosen.flags[1]])
        head, sep, launch = command.partition(" && ") if ctx.cwd else ("", "", command)
        command = f"{head}{sep}{write} && {launch}"
    return start, command, new_dump


def with_rerun(answer: Answer, cause: str, rule: str, proven: bool, ctx: Context, exists=None) -> Answer:
    """An answer no proof at the alarm established, with what a rerun from a checkpoint
    (``replay rerun``, ``diagnose --rerun``) showed: its cause (``proven``, or evidence: a
    skip that removed it shows "something in this step's data"): a proven cause's own fix is
    the answer's (not measured, with its command), evidence's a candidate."""
    if answer.cause:
        return answer
    a = replace(answer, cause=cause, established="rerun" if proven else "rerun_evidence", how=rule,
                not_proven=None if proven else answer.not_proven)
    a = with_tree(a, {"cause": cause, "certainty": "proven by a rerun" if proven else "evidence"}, ctx)
    if not proven or answer.fix is not None or not a.candidates or a.candidates[-1].cause != cause:
        return a
    own = replace(a.candidates[-1], detail="the fix of the cause a rerun proved")
    start, command, new_dump = _command(a.step, own, a.onset, ctx, exists)
    return replace(a, fix=own, candidates=a.candidates[:-1], start=start, command=command, new_dump=new_dump)
