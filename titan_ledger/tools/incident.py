"""A step of a run judged, for ``diagnose`` and ``report`` alike: the decision tree's reading
beside what the run recorded of it -- the trainer's flag and notes, the proof at the alarm,
the stall rule, a rerun from a checkpoint -- the documents that stand out, and the answer.

Design decision: the tree (:mod:`titan_ledger.tools.decision`) is pure over rows; this module
is where a run's ledger meets it (:func:`judge`, one code path for every view), and where the
answer that stands is read (``format.answers.of_run``) with the tree's reading beside it as
untested candidates, never in it. It imports no other tool but
:mod:`titan_ledger.tools.postmortem` (the recorded actions at a step) and the tree, and costs
no torch until a rule runs offline.
"""

from __future__ import annotations

import math
import statistics
from functools import cache

from titan_ledger.components.detection import fingerprints as fp
from titan_ledger.errors import LedgerCorrupt, LedgerError
from titan_ledger.format.proofs import describe_window
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools.decision import EVIDENCE_RULES, Thresholds, _spikes, classify


def document_scores(led: RunLedger, step: int) -> list[dict]:
    """The documents recorded at ``step`` (each rank's highest- and lowest-loss
    segments), one entry per distinct document, most extreme first.

    A document's loss is the token-weighted mean over its recorded segments; the
    reference is the median over the distinct documents, not over segments: a
    degenerate document cut into many of a step's rows can BE the segment median (the
    zoo's repeated token at step 46 sat at 0.99x it, and a normal document at 1.52x
    was named instead), but it is one document among the few the step holds. Each
    entry is the document's most extreme segment (row, span, rank) with ``loss`` (the
    document's), ``vs_median`` (over the median document), ``segments`` and
    ``tokens``; [] when the run recorded none."""
    try:
        docs, _ = led.data.doc_losses(step)
    except LedgerError:
        return []
    by: dict[tuple[str, int], list[dict]] = {}
    for d in docs:
        if d.get("loss") and d.get("tokens"):
            by.setdefault((d["source"], d["doc"]), []).append(d)
    if not by:
        return []
    loss = {k: sum(x["loss_sum"] for x in v) / sum(x["tokens"] for x in v) for k, v in by.items()}
    ref = statistics.median(loss.values())
    out = []
    for k, segs in by.items():
        far = max(segs, key=lambda x: abs(math.log(x["loss"] / ref)))
        ranks = {}
        for x in segs:
            ranks[x["dp_rank"]] = ranks.get(x["dp_rank"], 0) + x["tokens"]
        out.append(dict(far, loss=loss[k], segment_loss=far["loss"], vs_median=loss[k] / ref,
                        segments=len(segs), tokens=sum(x["tokens"] for x in segs),
                        dp_rank=max(ranks, key=lambda r: (ranks[r], -r))))
    out.sort(key=lambda d: -abs(math.log(d["vs_median"])))
    return out


CERTAINTIES = ("proven", "evidence", "guess")


def rank_phrase(res: dict) -> str:
    """`` (DP rank r)`` after a verdict's cause, `` (DP ranks 0, 1)`` when a proof convicted
    documents on several ranks; empty when no rank is named."""
    if len(res.get("ranks") or ()) > 1:
        return f" (DP ranks {', '.join(map(str, res['ranks']))})"
    return f" (DP rank {res['rank']})" if res.get("rank") is not None else ""
#: a document "stands out" against its step when its loss is >= this many times the
#: step's median document or <= 1 / this: exp of the trainer's doc_outlier_floor (a
#: log ratio of 0.7, i.e. 2x), the floor under which its document rules never fire --
#: or when the trainer's document statistic at the flag puts one DP rank's high or low
#: side >= ``Thresholds.doc_extreme`` (3x) further from that rank's median than usual, and
#: it is that rank's document furthest from the step's median document. The second route
#: is the spike zoo's planted repeated document: it filled most of its rank's rows, so it
#: *was* the rank's median (the statistic fired on the rank's other, normal documents,
#: 17.8x the usual distance above it) and sat at 0.71x the step's median; masking it alone
#: removed the spike
@cache
def _default_floor() -> float:
    return float(_spikes().SpikeDetector.Config().doc_outlier_floor)


def _doc_standout(floor: float | None = None) -> float:
    """``DOC_STANDOUT``: exp of the spike rules' ``doc_outlier_floor`` (their one owner): the
    run's own (``floor``, as its spikes.jsonl recorded it), else the default."""
    return math.exp(_default_floor() if floor is None else float(floor))


def _doc_criterion(floor: float | None = None) -> str:
    """``DOC_CRITERION``: the rule above in words (quarantine records carry it)."""
    x = _doc_standout(floor)
    return (f"document loss >= {x:.2g}x the step's median document or <= 1/{x:.2g} "
            f"of it (|log ratio| >= {math.log(x):g}, the spike rules' "
            f"doc_outlier_floor), or the document furthest from the step's median on a DP rank whose "
            f"documents the trainer's statistic put >= {Thresholds().doc_extreme:g}x their usual distance "
            f"from the rank's median")


def __getattr__(name: str):  # DOC_STANDOUT / DOC_CRITERION, computed on first use (PEP 562)
    if name == "DOC_STANDOUT":
        return _doc_standout()
    if name == "DOC_CRITERION":
        return _doc_criterion()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def judge(led: RunLedger, step: int, th: Thresholds | None = None, n_docs: int = 3) -> dict:
    """THE verdict on ``step``, for ``diagnose`` and ``report`` alike (one code path).

    The tree (:func:`classify`) walks the signals history as it stood when the step
    ran (``rows_as_of``: a step a rollback later undid is judged on what the trainer
    saw when it decided), with the trainer's own event for the step (its rules and
    evidence stats, ``spikes.jsonl``) and the compute dtype of the launch that
    trained it. Added: ``trainer`` (the flag: rules, action, suspect rank),
    ``actions`` / ``done`` (what was done and what followed,
    :func:`titan_ledger.tools.postmortem.actions_at`), ``rank_losses`` (each rank's
    own loss at the step, as it trained), ``injected`` (DP ranks whose batch an
    injection replaced), for a bad_data verdict the ``documents`` that stand out
    (:data:`DOC_CRITERION`; none for an injected batch or an unflagged step) and
    ``certainty`` (``proven`` / ``evidence`` / ``guess``) with ``certainty_rule``.
    A rerun summary (``<ledger>/rerun/step<T>.json``) that proves a cause makes it
    the verdict (the tree's answer kept as ``heuristic``)."""
    from titan_ledger.format import records
    from titan_ledger.tools.postmortem import actions_at

    path = led.folder / records.SIGNALS_FILE
    th = th or Thresholds()
    # the rows the tree reads (th.pre before, th.post after), as the step saw them, through
    # the offset index: O(log n) however long the run
    hist = led.history_at(step, th.pre, th.post)
    rows, current = hist if hist is not None else (None, True)
    win = next((r for r in led.signals_between(step, step)
                if r.get("skipped") and r["step"] <= step <= r.get("last_step", r["step"])), None)
    if win is not None and (rows is None or current):
        raise LedgerError(f"--step {step}: not a trained step: it is in the skipped window "
                          f"{win['step']}-{win.get('last_step', win['step'])} of {path} and no launch trained "
                          f"it; nothing trained there to diagnose")
    if rows is None:
        last = led.last_signal_step(windows=True) or 0
        raise LedgerError(f"--step {step}: not a recorded step of {path} (it covers steps 1-{last})")
    events = [e for e in led.spike_events() if int(e["step"]) == step]
    event = events[-1] if events else None
    dtype = led.param_dtype(step)
    # the run's first rows (the warm-up, the "early" levels): a bounded read from the top of
    # the file, th.start steps at most, however long the run
    start = [r for r in led.signals_between(1, min(step, th.start)) if not r.get("skipped")
             and r.get("loss") is not None and r["step"] <= step]
    try:
        res = classify(rows, step, th, evidence=event, param_dtype=dtype, precision=led.precision(step),
                       start=start)
    except ValueError as e:
        raise LedgerError(f"--step {step}: {path}: {e}") from None
    res["param_dtype"] = dtype
    res["rewound"] = not current  # a later rollback or resume superseded this step
    res["trainer"] = None if event is None else {
        k: event.get(k) for k in ("rules", "notes", "action", "suspect_dp_rank", "loss_max_rank",
                                  "grad_norm_median", "loss_median", "grad_jump_ratio", "grad_jump_bound", "separation_y",
                                  "separation_bound", "separation_rank")
        if event.get(k) is not None}
    note = next((e for e in reversed(led.note_events()) if int(e["step"]) == step), None)
    res["trainer_notes"] = note and note["notes"]  # a note-only step: recorded, never acted on
    res["trainer_notes_why"] = note and _why_noted(note)
    res["actions"] = actions_at(led, step)
    res["done"] = res["actions"]["summary"]
    res["rank_losses"] = {str(r): row.get("loss") for r, row in sorted(led.rank_rows_at(step).items())} or None
    try:
        injected = led.data.injected_at(step)
    except LedgerCorrupt:
        raise
    except LedgerError:
        injected = {}
    res["injected"] = {str(r): k for r, k in injected.items()} or None
    if injected:
        where = ", ".join(f"DP rank {r} ({k})" for r, k in sorted(injected.items()))
        res["documents_note"] = (f"batch replaced by an injection (--ledger.rehearsal.inject) on {where}: the "
                                 f"data ledger's documents there never trained; no documents to quarantine")
    bad = res["cause"] == "bad_data" or (res["cause"] == "divergence" and res.get("underlying") == "bad_data")
    if bad:
        if (event or {}).get("suspect_dp_rank") is None:
            # no evidence rule named a rank: the rank holding the document furthest
            # from the step's median (either way) is the evidence; loss_max_rank is
            # not: a rank training repeated text pushes the OTHER rank to loss_max
            by_doc = extreme_document_rank(led, step)
            if by_doc is not None and not injected:
                res["rank_from"] = "documents"
                res["rank"] = by_doc
        res["documents"], res["documents_note"] = _standout(led, step, res.get("rank"), event, injected, n_docs)
    res["certainty"], res["certainty_rule"] = _certainty(res, event, injected)
    # the tree's own reading, before any proof or rerun: a candidate for the answer, never its cause
    res["tree"] = {"cause": res["cause"], "certainty": res["certainty"], "rule": res["certainty_rule"]}
    _apply_proof(res, (event or {}).get("proof") or (note or {}).get("proof"))
    stall = next((e for e in reversed(led.response_events()) if e.get("stall") and int(e["step"]) == step), None)
    _apply_stall(res, stall, next((p for _, p in reversed(led.proofs()) if (p.get("stall") or {}).get("step") == step),
                                  None) if stall is not None else None)
    note_fragile(res)
    if res.get("proof", {}).get("verdict") == "bad_data":  # the convicted documents, with their losses
        scores = {(d["source"], d["doc"]): d for d in document_scores(led, step)}
        res["documents"] = [dict(scores.get((d["source"], d["doc"]), d), criterion=PROOF_CRITERION, proven=True)
                            for d in res["documents"]]
    _apply_rerun(led, step, res)
    res["answer"], res["reading"] = answer_of(led, step, res)
    return res


def answer_of(led: RunLedger, step: int, res: dict) -> tuple[dict | None, list[dict]]:
    """THE answer to the incident at ``step`` as it stands (``format.answers.of_run``: a
    rerun's, else the trainer's, else built from the recorded event) and, beside it, the
    decision tree's reading as untested candidate fixes (only where the answer has none);
    (None, []) when nothing flagged the step. Every view renders these two."""
    from titan_ledger.format.answers import of_run, render, tree_candidates

    a = of_run.answer_at(led, step)
    if a is None:
        return None, []
    reading = tree_candidates(res.get("tree"), of_run.context(led), a.candidates)
    return a.to_json(), [f.to_json() for f in render.candidates_of(a, reading)[len(a.candidates):]]


def _apply_stall(res: dict, event: dict | None, proof: dict | None = None) -> None:
    """A step the stall rule flagged (``components.detection.stall``): no spike, a finding.
    ``stalled`` needs the attention logits past its bar, so its cause is logit growth (the
    evidence: the loss's windows and the logits), with QK-norm's prevention; a ``diverging``
    loss keeps the tree's cause, with the stall beside it. The window proof the trainer ran
    at the next step (``proof``: its ``stall`` names this flag) proves the cause whose fix
    lowered the loss, the cheapest first."""
    if event is None:
        return
    from titan_ledger.components.detection.stall import describe_stall

    st = event["stall"]
    res["stall"] = st
    window = (proof or {}).get("window") or {}
    if window.get("cause"):
        res["stall_proof"] = proof
        if res.get("cause") != window["cause"]:
            res["heuristic"] = res.get("cause")
        res.update(cause=window["cause"], certainty="proven",
                   certainty_rule=f"proven in process: {describe_window(window)} ({describe_stall(event)})",
                   prevention=fp.prevention(window["cause"], res.get("fingerprints"), st.get("max_logit")))
        return
    if st["kind"] == "stalled":
        if res.get("cause") != "logit_growth":
            res["heuristic"] = res.get("cause")
        res.update(cause="logit_growth", certainty="evidence",
                   certainty_rule=f"evidence: the stall rule ({describe_stall(event)})",
                   prevention=fp.prevention("logit_growth", res.get("fingerprints"), st.get("max_logit")))
    else:
        res["certainty_rule"] = f"{res.get('certainty_rule', '')}; {describe_stall(event)}".lstrip("; ")


#: above this many DP ranks, per-rank values are summarised (the median, the spread, the worst
#: ranks) instead of listed: a DP-512 run's 512 losses on one line read as noise
RANKS_LISTED = 16


def rank_summary(values: dict[str, float | None], worst: int = 3) -> str:
    """Per-DP-rank values in words (pure): every rank up to :data:`RANKS_LISTED`, else the
    count, median, the 10th-90th percentile spread, the ``worst`` highest ranks and any
    rank without a finite value."""
    fin = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    bad = [k for k in values if k not in fin]
    if len(values) <= RANKS_LISTED:
        return ", ".join(f"rank {k} {v:.4f}" if k in fin else f"rank {k} {v}" for k, v in values.items())
    xs = sorted(fin.values())
    if not xs:
        return f"{len(values)} ranks, none finite"

    def q(p):
        return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]

    top = sorted(fin.items(), key=lambda kv: -kv[1])[:worst]
    return (f"{len(values)} ranks: median {statistics.median(xs):.4f}, 10-90% {q(0.1):.4f}-{q(0.9):.4f}, "
            f"highest " + ", ".join(f"rank {k} {v:.4f}" for k, v in top)
            + (f"; not finite: ranks {', '.join(bad[:8])}" + (" ..." if len(bad) > 8 else "") if bad else ""))


#: how the documents of a bad_data proof were chosen (diagnose, report)
PROOF_CRITERION = "convicted by the proof at the alarm: masking them brought the update back, a control did not"


def _apply_proof(res: dict, proof: dict | None) -> None:
    """The trainer's proof at the alarm (``proof`` of the step's event): ``hardware`` and
    ``bad_data`` are proven causes (no rerun needed; the documents are the convicted ones);
    ``not_data`` rules the data and a transient fault out, ``outlier`` says the data stood
    out and the update was normal with it (the heuristics' cause stays, as evidence)."""
    if not proof:
        return
    v = proof["verdict"]
    res["proof"] = dict(proof)  # the record as the trainer wrote it: every view renders the same one
    heuristic = res["cause"]
    if v == "hardware":
        ranks = ", ".join(map(str, proof.get("dp_ranks", [])))
        res.update(cause="hardware", certainty="proven",
                   certainty_rule=f"proven in step: the step re-executed on the same data and state did not "
                                  f"reproduce it (DP rank(s) {ranks} changed between executions)")
    elif v == "bad_data":
        sus = proof.get("suspect") or {}
        docs = proof.get("documents") or []
        if sus.get("dp_ranks"):  # group testing: the documents' segments lay on these DP ranks
            res["ranks"] = sus["dp_ranks"]
        quarantined = proof.get("applied") in ("masked", "control")
        res.update(cause="bad_data", certainty="proven", rank=sus.get("dp_rank"), rank_from="proof",
                   certainty_rule=("proven in step: masking the convicted data brought the update back to "
                                   "normal; masking as much other data did not"),
                   documents=[{"source": s, "doc": int(d), "dp_rank": sus.get("dp_rank")} for s, d in docs],
                   documents_note=f"convicted by the proof at the alarm ({len(docs)} document(s)), " + (
                       "quarantined by the trainer from the next step on" if quarantined else
                       f"not quarantined ({proof.get('held_back') or 'not applied'}): trained as they were"))
        window = proof.get("window") or {}
        if window.get("cause"):  # the data unmasked, a variant over the window removed the spike as well
            res["fragile"] = (f"proven in process: with the convicted data unmasked, {describe_window(window)}; "
                              f"the data triggered this step in a model its configuration made fragile")
            res["prevention"] = fp.prevention(window["cause"], res.get("fingerprints"))
    elif v in ("not_data", "optimizer_state"):
        if v == "optimizer_state":  # Adam first: the updates recomputed with v restored were that much smaller
            res.update(cause="optimizer_state", certainty="proven",
                       certainty_rule=f"proven in step (no extra forward/backward): {proof.get('why', '')}")
            res["prevention"] = fp.prevention("optimizer_state", res.get("fingerprints"))
        else:
            res["certainty_rule"] = (f"{res['certainty_rule']}; proven in step: reproducible, and not the "
                                     f"suspect's data ({proof.get('why', '')})")
        window = proof.get("window") or {}
        wcause = window.get("cause")
        if wcause and (v == "not_data" or wcause == v):  # the window re-ran from a host snapshot: its cause
            res.update(cause=wcause, certainty="proven",
                       certainty_rule=f"proven in process: {describe_window(window)}")
            if res.get("mechanism") and wcause != "lr":
                res.pop("mechanism")
            if wcause != heuristic:
                res["prevention"] = fp.prevention(wcause, res.get("fingerprints"))
        elif window.get("cause"):  # Adam's state measured in step; in the window another fix removed it
            res["certainty_rule"] += (f"; in the window Adam's own fix did not remove it, {window['cause']}'s did "
                                      f"(proven in process: {describe_window(window)})")
        elif v == "not_data" and heuristic in ("bad_data", "hardware", "transient"):
            res["certainty"] = "guess"
            res["certainty_rule"] += f"; the heuristics' {heuristic} is contradicted by the proof"
    else:  # outlier
        res["certainty_rule"] = (f"{res['certainty_rule']}; proven in step: the suspect data stood out and the "
                                 f"update was normal with it (an outlier, nothing done)")
    if res["cause"] != heuristic:
        res["heuristic"] = heuristic


def note_fragile(res: dict) -> None:
    """Data proven at a step where a configuration fingerprint (F1 Adam's state, F2 the LR's
    scale) also holds: both are findings. The documents triggered the update; the
    configuration made the model that fragile (the real set's LR 0.3 run, no bad data
    planted: documents convicted at steps 126 and 210 while every update moved the
    parameters 6% of their norm). The verdict stays the proof's; ``fragile`` says the rest,
    and ``prevention`` names the configuration's fix."""
    if res.get("mechanism") and res["cause"] not in ("lr", "divergence"):
        res.pop("mechanism")  # the LR's mechanism, and a proof named another cause
    if res["cause"] != "bad_data" or res.get("certainty") != "proven" or "fragile" in res:
        return  # (a window proof said it already, proven)
    hit = {c["question"].split(" ")[0]: c for c in res["checks"] if c["answer"]}
    cause = "optimizer_state" if "F1" in hit else "lr" if "F2" in hit else None
    if cause is None:
        return
    why = (f"Adam's update per unit LR {hit['F1'].get('adam_amplification')}x its pre-spike median" if cause ==
           "optimizer_state" else
           f"the update moved the parameters {hit['F2'].get('relative_update_pre_median', 0):.1%} of their norm a step")
    res["fragile"] = (f"the run's fingerprint says {cause} as well ({why}): the convicted data triggered this "
                      f"step in a model its configuration made fragile")
    res["prevention"] = fp.prevention(cause, res.get("fingerprints"))


def _standout(led: RunLedger, step: int, rank, event, injected: dict, n: int) -> tuple[list[dict], str]:
    """The documents a quarantine may name, and why (not) these: only on a step the
    trainer flagged, never for an injected batch, and only documents that stand out
    against their step (:data:`DOC_CRITERION`), the named rank's first."""
    if injected:
        where = ", ".join(f"DP rank {r} ({k})" for r, k in sorted(injected.items()))
        return [], (f"batch replaced by an injection (--ledger.rehearsal.inject) on {where}: the "
                    f"data ledger's documents there never trained; no documents to quarantine")
    if event is None:
        return [], ("the trainer did not flag this step (no acting rule): no documents are named and "
                    "no quarantine is proposed")
    scores = document_scores(led, step)
    if not scores:
        return [], "the run recorded no per-document losses at this step: no documents to name"
    floor = (led.spike_rules() or {}).get("doc_outlier_floor")  # the run's own rule (no torch)
    why: dict[tuple, str] = {}
    for d in scores:
        if d["vs_median"] >= _doc_standout(floor) or d["vs_median"] <= 1 / _doc_standout(floor):
            why[(d["source"], d["doc"])] = f"{d['vs_median']:.2f}x the step's median document"
    th = Thresholds()
    for side, y, m, rk in (("high", "doc_high_y", "doc_y_median_high", "doc_high_rank"),
                           ("low", "doc_low_y", "doc_y_median_low", "doc_low_rank")):
        yv, mv = event.get(y), event.get(m)
        if not (isinstance(yv, (int, float)) and isinstance(mv, (int, float)) and mv > 0 and yv / mv >= th.doc_extreme):
            continue
        cands = [d for d in scores if event.get(rk) is None or d["dp_rank"] == int(event[rk])]
        if not cands:
            continue
        # the rank's document furthest from the step's median: its own extreme document,
        # or -- when one degenerate document fills the rank and is its median -- that one
        pick = max(cands, key=lambda d: abs(math.log(d["vs_median"])))
        why.setdefault((pick["source"], pick["doc"]),
                       f"DP rank {pick['dp_rank']}'s document furthest from the step's median "
                       f"({pick['vs_median']:.2f}x); the rank's {side} side sat {yv / mv:.1f}x its usual "
                       f"distance from the rank's median (the trainer's statistic)")
    out = [d for d in scores if (d["source"], d["doc"]) in why]
    if not out:
        return [], f"no document stands out against the step ({_doc_criterion(floor)}): nothing to quarantine"
    mine = [d for d in out if rank is None or d["dp_rank"] == rank]
    chosen = (mine or out)[:n]
    return ([dict(d, criterion=_doc_criterion(floor), stands_out=why[(d["source"], d["doc"])]) for d in chosen],
            f"documents that stand out: {_doc_criterion(floor)}")


def _why_noted(note: dict) -> str | None:
    """Why a grad-norm rule's flag stayed a note, from the event's own statistics: the
    move was not past ``grad_novelty`` x the largest this run had shown (spikes.py)."""
    grad = {"zscore_grad_norm", "ratio", "grad_jump"} & set(note.get("notes", []))
    ratio, bound = note.get("grad_jump_ratio"), note.get("grad_jump_bound")
    if not grad or ratio is None or bound is None or ratio > bound:
        return None
    return (f"grad norm {ratio:.2f}x its recent median, under the {bound:.2f}x this run had already "
            f"come within (grad_novelty x its largest remembered move)")


def _certainty(res: dict, event: dict | None, injected: dict) -> tuple[str, str]:
    """How sure the tree's verdict is, and the rule that says so: ``evidence`` when
    the trainer flagged the step with a per-rank/per-document evidence rule and the
    recorded per-rank and per-document data name the same DP rank (bad data); else
    ``guess`` (heuristics on the recorded signals). ``proven`` only comes from a rerun
    (:func:`_apply_rerun`)."""
    cause = res["cause"]
    decided = next((c["question"].split(":")[0] for c in res["checks"] if c["answer"]), None)
    if decided and decided.split(" ")[0] in (res.get("margins") or {}):  # how far past its bar the fingerprint sat
        decided += f", {res['margins'][decided.split(' ')[0]]:.3g}x its bar"
    if event is None:
        noted = res.get("trainer_notes")
        return "guess", (f"heuristics only ({decided or 'no question answered yes'}); the trainer did not "
                         f"flag this step (no acting rule)"
                         + (f"; it recorded a note ({', '.join(noted)}), which never acts" if noted else ""))
    # an acting rule flagged the step; the per-rank/per-document evidence rules count in
    # either tier (a note agreeing with an acting flag is evidence)
    rules = [r for r in (*event.get("rules", []), *event.get("notes", [])) if r in EVIDENCE_RULES]
    bad = cause == "bad_data" or res.get("underlying") == "bad_data"
    if bad and rules:
        named = event.get("suspect_dp_rank")
        docs = res.get("documents") or []
        doc_rank = docs[0]["dp_rank"] if docs else None
        said = f"the trainer's {', '.join(rules)} named DP rank {named}"
        if named is not None and named in injected:
            return "evidence", (f"{said}, the rank whose batch the data ledger records as replaced by an "
                                f"injection ({injected[named]})")
        if named is not None and doc_rank == named:
            d = docs[0]
            return "evidence", (f"{said}, and the recorded per-document losses agree: {d['source']} doc "
                                f"{d['doc']} on that rank at {d['vs_median']:.2f}x the step's median document")
        return "guess", (f"{said}, but the recorded per-document data do not agree"
                         + (f" (the document that stands out is on DP rank {doc_rank})" if doc_rank is not None
                            else " (no document stands out)"))
    return "guess", (f"heuristics only ({decided or 'no question answered yes'}); the trainer flagged the step "
                     f"({', '.join(event.get('rules', []))}) but no evidence rule and per-rank/per-document data "
                     f"agree on a cause")


def _apply_rerun(led: RunLedger, step: int, res: dict) -> None:
    """A rerun's verdict on ``step`` (``<ledger>/rerun/step<T>.json``) decides when it
    proved something: ``proven`` (same reproduced it and a counterfactual removed it,
    or same did not reproduce it: hardware); bad data is proven only by the
    ``quarantine`` variant (only the named documents masked) -- a ``skip`` (or a
    ``swap``) that removes it shows only "something in this step's data" (evidence).
    A rerun that contradicts the step's in-step proof (``format.answers.of_run.contradicts``) does not
    override it: the verdict keeps the proof's cause and says what the rerun claimed."""
    from titan_ledger.format import records
    from titan_ledger.format.answers.of_run import contradicts, rerun_summary

    f = records.rerun_summary_file(led.folder, step)
    summary = rerun_summary(led, step)
    if summary is None:
        return
    vd = summary.get("verdict") or {}
    if not vd.get("proven") and vd.get("certainty") != "evidence":
        if vd.get("cause"):
            res["rerun_verdict"] = {"cause": vd.get("cause"), "proven": False, "file": str(f)}
        return
    heuristic = res["cause"]
    cause, certainty = vd.get("cause"), vd.get("certainty") or "proven"
    by = vd.get("removed_by")
    if cause == "bad_data" and by != "quarantine":
        certainty = "evidence"
    if cause == "hardware":
        rule = "a rerun from the checkpoint (same data, same state) did not reproduce it"
    elif cause == "bad_data" and certainty == "evidence":
        rule = (f"a rerun reproduced it and {by or 'skip'} removed it: something in this step's data "
                f"(not which documents: the quarantine variant names them)")
    else:
        rule = f"a rerun reproduced it and the {by or 'counterfactual'} variant removed it"
    proven = (res.get("proof") or {}).get("verdict")
    if proven is not None and contradicts(proven, cause):
        # the in-step proof re-executed the step itself, its masks against a control; a rerun
        # that skips steps removes their updates (at their LR), not only their data
        res["rerun_verdict"] = {"cause": cause, "proven": False, "removed_by": by, "file": str(f),
                                "contradicts_proof": proven}
        res["certainty_rule"] += (f"; a rerun from the checkpoint says {cause} ({rule}), contradicting the "
                                  f"in-step proof's {proven}: the proof stands (it executed the step again "
                                  f"itself, data masked against a control)")
        return
    if certainty == "evidence" and res.get("certainty") == "evidence" and heuristic == cause:
        rule = res["certainty_rule"] + "; " + rule
    res.update(cause=cause, certainty=certainty, certainty_rule=rule,
               rerun_verdict={"cause": cause, "proven": certainty == "proven", "removed_by": by, "file": str(f)})
    if heuristic != cause:
        res["heuristic"] = heuristic


def extreme_document_rank(led: RunLedger, step: int) -> int | None:
    """The DP rank holding (most tokens of) the document furthest from the step's
    median document, either way; None when the run recorded no document losses."""
    scores = document_scores(led, step)
    return scores[0]["dp_rank"] if scores else None
