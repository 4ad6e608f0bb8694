"""Running reruns: each variant trained in its own folder from the original's
checkpoint (or an identical earlier rerun reused), compared and judged
(:func:`rerun`), the one-line summary the incident page reads
(:func:`write_summary`), and ``diagnose --rerun``'s glue (:func:`for_diagnosis`)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from titan_ledger.format import records
from titan_ledger.tools.rerun.comparison import VariantResult, compare
from titan_ledger.tools.rerun.plan import (
    Plan,
    checkpoints_of,
    make_plan,
    quarantine_control,
    resolve_variant,
    skip_control,
    strip_train_args,
    window_documents,
)
from titan_ledger.tools.rerun.variants import (
    ESCALATION,
    PLAN_FOR,
    RerunError,
    Variant,
    parse_variant,
    variant_args,
    write_quarantine,
)
from titan_ledger.tools.rerun.verdicts import verdict

HUGE_INTERVAL = 1_000_000_000


def _link_checkpoint(plan: Plan, folder: Path) -> None:
    src = (plan.dump / plan.checkpoint_folder / f"step-{plan.load_step}").resolve()
    dst = folder / plan.checkpoint_folder / f"step-{plan.load_step}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(src, target_is_directory=True)


def _reusable(folder: Path, record: dict) -> bool:
    f = folder / records.RERUN_RECORD_FILE
    if not f.exists():
        return False
    try:
        old = json.loads(f.read_text())
    except ValueError:
        return False
    same = all(old.get(k) == record[k] for k in ("variant", "load_step", "train_args", "overrides", "nproc"))
    return same and old.get("returncode") == 0 and old.get("stop", 0) >= record["stop"]


def run_variant(plan: Plan, v: Variant, base_args: list[str], config, nproc: int, *, fresh: bool = False,
                env=None, log=print) -> VariantResult:
    """Train one variant (or reuse an earlier identical rerun) and compare it."""
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools.launch import validate
    from titan_ledger.tools.runs import run_training

    folder = plan.folder(v)
    va = variant_args(v, plan.step, config, folder)
    if va is None:
        if v.kind == "quarantine":
            note = ("no document to mask: the verdict names none that stands out at a flagged step "
                    "(or the step's batch was injected)")
        elif v.kind == "fp32":
            note = "the run trains in float32 already (--training.mixed_precision_param float32)"
        elif v.kind == "beta2":
            note = f"the run's Adam beta2 is already <= {v.value:g}"
        elif v.kind in ("logit_cap", "qk_clip") and not v.value:
            note = "the max logit at the spike is below the danger level (100): no growth to cap"
        elif v.kind == "qk_clip":
            note = "the run has QK-norm (the clip would change nothing) or clips already (--qk_clip.enable)"
        elif v.kind == "control":
            note = ("the window before the spike holds fewer other trained steps than the skip removes: no "
                    "same-size control fits (load from an earlier checkpoint: --from)")
        elif v.kind == "qcontrol":
            note = ("the steps the named documents train at hold less other text than they do: no same-size "
                    "control fits")
        else:
            note = "not applicable to this run"
        return VariantResult(v.name, v.kind, None, applicable=False, note=note)
    extra, over = va
    if "--ledger.rehearsal.inject" in extra:  # the variant's own --ledger.rehearsal.inject replaces the original's
        base_args = strip_train_args(base_args, drop_inject=True)
    fixed = [*base_args, *extra, "--checkpoint.enable", "--checkpoint.load_step", str(plan.load_step),
             "--checkpoint.interval", str(HUGE_INTERVAL)]
    over_s = ",".join(f"{k}={val:g}" for k, val in over.items())
    args = [*fixed, "--ledger.rehearsal.rerun", ",".join(x for x in (f"stop={plan.stop}", over_s) if x)]
    # an earlier rerun of the same variant from the same checkpoint that trained at
    # least as far is the same computation (deterministic runs): reused
    record = {"variant": v.name, "load_step": plan.load_step, "stop": plan.stop, "train_args": fixed,
              "overrides": over_s, "nproc": nproc}
    reused = not fresh and _reusable(folder, record)
    seconds = None
    if not reused:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        _link_checkpoint(plan, folder)
        if v.kind in ("quarantine", "qcontrol"):
            write_quarantine(v, folder)  # only these documents masked; the rest of the batch trains
        validate([*args, "--job.dump_folder", str(folder)], nproc)
        logf = folder / "rerun.log"
        log(f"rerun {v.name}: training steps {plan.load_step + 1}-{plan.stop} in {folder} (log: {logf})")
        t0 = time.monotonic()
        out = run_training(nproc, folder, args, logf, env=env)
        seconds = round(time.monotonic() - t0, 1)
        (folder / records.RERUN_RECORD_FILE).write_text(json.dumps({**record, "returncode": out["returncode"],
                                                       "seconds": seconds}))
        if out["returncode"] != 0:
            tail = _last_error(logf)
            raise RerunError(f"the {v.name} rerun failed (exit {out['returncode']}){': ' + tail if tail else ''}; "
                             f"log: {logf}")
    else:
        log(f"rerun {v.name}: reusing {folder} (same checkpoint, flags and window)")
    res = compare(RunLedger(plan.dump, plan.ledger_folder), RunLedger(folder, plan.ledger_folder), plan, v, folder)
    res.reused, res.seconds = reused, seconds
    if v.kind == "lr" and res.lr_ratio_at_step is not None and abs(res.lr_ratio_at_step - v.value) > 1e-6:
        raise RerunError(f"the {v.name} rerun trained step {plan.step} with lr "
                         f"{(res.at_step or {}).get('lr')} ({res.lr_ratio_at_step:g}x the original's, "
                         f"not {v.value:g}x); log: {folder / 'rerun.log'}")
    return res


def _last_error(log: Path) -> str:
    """The line that says why a rerun failed: titan_ledger's own error line, else the
    last exception line of a traceback."""
    import re

    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for pat in (r"titan_ledger[.\w]*: error: .*", r"\b\w+(Error|Exception): .*"):
        for line in reversed(lines):
            m = re.search(pat, line)
            if m:
                return m.group(0).strip()[:300]
    return ""


def prepare(dump, step: int, variants: list[str] | list[Variant], train_args: list[str], *,
            load_step: int | None = None, after: int = 1, nproc: int = 2,
            ledger_folder: str = records.LEDGER_FOLDER) -> tuple[Plan, Any, list[str], int]:
    """Check the original run's flags and plan: (plan, config, rerun base flags, launches)."""
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools.launch import validate

    dump = Path(dump)
    led = RunLedger(dump, ledger_folder)
    # the original run's flags: parsed as the ranks would, and checked against the
    # dump folder's recorded layout (seq_len, global batch) before anything trains
    config = validate([*train_args, "--job.dump_folder", str(dump)], nproc)
    rows = led.signal_rows()
    # a step a rollback undid is rerun against the history as it stood when it ran
    then = led.rows_as_of(step) or rows
    ok = lambda r: not r.get("skipped") and r.get("loss") is not None  # noqa: E731
    trained = sorted({r["step"] for r in rows if ok(r)} | {r["step"] for r in then if r["step"] == step and ok(r)})
    last = max((r.get("last_step", r["step"]) for r in rows), default=0)
    vs = [x if isinstance(x, Variant) else parse_variant(x) for x in variants]
    if any(v.kind == "quarantine" and not v.docs for v in vs):
        # a bare quarantine: the documents the verdict names (standing out at a flagged step)
        from titan_ledger.tools.incident import judge

        docs = tuple(sorted({(d["source"], int(d["doc"])) for d in judge(led, step).get("documents") or []}))
        vs = [Variant("quarantine", docs=docs) if v.kind == "quarantine" and not v.docs else v for v in vs]
    plan = make_plan(dump, step, vs, load_step=load_step, after=after,
                     checkpoints=checkpoints_of(dump, config.checkpoint.folder), trained=trained,
                     last_step=last, checkpoint_folder=config.checkpoint.folder,
                     ledger_folder=ledger_folder)
    segs = led.signals_index.segments
    world = segs[-1].header.get("world_size") if segs else None
    if world is not None and int(world) != nproc:
        raise RerunError(f"--nproc {nproc}: the run trained on {world} processes ({led.folder}); a rerun "
                         f"must see the same DP layout: pass --nproc {world}")
    hdr = led.data.header()  # seq_len is not refused by the dump-folder check when checkpoints exist
    if hdr.get("seq_len") is not None and hdr.get("seq_len") != config.training.seq_len:
        raise RerunError(f"{dump}: the run trained with seq_len {hdr.get('seq_len')}, these flags give "
                         f"--training.seq_len {config.training.seq_len}: give the original run's flags")
    n_launch = sum(variant_args(v, step, config) is not None for v in plan.variants)
    base = strip_train_args(train_args)
    if any(a in str(config.ledger.response.action) for a in ("rollback", "stop")):
        # the original rolled back (or stopped) at a flag: the rerun must train through the
        # step to compare it (its update at T is applied; only T itself is compared then)
        base = [*_drop_flag(base, "--ledger.response.action"), "--ledger.response.action", "none"]
    return plan, config, base, n_launch


def _drop_flag(args: list[str], flag: str) -> list[str]:
    out, i = [], 0
    while i < len(args):
        key, eq, _ = args[i].partition("=")
        if key == flag:
            i += 1 if eq else 2
            continue
        out.append(args[i])
        i += 1
    return out


def rerun(dump, step: int, variants: list[str] | list[Variant], train_args: list[str], *,
          load_step: int | None = None, after: int = 1, nproc: int = 2, ledger_folder: str = records.LEDGER_FOLDER,
          fresh: bool = False, heuristic: str | None = None, log=print, prepared=None,
          escalate: list[Variant] | None = None, max_steps: int | None = None) -> dict:
    """Plan, run every variant, compare, judge. Returns the JSON-able report.

    ``escalate``: variants to try one at a time, in order, when the plan's verdict is
    ``unproven`` (reproduced under ``same``, removed by none), until one removes the
    spike or ``max_steps`` training steps in all would be exceeded."""
    plan, config, base, n_launch = prepared or prepare(
        dump, step, variants, train_args, load_step=load_step, after=after, nproc=nproc,
        ledger_folder=ledger_folder)
    if prepared is None:  # for_diagnosis printed every spike's budget before running any
        log(plan.budget_line(n_launch))
    results = [run_variant(plan, v, base, config, nproc, fresh=fresh, log=log) for v in plan.variants]
    spent = n_launch * plan.steps_per_variant

    def controlled() -> int:
        """A skip or a quarantine that removed a reproduced spike gets its same-size control
        (plan.skip_control, plan.quarantine_control), run at once: the verdict convicts the
        data only if the control leaves the spike."""
        same = next((r for r in results if r.kind == "same" and r.applicable), None)
        spent_here = 0
        for kind, ctl_kind in (("skip", "control"), ("quarantine", "qcontrol")):
            hit = next((r for r in results if r.kind == kind and r.applicable and r.present is False), None)
            if hit is None or any(r.kind == ctl_kind for r in results) or not (same and same.present):
                continue
            orig = next(x for x in [*plan.variants, *(escalate or [])] if x.name == hit.variant)
            if kind == "skip":
                v = skip_control(orig, step, plan.load_step, list(plan.trained))
                what = "skips as many other steps"
            else:
                from titan_ledger.format.reader import RunLedger

                v = quarantine_control(orig, *window_documents(RunLedger(plan.dump, plan.ledger_folder),
                                                               plan.load_step + 1, step))
                what = "masks as many tokens of other documents of the same steps"
            log(f"rerun: {hit.variant} removed the spike at step {step}; its control {what}: {v.name}"
                + ("" if v.steps or v.docs else " -- none fits"))
            results.append(run_variant(plan, v, base, config, nproc, fresh=fresh, log=log))
            spent_here += plan.steps_per_variant if v.steps or v.docs else 0
        return spent_here

    spent += controlled()
    vd = verdict(results, step, heuristic)
    escalated = []
    for v in escalate or []:
        if vd["cause"] != "unproven" or vd.get("not_a_spike"):
            break
        if any(r.kind == v.kind for r in results) or variant_args(v, step, config) is None:
            continue
        if max_steps is not None and spent + plan.steps_per_variant > max_steps:
            log(f"rerun: escalation stops before {v.name}: it would exceed {max_steps} training steps")
            break
        log(f"rerun: {', '.join(r.variant for r in results)} left the spike at step {step} unexplained; "
            f"escalating to {v.name}")
        results.append(run_variant(plan, v, base, config, nproc, fresh=fresh, log=log))
        spent += plan.steps_per_variant
        escalated.append(v.name)
        spent += controlled()
        vd = verdict(results, step, heuristic)
    if escalated:
        vd["escalated"] = escalated
    rep = {"dump_folder": str(plan.dump), "step": step, "load_step": plan.load_step, "stop": plan.stop,
           "budget_steps": spent, "variants": [r.to_json() for r in results], "verdict": vd}
    from titan_ledger.format.reader import RunLedger
    from titan_ledger.tools.postmortem import actions_at

    acted = actions_at(RunLedger(plan.dump, plan.ledger_folder), step)
    if acted["flagged"] or acted["rewind"] or acted["update_skipped"]:
        rep["done"] = acted["summary"]  # what the trainer did about the step (the postmortem)
    write_summary(plan.dump / plan.ledger_folder, rep)
    return rep


def write_summary(ledger_dir: Path, rep: dict) -> Path:
    """``<ledger>/rerun/step<T>.json``: one line, the verdict and each variant's row at T
    (what ``titan_ledger.report``'s incident page shows); written whole (tmp + rename)."""
    keep = ("variant", "applicable", "present", "original_spike", "at_step", "original_at_step", "flagged",
            "bit_equal_steps", "first_difference", "max_rel_diff", "data_equal", "lr_ratio_at_step", "swap",
            "folder", "note")
    summary = {"step": rep["step"], "load_step": rep["load_step"], "stop": rep["stop"],
               "verdict": rep["verdict"], "variants": [{k: v.get(k) for k in keep} for v in rep["variants"]]}
    answer = _answer_with(ledger_dir, rep["step"], rep["verdict"])
    if answer is not None:  # what the rerun proved, recorded as the incident's answer (every view reads it)
        summary["answer"] = answer.to_json()
    path = records.rerun_summary_file(ledger_dir, rep["step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary) + "\n")
    os.replace(tmp, path)
    return path


def _answer_with(ledger_dir: Path, step: int, verdict: dict):
    """The incident's answer built again with what the rerun found (``format.answers``); None
    when the step is no incident of the ledger or the rerun proved nothing new."""
    from titan_ledger.errors import LedgerError
    from titan_ledger.format.answers.of_run import rerun_answer
    from titan_ledger.format.reader import RunLedger

    try:
        return rerun_answer(RunLedger.at(ledger_dir), step, verdict)
    except LedgerError:
        return None


def for_diagnosis(dump, results: list[dict], train_args: list[str], *, nproc: int = 2, after: int = 1,
                  max_steps: int = 200, ledger_folder: str = records.LEDGER_FOLDER, fresh: bool = False,
                  log=print, escalate: bool = True) -> None:
    """``diagnose --rerun``: for each diagnosed spike, run the variants its heuristic
    verdict calls for (:data:`PLAN_FOR`) within a training-step budget printed
    first, escalate through :data:`ESCALATION` when they leave it unexplained, and
    attach the report (``res["rerun"]``) with the proven cause."""
    from titan_ledger.format.reader import RunLedger

    if not train_args:
        raise RerunError("--rerun needs the original run's training flags after `--` (at least "
                         "--job.config_file X.toml), as python -m titan_ledger.replay rerun does")
    from titan_ledger.tools.incident import document_scores

    led = RunLedger(dump, ledger_folder)
    jobs = []
    for res in results:
        step = res["step"]
        # the tree's own answer plans the variants and is what a rerun confirms or refutes
        # (a verdict already backed by an earlier rerun keeps it as ``heuristic``)
        tree = res.get("heuristic") or res["cause"]
        p0 = prepare(dump, step, ["same"], train_args, after=after, nproc=nproc, ledger_folder=ledger_folder)
        plan0, config = p0[0], p0[1]
        # the rerun starts where the fingerprint began (decision: ``onset``), from the last
        # checkpoint before it: from the one just before the spike, a rerun of an LR cause
        # inherits the damage and can only move the spike (issue 51)
        load, onset = plan0.load_step, res.get("onset")
        if onset is not None:
            cks = checkpoints_of(Path(dump), config.checkpoint.folder)
            # before the onset; else at it (the run's first step, --checkpoint.enable_first_step_checkpoint)
            before = [c for c in cks if c <= onset - 1] or [c for c in cks if c == onset]
            load = before[-1] if before else load
            log(f"  step {step}: the fingerprint began at step {onset}: "
                + (f"rerun from checkpoint step-{load}" if before else
                   f"no checkpoint at or before it (from step-{plan0.load_step}, the rerun starts after the "
                   f"onset and may move the spike rather than remove it)"))
        # skip widens over the most extreme document only (the verdict's first; for any
        # other heuristic, the step's most extreme recorded one, for the escalation)
        docs = (res.get("documents") or document_scores(led, step))[:1]
        named = tuple(sorted({(d["source"], int(d["doc"])) for d in res.get("documents") or []}))

        prevent = (res.get("prevention") or {}).get("flags") or []
        peak = ((res.get("fingerprints") or {}).get("schedule") or {}).get("peak_lr")

        def resolve(spec, docs=docs, named=named, step=step, load=load, config=config):
            if spec == "quarantine":  # only the documents the verdict names (never a fallback)
                return Variant("quarantine", docs=named)
            if spec == "lr" and prevent[:1] == ["--optimizer.lr"] and peak:
                return Variant("lr", float(f"{float(prevent[1]) / peak:.3g}"))  # the LR the tree named
            return resolve_variant(spec, led, step, load, config, docs)

        variants = [resolve(v) for v in PLAN_FOR.get(tree, ["same"])]
        na = [v for v in variants if variant_args(v, step, config) is None]
        if na:  # fp32 on an fp32 run: dropped; when nothing but `same` is left, test the data
            variants = [v for v in variants if v not in na]
            alone = all(v.kind == "same" for v in variants) and tree not in ("hardware", "transient")
            log(f"  step {step}: {', '.join(v.name for v in na)} not applicable to this run"
                + ("; testing skip instead" if alone else ""))
            if alone:
                variants.append(resolve("skip"))
        esc = [resolve(v) for v in ESCALATION] if escalate else []
        # the window reaches `after` steps past the last skipped one: a skip that ends the
        # window would remove the spike by leaving nothing trained after it
        last_skip = max((x for v in [*variants, *esc] if v.kind == "skip" for x in v.skip_list(step)),
                        default=step)
        p = prepare(dump, step, variants, train_args, load_step=None if load == plan0.load_step else load,
                    after=after + (last_skip - step), nproc=nproc, ledger_folder=ledger_folder)
        jobs.append((res, p, esc))
    total = sum(p[0].steps_per_variant * p[3] for _, p, _ in jobs)
    log(f"rerun budget: {total} training steps in all over {len(jobs)} spike(s), more only to escalate "
        f"(--rerun-max-steps {max_steps})")
    for res, p, esc in jobs:
        log(f"  step {res['step']}: heuristic {res.get('heuristic') or res['cause']} -> variants "
            f"{', '.join(v.name for v in p[0].variants)}: {p[0].budget_line(p[3])}")
    if total > max_steps:
        raise RerunError(f"--rerun: the reruns need {total} training steps, more than "
                         f"--rerun-max-steps {max_steps}; raise it or pick one spike with --step")
    # escalation may spend what the later spikes' planned reruns leave of max_steps
    planned = [p[0].steps_per_variant * p[3] for _, p, _ in jobs]
    left = max_steps
    for i, (res, p, esc) in enumerate(jobs):
        res["rerun"] = rerun(dump, res["step"], [], train_args, nproc=nproc, fresh=fresh,
                             heuristic=res.get("heuristic") or res["cause"], log=log, prepared=p, escalate=esc,
                             max_steps=left - sum(planned[i + 1:]))
        left -= res["rerun"]["budget_steps"]
