"""``replay rerun``: re-execute the steps before a spike from a checkpoint, under counterfactual variants.

The design article's self-test: replay the batch at the same consumed-samples
position -- bad data reproduces, a bf16 or hardware glitch does not. A rerun
loads checkpoint C (default: the last complete one at or before T-1), trains
C+1 ... T+N again with the recorded data (the data position is in the
checkpoint; the sample ids are checked against the original's data ledger) in
its own folder ``<dump>/rerun/<variant>/`` (the checkpoint step-C is a symlink
to the original's, so the run's own ledgers and checkpoints are never touched),
and compares every step with the original ledger: each signal's relative
difference, and whether it is bit-equal. The verdict and each variant's numbers
at T are kept in ``<dump>/<ledger>/rerun/step<T>.json`` (one JSON line; the
incident page of ``titan_ledger.report`` shows it).

Variants (``--variant``, repeatable; a counterfactual changes one thing):

  same        nothing (reproducibility)
  skip        step T's data consumed without training (``--ledger.skip.steps T``); from
              ``diagnose --rerun``, every step of the window whose rows hold the
              documents the verdict named (a planted document spans several steps).
              A skip that removes a reproduced spike is followed at once by its
              same-size control (``control:skip=...``, :func:`.plan.skip_control`): as
              many OTHER trained steps before T skipped instead, the nearest first. A
              skip removes its steps' updates (and, the LR frozen over them, holds back
              every later step's LR), not only their data; the data is convicted only
              when the control leaves the spike (none fits the window: not convicted)
  lr=X        the learning rate scaled by X over the window (the checkpoint restores
              the optimizer's param-group LR and torchtitan rebuilds the scheduler's
              base LR from the config, so a plain ``--optimizer.lr`` would only act
              from the second step; ``--ledger.rehearsal.rerun lr_scale=X`` scales both right
              after the load; the rows' ``lr`` shows it)
  eps=X       Adam epsilon (the checkpoint restores the param groups' eps, so it is
              overridden after the load the same way: ``--ledger.rehearsal.rerun eps=X``)
  beta2=X     Adam beta2 from the load on, each parameter's bias-corrected second
              moment kept (``--ledger.rehearsal.rerun beta2=X``): does v lagging the gradients
              make the spike? "not applicable" when the run's beta2 is <= X
  clip=X      ``--training.max_norm X``
  logit_cap=X every attention score soft-capped at X (``X * tanh(s / X)``, Gemma 2's
              softcap) over the window (``--ledger.rehearsal.rerun logit_cap=X``): does the
              spike need the attention logits to reach their level?
  qk_clip=X   QK-clip at threshold X from the load on (``--qk_clip.enable
              --qk_clip.threshold X``): the Q/K rows of heads whose max logit passed X
              scaled back after each update -- the prevention the run can keep
  zloss=X     the z-loss at weight X over the window (``--loss.z_loss_weight X``; PaLM's
              1e-4): does the spike need the output logits' log Z to drift? (cause
              ``output_logits``; never in the escalation: ask for it)
  quarantine  only the documents the verdict names masked (``--ledger.filter.quarantine``
              with a file the rerun writes into its folder), the rest of the batch
              trained: the sharp counterfactual -- the one that PROVES bad data (a bare
              ``quarantine`` takes the documents that stand out at a flagged step,
              ``incident.judge``; ``quarantine=SOURCE:DOC,...`` names them; none named,
              e.g. an injected batch: not applicable). A quarantine that removes a
              reproduced spike is followed at once by its same-size control
              (``control:quarantine=...``, :func:`.plan.quarantine_control`: other
              documents of the same steps, as many tokens); the documents are convicted
              only when the control leaves the spike
  swap        step T's batches rotated across DP ranks (``--ledger.rehearsal.inject T:0:swap``:
              DP rank r trains on rank (r+1) % dp's batch): does the anomaly (the
              spike event's suspect DP rank, else ``loss_max_rank``) follow the data
              to rank r-1 (bad_data) or stay on its rank (a rank-local fault)?
  fp32        ``--training.mixed_precision_param float32`` where the run computed in
              bf16 (FSDP2's param dtype; also on the CPU backend); "not applicable"
              for fp32 runs (no launch)

The rerun keeps ``--training.steps`` (the LR schedule depends on it) and stops after
T+N with ``--ledger.rehearsal.rerun stop=T+N``; it writes no checkpoint of its own
(``--checkpoint.interval`` is set past the end). ``--ledger.rehearsal.inject`` data kinds
(repeat/random: they *are* the run's data) are kept; ``bitflip`` (a hardware
fault, :mod:`titan_ledger.rehearsal.faults`) is dropped, so it is not reproduced.

"Spike present at T" in a rerun: its signals at T equal the original's (bit-equal
or within ``REL_TOL``: the original's numbers are the spike, whether or not a rule
flagged T), or its trainer flagged T (spikes.jsonl), or its grad norm at T is
within ``GRAD_TOL`` (10%) of the original's and at least ``MIN_RATIO`` (2x) the
original's median grad norm over the 50 trained steps before T, or (a loss spike
without a grad-norm one, as the loss climbing after an LR jump) the original's loss
at T is >= 5% over its pre-spike median and the rerun keeps half that excess
(``loss_like``). Under ``skip`` step T does not train; the spike counts as present
there when any later step of the window is flagged or meets the grad or loss test.

Verdict: not reproduced under ``same`` -> ``hardware`` (non-determinism or a
hardware fault: the rerun saw the same data from the same state); reproduced
under ``same`` -> deterministic, and the first counterfactual that removes it names
the cause: ``quarantine`` -> bad_data (proven), ``skip`` -> bad_data (certainty
``evidence`` only: "something in this step's data"; and only when its control kept the
spike), ``lr`` -> lr, ``fp32`` -> bf16, ``beta2`` / ``eps``
-> optimizer_state, ``logit_cap`` / ``qk_clip`` -> logit_growth, ``clip`` -> clip, ``zloss`` -> output_logits. None removes it ->
``unproven``. A step T that is no spike in the original (not flagged, and neither the
grad nor the loss test holds for its own numbers) -> ``unproven`` with ``not_a_spike``:
a counterfactual cannot remove what is not there (``skip`` would look like a cure).

``diagnose --rerun`` first runs the variants its heuristic verdict calls for
(:data:`PLAN_FOR`); when the spike reproduces under ``same`` and none of them
removes it, it escalates through the other counterfactuals (:data:`ESCALATION`,
most specific first, ``lr`` last because a lower LR damps almost any spike) until
one removes it or the step budget is spent: a wrong heuristic costs reruns, not
the verdict.

Determinism: on CPU with gloo the debug run is bit-deterministic (two ``same``
reruns and a ``same`` rerun against the original give bit-equal signals at every
step; ``tests/e2e/test_rerun_e2e.py``). On GPU, pass torchtitan's
``--debug.deterministic`` to the original run (and so to the rerun); without it,
cuBLAS/NCCL reductions differ in the last bits and signals are compared with the
relative tolerance ``REL_TOL`` (1e-3): a step is "equal within tolerance" when
every signal's relative difference is at most that.

Examples::

    python -m titan_ledger.replay rerun --dump-folder /tmp/a --step 8 --variant same --variant skip \\
        -- --job.config_file train_configs/debug_cpu.toml --training.steps 12 --checkpoint.enable \\
        --checkpoint.interval 4 --ledger.spike.window 8 --ledger.rehearsal.inject 8:1:repeat
    python -m titan_ledger.replay rerun --dump-folder /tmp/a --step 8 --from 4 --after 2 \\
        --variant lr=0.5 --variant eps=1e-6 --json -- <the original run's training flags>

Design decision: one module per concern, each importing only the ones below it
(no cycles, enforced by import-linter): :mod:`.report` (formatting, the printed
table), :mod:`.variants` (what a counterfactual is: parsing, values from the ledger,
its training flags; the cause each proves), :mod:`.plan` (checkpoint and window,
the original's flags, a variant made concrete for one spike), :mod:`.comparison`
(a finished rerun against the original, step by step: is the spike present),
:mod:`.verdicts` (the cause the comparisons prove) and :mod:`.run` (the subprocess
side: launching, reusing, the summary file, and ``diagnose --rerun``). The decision
tree's numbers come from :mod:`titan_ledger.tools.decision`, the launches from
:mod:`titan_ledger.tools.runs`; this package re-exports the public names.
"""

from __future__ import annotations

# the modules are named ``comparison`` and ``verdicts``, not ``compare`` / ``verdict``:
# re-exported functions of those names would hide them (rerun.compare is the function)
from titan_ledger.tools.rerun.comparison import (
    GRAD_TOL,
    KEYS,
    LOSS_EXCESS,
    LOSS_KEPT,
    MIN_RATIO,
    REL_TOL,
    VariantResult,
    compare,
    compare_rows,
    loss_like,
    pre_median,
    rel_diff,
    same_numbers,
    spike_like,
)
from titan_ledger.tools.rerun.plan import Plan, checkpoints_of, make_plan, resolve_variant, strip_train_args
from titan_ledger.tools.rerun.report import print_report
from titan_ledger.tools.rerun.run import HUGE_INTERVAL, for_diagnosis, prepare, rerun, run_variant, write_summary
from titan_ledger.tools.rerun.variants import (
    CAUSE_OF,
    CAUSES,
    ESCALATION,
    PLAN_FOR,
    PRE,
    RerunError,
    Variant,
    ledger_values,
    parse_variant,
    variant_args,
    write_quarantine,
)
from titan_ledger.tools.rerun.verdicts import verdict

__all__ = [
    # variants
    "CAUSES", "CAUSE_OF", "ESCALATION", "PLAN_FOR", "PRE", "RerunError", "Variant", "ledger_values",
    "parse_variant", "variant_args", "write_quarantine",
    # plan
    "Plan", "checkpoints_of", "make_plan", "resolve_variant", "strip_train_args",
    # comparison
    "GRAD_TOL", "KEYS", "LOSS_EXCESS", "LOSS_KEPT", "MIN_RATIO", "REL_TOL", "VariantResult", "compare",
    "compare_rows", "loss_like", "pre_median", "rel_diff", "same_numbers", "spike_like",
    # verdicts
    "verdict",
    # run
    "HUGE_INTERVAL", "for_diagnosis", "prepare", "rerun", "run_variant", "write_summary",
    # report
    "print_report",
]
