"""The counterfactual variants of ``replay rerun``: parsing (``--variant``), open values
filled in from the ledger and the run's config, the training flags and
``--ledger.rehearsal.rerun`` overrides each one sets, and the cause each proves
(:data:`CAUSE_OF`), the variants a heuristic verdict calls for (:data:`PLAN_FOR`) and
the escalation order (:data:`ESCALATION`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_ledger.errors import TitanLedgerError
from titan_ledger.format import records
from titan_ledger.format.answers.causes import CAUSES as CAUSE_TABLE
from titan_ledger.format.answers.causes import RERUN_CAUSE
from titan_ledger.tools.rerun.report import _ranges

PRE = 50  # trained steps before T that describe "normal"
#: a counterfactual that removes the spike -> the cause it proves (priority order);
#: bad data is PROVEN only by ``quarantine`` (only the named documents masked, the rest
#: of the batch trained); ``skip`` (the whole step) shows "something in this step"
#: (one table with the window's and the answer's: ``format.answers.causes``)
CAUSE_OF = RERUN_CAUSE
CAUSES = tuple(dict.fromkeys(("hardware", *CAUSE_OF.values(), "unproven")))
#: diagnose's heuristic verdict -> the variants that test it
PLAN_FOR = {c.name: list(c.plan) for c in CAUSE_TABLE.values()}
#: after an unproven plan: the other counterfactuals, most specific first ("lr",
#: "beta2" and "logit_cap" without a value take theirs from the ledger and the run's
#: config: :func:`ledger_values`)
ESCALATION = ("quarantine", "skip", "fp32", "beta2", "eps=1e-6", "logit_cap", "lr")


class RerunError(TitanLedgerError):
    """A rerun that cannot be planned, run or compared (one line, exit 2)."""


@dataclass(frozen=True)
class Variant:
    kind: str  # same | skip | control | quarantine | qcontrol | swap | lr | eps | clip | logit_cap | qk_clip | zloss | fp32
    value: float | None = None
    #: skip: the steps to skip (empty: the spike step alone); control: the skip's same-size
    #: control, as many OTHER steps of the window skipped (:func:`~.plan.skip_control`)
    steps: tuple[int, ...] = ()
    #: quarantine: the ``(source, doc)`` documents masked (empty: none named: not applicable);
    #: qcontrol: its same-size control, other documents of the same steps (~.plan.quarantine_control)
    docs: tuple[tuple[str, int], ...] = ()

    @property
    def name(self) -> str:
        if self.kind == "skip" and self.steps:
            return f"skip={_ranges(list(self.steps))}"
        if self.kind == "control":
            return f"control:skip={_ranges(list(self.steps))}" if self.steps else "control:skip"
        if self.kind == "qcontrol":
            return ("control:quarantine=" + ",".join(f"{s}:{d}" for s, d in self.docs)) if self.docs \
                else "control:quarantine"
        if self.kind == "quarantine" and self.docs:
            return "quarantine=" + ",".join(f"{s}:{d}" for s, d in self.docs)
        return self.kind if self.value is None else f"{self.kind}={self.value:g}"

    def slug(self, step: int) -> str:
        if self.kind == "quarantine":
            return "quarantine" + ("_" + "_".join(str(d) for _, d in self.docs) if self.docs else "")
        if self.kind == "skip":
            return "skip" + (_ranges(list(self.steps)).replace(",", "_") if self.steps else str(step))
        if self.kind == "control":
            return "control_skip" + _ranges(list(self.steps)).replace(",", "_")
        if self.kind == "qcontrol":
            return "control_quarantine" + ("_" + "_".join(str(d) for _, d in self.docs) if self.docs else "")
        return self.name.replace("=", "_")

    def skip_list(self, step: int) -> list[int]:
        return sorted(self.steps) if self.steps else [step]


#: kinds whose value ``diagnose --rerun`` may take from the ledger (:func:`ledger_values`)
_VALUE_FROM_LEDGER = ("lr", "logit_cap", "qk_clip", "beta2")


def parse_variant(spec: str, allow_open: bool = False) -> Variant:
    """``same``, ``skip``, ``skip=28-29``, ``quarantine``, ``quarantine=SOURCE:DOC,...``,
    ``lr=0.5``, ...; with ``allow_open``, ``lr`` and ``logit_cap`` without a value (filled
    in by :func:`ledger_values`). A bare ``quarantine`` masks the documents the verdict
    names (:func:`titan_ledger.tools.incident.judge`: those that stand out at a flagged step)."""
    kind, eq, val = spec.strip().partition("=")
    if kind in ("same", "skip", "fp32", "swap", "quarantine") and not eq:
        return Variant(kind)
    if kind == "quarantine" and eq:
        docs = []
        for part in val.split(","):
            src, _, doc = part.strip().rpartition(":")
            if not src or not doc.isdigit():
                docs = []
                break
            docs.append((src, int(doc)))
        if docs:
            return Variant("quarantine", docs=tuple(sorted(set(docs))))
    if kind == "skip" and eq:
        from titan_ledger.data.layout import parse_skip_steps
        from titan_ledger.errors import TitanLedgerError as _E

        try:
            windows = parse_skip_steps(val)
        except _E:
            windows = []
        if windows:
            return Variant("skip", steps=tuple(s for a, b in windows for s in range(a, b + 1)))
    if allow_open and kind in _VALUE_FROM_LEDGER and not eq:
        return Variant(kind)
    if kind in ("lr", "eps", "clip", "logit_cap", "qk_clip", "beta2", "zloss") and eq:
        try:
            v = float(val)
        except ValueError:
            v = math.nan
        if math.isfinite(v) and v > 0 and not (kind == "beta2" and v >= 1):
            return Variant(kind, v)
    raise RerunError(f"--variant {spec!r}: one of same, skip, skip=A-B, quarantine, quarantine=SOURCE:DOC[,...], "
                     f"swap, lr=X, eps=X, beta2=X (< 1), clip=X, logit_cap=X, qk_clip=X, zloss=X, fp32 (X > 0)")


def ledger_values(v: Variant, rows: list[dict], step: int, config=None) -> Variant:
    """Fill in an open ``lr`` / ``logit_cap`` / ``beta2`` variant from the original's
    signals and config (pure).

    ``lr``: after an LR jump (``decision.lr_jump``: one step-to-step rise >= 2x and
    the LR at the spike >= 2x its median over the ``PRE`` steps before), the scale that
    undoes it (median / LR at T); otherwise 0.5.
    ``logit_cap``: half the max attention logit at the spike, only when that logit is
    >= diagnose's danger level (100); below it there is no growth to cap and a cap
    at half an ordinary logit would remove almost any spike (value 0: not applicable).
    ``qk_clip``: the same threshold, for QK-clip from the checkpoint on (the logits the
    run's weights grew, held at half the spike's).
    ``beta2``: 0.95 for a run above it, else the run's (1 - beta2) doubled (0.9 for
    torchtitan's default 0.95): v following the gradients twice as fast."""
    if v.value is not None or v.kind not in _VALUE_FROM_LEDGER:
        return v
    at = next((r for r in rows if r["step"] == step), {})
    if v.kind == "lr":
        from titan_ledger.tools.decision import Thresholds, lj_hit, lr_jump

        lj = lr_jump(rows, step, PRE)
        if lj_hit(lj, Thresholds().lr_jump):
            return Variant("lr", float(f"{1 / lj['lr_ratio']:.3g}"))
        return Variant("lr", 0.5)
    if v.kind == "beta2":
        b2 = _beta2_of(config) if config is not None else 0.95
        return Variant("beta2", 0.95 if b2 > 0.95 else float(f"{1 - 2 * (1 - b2):.4g}"))
    from titan_ledger.tools.decision import Thresholds

    ml = _num(at.get("max_logit"))
    if ml is None or not math.isfinite(ml) or ml < Thresholds().logit_level:
        return Variant(v.kind, 0.0)  # no logit growth to cap: not applicable (variant_args)
    return Variant(v.kind, float(f"{0.5 * ml:.3g}"))


def variant_args(v: Variant, step: int, config, folder=None) -> tuple[list[str], dict[str, float]] | None:
    """Extra training flags and ``--ledger.rehearsal.rerun`` overrides of a variant; None when it
    does not apply to this run (fp32 on an fp32 or CPU run; quarantine naming no document).
    ``folder``: the rerun's folder (a quarantine file is written there: :func:`write_quarantine`)."""
    if v.kind == "same":
        return [], {}
    if v.kind in ("quarantine", "qcontrol"):  # the control masks other documents the same way
        if not v.docs:
            return None
        path = f"{folder}/{records.QUARANTINE_FILE}" if folder is not None else records.QUARANTINE_FILE
        return ["--ledger.filter.quarantine", ",".join([*config.ledger.filter.quarantine, path])], {}
    if v.kind == "skip" or (v.kind == "control" and v.steps):
        windows = [*config.ledger.skip.steps, *(str(s) for s in v.skip_list(step))]
        return ["--ledger.skip.steps", ",".join(windows)], {}
    if v.kind == "control":
        return None  # no same-size control fits the window (~.plan.skip_control)
    if v.kind == "swap":
        kept = [p for p in (config.ledger.rehearsal.inject or "").split(",") if p.strip() and not p.strip().endswith(":bitflip")]
        return ["--ledger.rehearsal.inject", ",".join([*kept, f"{step}:0:swap"])], {}
    if v.kind == "lr":
        return [], {"lr_scale": v.value}
    if v.kind == "eps":
        return [], {"eps": v.value}
    if v.kind == "logit_cap":
        if not v.value:
            return None  # ledger_values: the max logit at T is below the danger level
        return [], {"logit_cap": v.value}
    if v.kind == "qk_clip":
        if not v.value or config.model.qk_norm or config.qk_clip.enable:
            return None  # no logit growth; QK-norm runs (the clip would change nothing); already clipping
        # QK-clip has no weights and no state: the checkpoint loads
        return ["--qk_clip.enable", "--qk_clip.threshold", f"{v.value:g}"], {}
    if v.kind == "beta2":
        if v.value >= 1 or v.value >= _beta2_of(config):
            return None  # the run's beta2 is already this low: nothing to change
        return [], {"beta2": v.value}
    if v.kind == "clip":
        return ["--training.max_norm", f"{v.value:g}"], {}
    if v.kind == "zloss":
        # the z-loss has no weights: a checkpoint written without it loads with it
        return ["--loss.z_loss_weight", f"{v.value:g}"], {}
    if v.kind == "fp32":
        if config.training.mixed_precision_param == "float32":
            return None
        return ["--training.mixed_precision_param", "float32"], {}
    raise AssertionError(v)


def _beta2_of(config) -> float:
    """The first param group's Adam beta2 (torchtitan 0.3.0: optimizer_kwargs["betas"])."""
    try:
        return float(config.optimizer.param_groups[0].optimizer_kwargs.get("betas", (0.9, 0.999))[1])
    except (AttributeError, IndexError, TypeError):
        return 1.0


def _num(x) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def write_quarantine(v: Variant, folder) -> None:
    """The ``quarantine`` variant's file in its rerun folder, one ``{"source", "doc"}`` per line."""
    import json
    from pathlib import Path

    with open(Path(folder) / records.QUARANTINE_FILE, "w") as f:
        for source, doc in v.docs:
            f.write(json.dumps({"source": source, "doc": doc}) + "\n")
