"""``python -m titan_ledger.rollback``: plan the PaLM fix for a spike -- roll back, skip.

Design decision: planning is pure (``plan``): from the checkpoints on disk, the
spike step and the run's existing skip windows it picks the last complete
checkpoint at or before ``T - back`` and a skip window of ``--skip`` steps that
starts right after it (PaLM: restart ~100 steps before the spike and skip
200-500 batches from there), and it prints the overrides. Nothing is launched;
``--write FILE`` writes them as a TOML overlay for ``--job.overlay FILE``.
Keep every other flag of the run unchanged: torchtitan restores the LR from the
checkpoint, and a changed ``training.steps`` changes the schedule after it.

Examples::

    python -m titan_ledger.rollback outputs/run --step 137000
    python -m titan_ledger.rollback outputs/run --step 137000 \\
        --back 100 --skip 300 --write rollback.toml
    torchrun ... -m titan_ledger.train --job.config_file X.toml --job.overlay rollback.toml
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from titan_ledger.data.layout import parse_skip_steps
from titan_ledger.errors import LedgerCorrupt, LedgerError, PlanError
from titan_ledger.format import records
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools.cli import ToolParser, add_dump_folder, parse_args, run_tool


def plan(ckpts: list[int], spike_step: int, back: int = 100, skip: int = 200,
         skip_from: int | None = None, existing: list[str] | None = None) -> dict:
    if spike_step < 1:
        raise PlanError("--step must be a 1-indexed step")
    if back < 0 or skip < 1:
        raise PlanError(f"--back must be >= 0 and --skip >= 1 (got --back {back}, --skip {skip})")
    target = spike_step - back
    usable = [c for c in ckpts if c <= target]
    if not usable:
        if not ckpts:
            raise PlanError("no complete checkpoint to roll back to; the run needs --checkpoint.enable")
        raise PlanError(f"no complete checkpoint at or before step {target} (= {spike_step} - "
                        f"--back {back}); the earliest is step {ckpts[0]}. Use a smaller --back")
    load = usable[-1]
    first = skip_from if skip_from is not None else load + 1
    if first <= load:
        raise PlanError(f"--skip-from {first} is not after the checkpoint step {load}")
    last = first + skip - 1
    if not first <= spike_step <= last:
        raise PlanError(f"the skip window {first}-{last} does not contain the spike step "
                        f"{spike_step}; increase --skip or set --skip-from")
    windows = parse_skip_steps(list(existing or []) + [f"{first}-{last}"])
    skip_steps = [f"{a}-{b}" if a != b else str(a) for a, b in windows]
    return {"spike_step": spike_step, "load_step": load, "skip_window": [first, last],
            "skip_steps": skip_steps, "steps_lost": spike_step - load,
            "overrides": ["--checkpoint.load_step", str(load),
                          "--ledger.skip.steps", ",".join(skip_steps)]}


def fitted_plan(ckpts: list[int], spike_step: int, back: int, skip: int, last_step: int,
                existing: list[str] | None = None) -> tuple[dict, list[str]]:
    """The incident page's plan (pure): :func:`plan` with ``back`` and ``skip`` fitted to
    the run -- the checkpoint at or before ``spike_step - back``, else the earliest one
    before the spike (a short run has none 100 steps back); the skip window at most to
    the run's last recorded step (``last_step``) -- and what was fitted, in words. No
    checkpoint before the spike: :class:`PlanError`, as :func:`plan` says it."""
    before = [c for c in ckpts if c < spike_step]
    if not before:
        return plan(ckpts, spike_step, back, skip, existing=existing), []  # raises, naming the fix
    said = []
    load = max((c for c in before if c <= spike_step - back), default=min(before))
    if load > spike_step - back:
        said.append(f"--back {back} would go to step {spike_step - back}: the earliest checkpoint before the spike "
                    f"is step {load}, so --back {spike_step - load}")
    end = max(spike_step, last_step)
    fit = min(skip, end - load)
    if fit < skip:
        said.append(f"--skip {skip} would skip past the run's last recorded step {last_step}: --skip {fit}")
    return plan(ckpts, spike_step, spike_step - load, fit, existing=existing), said


def overlay_toml(p: dict) -> str:
    items = ", ".join(f'"{s}"' for s in p["skip_steps"])
    return (f"# titan_ledger.rollback: spike at step {p['spike_step']}; resume from checkpoint "
            f"step-{p['load_step']},\n# skip steps {p['skip_window'][0]}-{p['skip_window'][1]}. "
            f"Use with --job.overlay; keep every other flag unchanged.\n"
            f"[checkpoint]\nload_step = {p['load_step']}\n\n[ledger.skip]\nsteps = [{items}]\n")


def existing_skips(led: RunLedger) -> list[str]:
    """The skip windows the run already had (from its latest data-ledger header)."""
    try:
        hdr = led.data.header()
    except LedgerCorrupt:
        raise  # a corrupt data ledger is an error, not a run without earlier skips
    except LedgerError:
        return []
    return [f"{a}-{b}" for a, b in hdr.get("skip_steps", [])]


def _already(led: RunLedger, step: int) -> dict | None:
    """What the trainer already did about ``step`` (rolled back, update skipped, or a
    later launch skipped it); None when nothing was done or there is no signals ledger."""
    from titan_ledger.tools.postmortem import actions_at

    if not (led.folder / records.SIGNALS_FILE).exists():
        return None
    f = actions_at(led, step)
    acted = f["rewind"] or f["update_skipped"] or f["now"] == "skipped"
    return f if acted else None


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser.for_tool(__name__, __doc__)
    add_dump_folder(ap)
    ap.add_argument("--step", required=True, type=int, help="the spike's step (as lookup, diagnose and report take it)")
    ap.add_argument("--back", type=int, default=100, help="roll back to a checkpoint at or before T - back")
    ap.add_argument("--skip", type=int, default=200, help="steps (global batches) to skip")
    ap.add_argument("--skip-from", type=int, help="first skipped step (default: right after the checkpoint)")
    ap.add_argument("--checkpoint-folder", default="checkpoint")
    ap.add_argument("--write", type=Path, help="write the overrides as a TOML overlay")
    ap.add_argument("--json", action="store_true")
    old = "--spike" + "-step"  # (the old spelling, refused with the new one's name)
    given = sys.argv[1:] if argv is None else argv
    if any(x == old or x.startswith(old + "=") for x in given):
        ap.error(f"{old} is now --step (one name across the tools: lookup, diagnose, report, rollback)")
    a = parse_args(ap, argv)
    return run_tool("titan_ledger.rollback", lambda: _main(a))


def _main(a) -> int:
    led = RunLedger(a.dump_folder, a.ledger_folder, a.checkpoint_folder)
    ckpts = led.checkpoints()
    if not ckpts:
        raise PlanError(f"{led.dump_folder / a.checkpoint_folder}: no complete checkpoint "
                        f"(step-N/.metadata); the run needs --checkpoint.enable to be rolled back")
    if a.write is not None and not a.write.parent.is_dir():
        raise PlanError(f"--write {a.write}: folder {a.write.parent} does not exist; create it first")
    if (led.folder / records.SIGNALS_FILE).exists():
        last = led.last_signal_step(windows=True) or 0  # the newest rows only, not the history
        if a.step > last:
            raise PlanError(f"--step {a.step} is after the last recorded step {last} of "
                            f"{led.folder / records.SIGNALS_FILE}; give the step the spike happened at")
    done = _already(led, a.step)
    p = plan(ckpts, a.step, a.back, a.skip, a.skip_from, existing_skips(led))
    if done is not None:
        p["already"] = done
    if a.write:
        a.write.write_text(overlay_toml(p))
        p["overlay"] = str(a.write)
    if a.json:
        print(json.dumps(p))
        return 0
    if done is not None:
        what = ("already rolled back in process" if done["rewind"] else
                "its update already skipped by the trainer" if done["update_skipped"] else "already handled")
        print(f"step {a.step}: {what}: {done['summary']}\n"
              f"(the plan below is for a relaunch that rolls back further or skips more)")
    print(f"spike at step {p['spike_step']}: resume from checkpoint step-{p['load_step']} "
          f"({p['steps_lost']} steps back), skip steps {p['skip_window'][0]}-{p['skip_window'][1]}")
    print("relaunch the same command with:\n  " + " ".join(
        f'"{x}"' if "," in x else x for x in p["overrides"]))
    if a.write:
        print(f"or with: --job.overlay {a.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
