"""``python -m titan_ledger.diagnose``: name the likely cause of each loss spike.

Design decision: the design article's decision tree (§2.7), walked in its order
-- the cause whose fingerprint is most distinctive and earliest visible first --
over the signals ledger alone, printing the numbers that decided each question
so a human can overrule it. Pure functions over ledger rows (``classify``, in
:mod:`titan_ledger.tools.decision`); the CLI only reads files. Thresholds are
the article's where it gives one (grad norm 3x, logit ~100) and stated constants
otherwise (``Thresholds``).

The questions, in order:

  Q0 divergence      loss non-finite, or it stays above the pre-spike level afterwards
  F1 optimizer_state Adam's update per unit LR (update_norm / lr: scale-free while the
                     second moment tracks the gradient) >= 5x its pre-spike median, after
                     gradients <= 0.1x the run's first steps' (the second moment lagging)
  F2 lr              the update moves the parameters >= 1% of their norm a step (the
                     pre-spike median of update_norm / param_norm): the LR too large for
                     the model's scale; the schedule's position is reported with it
  F3 output_logits   log Z's max before the spike >= 2x the run's first steps' and >= 20
  Q1 logit_growth    max attention logit rising before the spike and is >= ~100
                     (in a run that computes in bf16 this names bf16: §2.4's danger
                     level is where bf16 rounds the scores; the fp32 rerun decides)
  Q2 lr              the LR at the spike >= 2x its pre-spike median (a jump: read, not
                     inferred), or param norm growth accelerated and grad norm crept up
  Q3 bad_data        one DP rank's loss far above the average, or the trainer's
                     per-rank / per-document evidence rules fired, or a finite grad-norm
                     jump with a document >= 3x its usual distance from its rank's median
                     (names the rank holding the most extreme document)
  Q4 optimizer_state a grad-norm plateau below normal just before the spike
  Q5 bf16            a one-step jump that falls right back, with num_zeros off its norm,
                     in a run that computes in bf16
  Q6 hardware        a one-step grad-norm jump (>= 4x, or non-finite) that falls right
                     back with the loss unmoved, in an fp32 run: nothing in the
                     recorded state explains it (the rerun's `same` proves it)
  else transient

F1-F3 read what the ledger records beyond the article's proxies (``--ledger.update_norm``
for F1/F2; log Z when the loss is titan_ledger's; :mod:`titan_ledger.components.detection.fingerprints`)
and are asked first; a question that cannot be read (no update norm recorded) answers no.
When F2 names the LR and Q1 also holds, the logits are printed as its ``mechanism``. Every
verdict on a configuration cause names its ``prevention`` with the flags that set it (the
LR computed from the run's own update sizes; QK-norm; beta2 0.95; fp32 master weights;
z-loss 1e-4), and data proven in step in a run whose F1/F2 fingerprint holds says so
(``also``: the configuration made the model fragile).

Every verdict carries its certainty (``incident.judge``; ``report`` prints the same one):
proven (a rerun reproduced and removed it; bad data only by the ``quarantine`` variant),
evidence (the trainer's evidence rule and the recorded per-document data agree; or a
``skip`` rerun removed it), guess (heuristics only); and what was done about the step
(update skipped, rolled back to C and A-B skipped, what followed). A step a rollback undid
is judged on the history as it stood when the trainer decided.

Examples::

    python -m titan_ledger.diagnose outputs/debug_cpu
    python -m titan_ledger.diagnose --dump-folder outputs/debug_cpu --step 137000 --json
    # prove the cause: rerun from the last checkpoint before each spike (titan_ledger.tools.rerun)
    python -m titan_ledger.diagnose outputs/debug_cpu --rerun -- --job.config_file X.toml <the run's flags>
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from titan_ledger.errors import LedgerError
from titan_ledger.format import records
from titan_ledger.format.answers import render
from titan_ledger.format.answers.episodes import Episode, episode_of
from titan_ledger.format.answers.of_run import RunAnswers
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools.cli import ToolParser, add_dump_folder, parse_args, run_tool

# the decision tree (pure); importing it chooses the device backend before torchtitan
# loads (--rerun parses training configs in this process)
from titan_ledger.tools.decision import Thresholds, rules_of, spike_check, spike_steps
from titan_ledger.tools.incident import document_scores, judge, rank_phrase, rank_summary


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser.for_tool(__name__, __doc__, epilog=__doc__.split("\n\n", 1)[1])
    add_dump_folder(ap)
    ap.add_argument("--step", type=int, help="diagnose this step (default: every detected spike)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-quarantine", metavar="FILE",
                    help="write the documents named by bad_data verdicts, one JSON object per line "
                         "({\"source\", \"doc\"}), for --ledger.filter.quarantine FILE")
    ap.add_argument("--rerun", action="store_true",  # ADDED (--rerun): titan_ledger.tools.rerun
                    help="prove the cause. Without --step: every episode's fix, over the episode's horizon -- "
                         "each candidate fix relaunched as its command would relaunch it, from the checkpoint "
                         "before the onset (or from scratch) to the horizon's end, judged against the run itself "
                         "by its own rules and its loss; the budget is printed first, what was measured is recorded "
                         "(ledger/episodes.jsonl) and every view shows it (titan_ledger.tools.episode_proof). "
                         "With --step: "
                         "rerun the steps before the spike from a checkpoint under "
                         "the variants the verdict calls for (titan_ledger.tools.rerun.PLAN_FOR: bad_data: same, "
                         "quarantine (only the named documents masked: proves it), skip over the named "
                         "documents' steps (\"something in this step\"); lr: same, lr undoing the jump; "
                         "optimizer_state: same, beta2=0.95, eps=1e-6; bf16: same, fp32; logit_growth: "
                         "same, fp32, logit_cap, qk_clip (the fix a run can keep); else same), escalating through the other "
                         "counterfactuals when they leave the spike unexplained; the original run's "
                         "training flags after `--` (default: the launch the ledger records, when it "
                         "records its flags; flags given are checked against it)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="--rerun: processes per rerun (default: the world size the ledger records)")
    ap.add_argument("--rerun-after", type=int, default=1, help="--rerun: steps after the spike to train")
    ap.add_argument("--parallel", type=int, default=1,
                    help="--rerun of episodes: relaunches at once (each on the run's world size of processes)")
    ap.add_argument("--rerun-max-steps", type=int, default=200,
                    help="--rerun: refuse when the reruns need more training steps than this")
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    a = parse_args(ap, argv[:argv.index("--")] if "--" in argv else argv)
    if train_args and not a.rerun:
        ap.error("training flags after `--` are for --rerun")
    a.train_args = train_args
    return run_tool("titan_ledger.diagnose", lambda: _main(a))


def _main(a) -> int:
    led = RunLedger(a.dump_folder, a.ledger_folder)
    path = led.folder / records.SIGNALS_FILE
    if a.step is None and not led.trained_rows():  # (--step: judge names a step it cannot judge)
        raise LedgerError(f"{path}: no trained step recorded (the run died before its first "
                          f"step completed, or every step was skipped)")
    episodes = _episodes(a, led) if a.step is None else None  # the run's answer first
    led = RunLedger(a.dump_folder, a.ledger_folder)  # (read again: a proof wrote to it)
    steps = [a.step] if a.step is not None else acted_steps(led)
    results = []
    ra = RunAnswers(led)
    eps_all = episodes if episodes is not None else (ra.episodes() if a.step is not None else [])
    for s in steps:
        res = judge(led, s)  # the one verdict (report calls it too)
        ep = episode_of(eps_all, s)
        if ep is not None:  # the incident's own answer, and the episode it belongs to
            res["episode"] = ep.to_json()
        if a.step is not None:
            # the trainer's own flags (its event log, small) when it ran the rules, else the
            # default rules offline over the whole history (a run with detection off)
            ran = (led.folder / records.SPIKES_FILE).exists()
            flagged = set(led.spike_steps()) if ran else set(spike_steps(led))
            hist = led.history_at(s, Thresholds().pre, 0)
            res["spike_check"] = spike_check(hist[0] if hist else [], s, s in flagged, det=rules_of(led))
        if not offers_documents(res):  # the answer ruled the data out: no suspects, no quarantine offered
            res.pop("documents", None)
        if res.get("documents"):
            res["documents"] = with_text(led, res["documents"])
        if res.get("documents") and not res["documents"][0].get("proven"):  # (proven: quarantined already)
            res["quarantine_command"] = (
                f"python -m titan_ledger.diagnose {a.dump_folder} --step {s} --write-quarantine "
                f"{records.QUARANTINE_FILE}  # then resume with --ledger.filter.quarantine "
                f"{records.QUARANTINE_FILE}")
        results.append(res)
    if a.write_quarantine:
        docs = {(d["source"], d["doc"]) for r in results if offers_documents(r) for d in r.get("documents", [])}
        if not docs:
            raise LedgerError(f"--write-quarantine {a.write_quarantine}: no bad_data verdict named a "
                              f"document (nothing written)")
        write_quarantine(a.write_quarantine, sorted(docs))
    if getattr(a, "rerun", False) and a.step is not None:  # ADDED (--rerun): the step, rerun from a checkpoint
        from titan_ledger.tools import rerun
        from titan_ledger.tools.recorded import launch_args

        train_args, nproc = launch_args(a.dump_folder, a.train_args, a.nproc, ledger_folder=a.ledger_folder,
                                        what="diagnose --rerun")
        rerun.for_diagnosis(a.dump_folder, results, train_args, nproc=nproc, after=a.rerun_after,
                            max_steps=a.rerun_max_steps, ledger_folder=a.ledger_folder,
                            log=(lambda m: print(m, file=sys.stderr)) if a.json else print)
        led = RunLedger(a.dump_folder, a.ledger_folder)
        for i, res in enumerate(results):  # the verdict again, now with the reruns' proof
            again = judge(led, res["step"])
            results[i] = {**again, **{k: res[k] for k in ("rerun", "spike_check", "documents",
                                                           "quarantine_command") if k in res}}
    if a.json:
        print(json.dumps({**({"episodes": [e.to_json() for e in episodes]} if episodes is not None else {}),
                          "spikes": results, "thresholds": asdict(Thresholds()),
                          "notes": [{"step": int(e["step"]), "notes": e["notes"]} for e in led.note_events()]}))
        return 0
    if episodes is not None:
        print("\n".join(render.episodes_block(episodes)))
        if results:
            print(f"\nincidents: {len(results)} (each one's own answer; its episode above)")
    if not results:
        print(no_spikes(led))
    for r in results:
        sc = r.get("spike_check")
        if sc is not None and not sc["is_spike"] and not r.get("stall"):
            print(f"step {r['step']}: NOT A SPIKE: no spike rule fires and the trainer did not flag it: "
                  f"grad norm {sc['grad_norm_vs_median']}x the median of the {sc['pre_steps']} steps "
                  f"before (ratio rule needs > {sc['ratio_needs']}x), loss {sc['loss_vs_median']}x "
                  f"(needs > {sc['loss_jump_needs']}x), z-scores loss {sc['loss_zscore']} / grad norm "
                  f"{sc['grad_norm_zscore']} (need > {sc['zscore_needs']}). The tree below describes "
                  f"an ordinary step; its cause is not a finding.")
        print_verdict(r)
        if r.get("rerun"):  # ADDED (--rerun)
            from titan_ledger.tools.rerun import print_report

            print_report(r["rerun"])
    if results and a.step is None and _notes_line(led):
        print(_notes_line(led).strip())
    if a.write_quarantine:
        print(f"wrote {a.write_quarantine}")
    return 0


def _episodes(a, led: RunLedger) -> list[Episode]:
    """The run's episodes (format.answers.episodes); with ``--rerun``, each proven over its
    horizon first (tools/episode_proof.py)."""
    if not getattr(a, "rerun", False):
        return RunAnswers(led).episodes()
    from titan_ledger.tools.episode_proof import prove_run

    return prove_run(led, parallel=a.parallel, max_steps=a.rerun_max_steps,
                     log=(lambda m: print(m, file=sys.stderr)) if a.json else print)


def offers_documents(res: dict) -> bool:
    """Whether the verdict may name documents and offer their quarantine: the answer
    convicted data (a proof, a rerun), or nothing established a cause and the tree reads
    bad data (a suspect to prove). Never after a proof or window that ruled the data out
    (``not_data``, ``optimizer_state``, a configuration cause)."""
    a = res.get("answer")
    if a is None or a.get("established") == "none":
        return (res.get("tree") or {}).get("cause", res.get("cause")) == "bad_data" or res.get("cause") == "bad_data"
    return a.get("cause") == "bad_data"


def print_verdict(r: dict) -> None:
    """One verdict as text: the answer first (three short lines: what and why, the fix, what
    was done), its detail (how, every fix tried, the command), then the decision tree's
    reading (a candidate, never the answer), the flag, the per-rank losses, the tree's
    questions with their numbers, and the documents and quarantine command when the answer
    allows them."""
    from titan_ledger.format.answers import Answer, Fix, render, times

    a = Answer.of(r["answer"]) if r.get("answer") else None
    reading = [Fix.of(f) for f in r.get("reading") or []]  # the tree's candidates, beside the answer
    rewound = "   [judged on the history as it stood when the step ran]" if r.get("rewound") else ""
    if a is not None:
        lines = render.lines(a, reading)
        print(lines[0] + rewound)
        for line in lines[1:] + render.detail(a, reading):
            print(line)
        if r.get("episode"):
            print(f"  episode: {render.episode_head(Episode.of(r['episode']))}")
    else:
        print(f"step {r['step']}: not an incident: the trainer did not flag it{rewound}")
    tree = r.get("tree") or {"cause": r.get("cause"), "certainty": r.get("certainty"), "rule": r.get("certainty_rule")}
    extra = rank_phrase({**r, "cause": tree["cause"]}) if tree["cause"] == "bad_data" else ""
    extra += f" (mechanism: {r['mechanism']})" if r.get("mechanism") else ""
    print(f"  the decision tree (heuristics over the signals; a candidate, never the answer): {tree['cause']}{extra} "
          f"-- {tree['certainty']}: {tree.get('rule')}; grad norm {times(r['grad_norm_ratio'])} its pre-spike median")
    if r.get("stall"):
        from titan_ledger.components.detection.stall import describe_stall

        print(f"  stall: {describe_stall({'step': r['step'], 'stall': r['stall']})}")
    t = r.get("trainer")
    if t:
        named = f", suspect DP rank {t['suspect_dp_rank']}" if t.get("suspect_dp_rank") is not None else ""
        notes = f"; notes {', '.join(t['notes'])}" if t.get("notes") else ""
        print(f"  trainer: rules {', '.join(t.get('rules', []))}{notes}{named}; on_spike {t.get('action')}")
    elif r.get("trainer_notes"):
        print(f"  trainer: not flagged; a note ({', '.join(r['trainer_notes'])}): recorded, never acted on")
        if r.get("trainer_notes_why"):
            print(f"    why a note: {r['trainer_notes_why']}")
    print(f"  recorded actions: {r['done']}")
    if r.get("rank_losses"):
        print("  per-rank losses at the step: " + rank_summary(r["rank_losses"]))
    for c in r["checks"]:
        nums = ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("question", "answer"))
        print(f"  {'YES' if c['answer'] else 'no ':<4}{c['question']}\n        {nums}")
    if r.get("documents"):
        print(f"  documents that stand out ({r['documents'][0]['criterion']}):")
        for d in r["documents"]:
            if "loss" not in d:  # a convicted document without a recorded loss
                print(f"    {d['source']} doc {d['doc']} (DP rank {d['dp_rank']})")
                continue
            print(f"    {d['source']} doc {d['doc']} (DP rank {d['dp_rank']}, {d['segments']} segment(s), e.g. "
                  f"[{d['start']}:{d['end']}))  loss {d['loss']:.4f} = {d['vs_median']:.2f}x median over "
                  f"{d['tokens']} tokens")
            if d.get("stands_out"):
                print(f"      stands out: {d['stands_out']}")
            if d.get("text"):
                print(f"      {d['text'][:160]!r}")
    elif r.get("documents_note") and offers_documents(r):
        print(f"  documents: {r['documents_note']}")
    if r.get("quarantine_command"):
        print(f"  quarantine: {r['quarantine_command']}")


def acted_steps(led: RunLedger) -> list[int]:
    """Every step the trainer flagged or acted on (spike events, update skips,
    rollbacks: later rewound or skipped ones included), else the default rules run
    offline (:func:`spike_steps`)."""
    steps = set(led.spike_steps()) | {int(r["step"]) for r in led.rewinds()}
    steps |= {int(r["step"]) for r in led.ladder_actions()}
    steps |= {int(e["step"]) for e in led.response_events() if e.get("stall")}  # a stall: no spike, a finding
    steps |= {int(r["step"]) for r in led.signal_rows() if r.get("update_skipped")}
    return sorted(steps) or spike_steps(led)


def offending_documents(led: RunLedger, step: int, rank: int | None, n: int = 3) -> list[dict]:
    """Up to ``n`` distinct documents of ``rank`` (every rank's when it holds none)
    furthest from the step's median document, either way, with a text excerpt; []
    when the run recorded none. (A verdict names only those that stand out:
    :func:`titan_ledger.tools.incident.judge`.)"""
    scores = document_scores(led, step)
    mine = [d for d in scores if rank is None or d["dp_rank"] == rank] or scores
    return with_text(led, mine[:n])


def with_text(led: RunLedger, docs: list[dict]) -> list[dict]:
    """The documents with a text excerpt each (``text``, or ``text_error``)."""
    out = []
    text = None
    for d in docs:
        d = dict(d)
        try:
            from titan_ledger.tools.lookup import TextSource

            text = text or TextSource(led.data)
            d["text"] = text.text(d["source"], d["doc"], d["start"], d["end"]).replace("\n", " ")
        except Exception as e:
            d["text_error"] = f"{type(e).__name__}: {e}"
        out.append(d)
    return out


def no_spikes(led: RunLedger) -> str:
    """"no spikes detected", with what was judged: the trained steps, who looked (the
    trainer's spikes.jsonl, the default rules offline) and which rules had the history
    they need (``SpikeDetector.Config``: min_history, window / 2) -- a short run is not
    a clean one."""
    from titan_ledger.components.detection.spikes import SpikeDetector

    cfg, rows = SpikeDetector.Config(), led.trained_rows()
    n, first, last = len(rows), rows[0]["step"], rows[-1]["step"]

    def judged(after: int) -> str:  # a rule judges a step once `after` accepted steps precede it
        return f"judged steps {rows[after]['step']}-{last}" if n > after else f"judged none of the {n}"

    who = (f"the trainer flagged none ({records.SPIKES_FILE})" if (led.folder / records.SPIKES_FILE).exists()
           else f"the run recorded no spike events (no {records.SPIKES_FILE})")
    return (f"no spikes detected in {n} trained steps ({first}-{last}): {who}, and the default rules "
            f"run offline over {records.SIGNALS_FILE} fire on none.\n  history the rules had: ratio (grad norm > "
            f"{cfg.ratio}x its median, loss > {1 + cfg.loss_jump:g}x its recent median) and grad jump (> {cfg.grad_jump}x) "
            f"need {cfg.min_history} steps: {judged(cfg.min_history)}; z-score (> {cfg.zscore} std) "
            f"needs {cfg.window // 2} (window {cfg.window} / 2): {judged(cfg.window // 2)}; non-finite "
            f"loss or grad norm: every step; rank separation and document outliers: only the trainer "
            f"(per-rank data). Give --step T for one step's numbers."
            + _notes_line(led))


def _notes_line(led: RunLedger) -> str:
    notes = led.note_events()
    if not notes:
        return ""
    steps = [int(e["step"]) for e in notes]
    shown = ", ".join(map(str, steps[:10])) + (f" (+{len(steps) - 10})" if len(steps) > 10 else "")
    return (f"\n  notes (weaker evidence, recorded and never acted on): {len(steps)} step(s): {shown}; "
            f"--step T explains one")


def write_quarantine(path: str, docs: list[tuple[str, int]]) -> None:
    """``{"source", "doc"}`` per line, the format ``--ledger.filter.quarantine`` reads; appends."""
    with open(path, "a") as f:
        for source, doc in docs:
            f.write(json.dumps({"source": source, "doc": doc}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
