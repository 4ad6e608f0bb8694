"""Spike zoo (issue 14): spikes produced for real, and how often ``diagnose`` names their cause.

    python bench/zoo.py [--only NAME ...] [--set tuned|held_out|controls|sharp|attempted|smoke|all] [--json] [--folder DIR]
                        [--prove off|acting|all]

Design decision: every spike here comes out of a real training run of the
``debug_cpu`` model (llama3 debug, FSDP over 2 gloo ranks, 4 rows x 256 tokens per
rank, an indexed corpus read in order, checkpoints every 10 steps) whose
configuration or data carries one cause; nothing is drawn or written into a
ledger by hand. Each scenario is then judged twice: ``diagnose --json`` (the
heuristic decision tree over the ledger) and ``diagnose --rerun --json`` (reruns
from the last checkpoint before the flagged step under the counterfactuals,
:mod:`titan_ledger.tools.rerun`). Truth is what the scenario planted, read back from the
run's own ledger where it can be (the step whose rows hold the planted document).

The scenarios (``true_cause`` as ``diagnose`` prints it), in three sets:

* tuned (the thresholds were fitted on these, in two rounds):
  ``bad_data_repeat`` / ``bad_data_ngram`` -- ONE degenerate document (one token
  repeated 1200 times; a 3-word phrase 400 times) planted in the prepared corpus
  where the sequential order reaches it at about step 28 / 36 (no runtime injection;
  the true step is the first step whose data ledger lists it); ``lr`` -- relaunched
  from the step-20 checkpoint with ``--optimizer.lr`` 30x (a mistyped relaunch; the
  true step is the first the ledger shows at >= 2x the LR of the step before);
  ``hardware`` -- ``--ledger.rehearsal.inject 28:0:bitflip`` (one exponent bit of one gradient
  element, once; :mod:`titan_ledger.rehearsal.faults`). Round 2 added the first held-out round
  after it was run once: ``bad_data_chars`` (4000 ``=``, step 33),
  ``bad_data_repeat_late`` (another token, step 45), ``lr_x20`` (20x from step 30),
  ``hardware_rank1`` (step 33, DP rank 1).
* held_out (round 2, run once after every threshold was fixed): ``bad_data_ngram_b``
  (another phrase, step 40), ``bad_data_repeat_b`` (another token, step 30),
  ``lr_x10`` (10x from step 20), ``hardware_step38``.
* controls, the runs without their fault: ``clean`` (the corpus without a planted
  document, default flags, 55 steps) and ``clean_lr`` (the LR scenario's relaunch at
  step 20 with the LR unchanged).
* sharp (``--set sharp``; not in ``all``): the same model on a synthetic copy corpus
  (``copy_documents``: each document one random 8-word phrase repeated to 256 tokens),
  which it learns from loss 8 to about 1 by step 150 at LR 3e-3, attention doing the
  copying; ``lr_sharp`` relaunches at step 150 with 3x the LR, ``clean_sharp`` relaunches
  unchanged. Built to see whether a sharper model lets the missing causes bite; run once,
  nothing tuned on it (README: what it showed).
* attempted (``--set attempted``; not in ``all``): ``bad_data_random`` (1500 random
  characters at step 60), ``logit_growth`` (no QK-norm, LR warmed up to 3e-2 over 80
  steps, fp32), ``precision`` (the same in bf16) and ``optimizer_state`` (beta2 0.999,
  eps 1e-15, LR 1e-2, no clipping). On this model they move the loss by a few percent
  or grow the max logit into the hundreds without a loss spike, so they measure
  nothing yet; the README lists what was measured. On the sharp model:
  ``logit_growth_sharp`` (LR 5e-3 to step 200, then 3x: the max logit climbs with
  the loss, but a logit cap does not remove the rise and a lower LR does) and
  ``precision_sharp`` (the same base relaunched in bf16: no spike).
  ``--adam-bound`` prints why the optimizer-state mechanism needs far longer runs
  (``adam_peak``).
* real (``--set real``; not in ``all``; issue 36): instabilities the configuration
  itself causes on the tiny model (``train_configs/tiny_cpu.toml``, one process, cosine
  decay, every checkpoint kept): ``lr_warmup_real`` and ``logit_growth_real`` (one run:
  LR 0.3 after a 20-step warm-up; the max attention logit climbs into the thousands and
  the loss and grad norm spike; truth ``lr``, resp. the logits; preventions a 500-step
  warm-up, resp. QK-norm), ``lr_divergence_real`` (LR 1.0: the loss climbs to 17-27),
  ``optimizer_state_real`` (1,759 steps of one easy document, then the text, under beta2
  0.999 and eps 1e-15: Adam's update amplified when the gradient returns; prevention
  beta2 0.95), ``embedding_real`` (the token embedding at std 0.02, unscaled, at LR 0.1:
  ``tiny_cpu_small_embedding``; prevention torchtitan's std 1.0), ``precision_real`` (pure
  bf16: no spike; weight decay rounds away, the precision audit fails at start; prevention
  fp32, judged by the audit and the loss: ``audit``, ``end``). Issue 61: the memorisation
  plateaus ``optimizer_state_plateau`` (LR 1e-2) and ``optimizer_state_plateau_lr3e3``
  (prevention eps 1e-6) and the attention-logit stalls ``logit_stall_real`` (LR 0.1; seed 1
  barely stalls), ``logit_stall_lr02`` (LR 0.2, every seed tried stalls) and
  ``logit_stall_warmup500`` (prevention QK-norm).
  Each also runs the same configuration with the cause's prevention: ``prevented`` is
  true when that run has no acting flag; ``fingerprint`` is what the signals (max logit,
  log Z, grad norm, update norm, param norm, loss) did before the first flagged step.
* long (``--set long``; not in ``all``): ``output_logits_long``, 10^4 steps of the tiny
  model without weight decay or z-loss (QK-norm on): log Z's peak drifts up late in the
  run without a flag; the prevention z-loss 1e-4 (about 16 minutes a run pair alone).
* smoke (``--set smoke``; not in ``all``): ``hardware_smoke``: a bit flip at step 12 of
  16 steps at a quarter of the rows; it measures nothing. ``real_smoke``, the CI test's
  scenario (``tests/bench/test_zoo.py``): the first 40 steps of ``lr_divergence_real``.

Per scenario it prints (``--json``: one object per line) ``scenario``, ``set``,
``true_cause``, ``named_cause`` (the heuristic), ``named_cause_rerun``, ``true_step``,
``flagged_step`` (the first flagged step from ``true_step - 1`` to
``true_step + MATCH_AFTER`` (5); for a control the first flagged step; null when nothing
was flagged), ``other_flags`` (flagged steps outside that window), for bad data
``true_documents`` / ``named_documents``, and ``seconds``. At the end, the confusion
tables (true vs named cause, heuristic and rerun) and the goals: every cause named
right with ``--rerun``, the heuristics' count, no flag on a control.

``--prove off|acting|all`` passes ``--ledger.proof.scope`` to every launch and reads the
proofs at the alarm back from ``spikes.jsonl`` (``proof``: ``proof_verdict``): the first
proof from ``true_step - 1`` to ``true_step + 5`` against ``EXPECTED_VERDICT`` (planted
document ``bad_data``, bit flip ``hardware``, LR relaunch ``not_data``), its tier (an acting
flag or a note), the DP rank and documents it named; a control matches when no proof
found a harmful cause.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the launch prefix: $TITAN_LEDGER_TORCHRUN (a site wrapper; the test suite's warm launcher) or torchrun
from titan_ledger.tools.runs import torchrun_prefix  # noqa: E402

TOKENS_PER_STEP = 2 * 4 * 256  # DP 2 x 4 rows x 256 tokens
CORPUS = ROOT / "titan_ledger" / "assets" / "corpus" / "data.jsonl"
#: diagnose --rerun's training-step budget per scenario: a rerun starts where the
#: fingerprint began (step 1 for the real set's LR runs: 2 x 225 steps for a spike at 224)
RERUN_MAX_STEPS = 600
MATCH_AFTER = 5  # a flag up to 5 steps after the true step is the same spike (an LR jump needs a few)
CONSTANT_LR = ("--lr_scheduler.min_lr_factor", "1.0")  # warmup 2, then constant
# The "sharp" model: the debug model learns a synthetic copy task (each document one
# random 8-word phrase repeated to 256 tokens; the repeats are predictable only through
# attention) from loss 8 to about 1 within 150 steps at LR 3e-3, where the text corpus
# leaves it at loss ~6. Attention then matters and the max logit is in the hundreds,
# which is where logit growth, bf16 and Adam's state were expected to bite.
COPY_PERIOD, COPY_DOCS, COPY_WORDS = 8, 4000, 400
SHARP = ("--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "5", *CONSTANT_LR)
SHARP_5E3 = ("--optimizer.lr", "5e-3", "--lr_scheduler.warmup_steps", "5", *CONSTANT_LR)
# The real set (issue 36): the tiny model (train_configs/tiny_cpu.toml: 2 layers, dim 64,
# ~50 ms a step on one core) in one process, the text read in order, cosine decay over
# the run, every checkpoint kept (diagnose --rerun starts from the one before the spike),
# the update norm recorded. No fault is injected: the configuration is the cause.
# The first step's checkpoint too (issue 51): an LR too large for the model moves the weights
# 2-16% a step from step 1 on (diagnose's onset), and a rerun that starts after the onset
# inherits the damage: from step-20 halving the LR moved the spike, from step-1 it removes it.
REAL = ("--lr_scheduler.decay_type", "cosine", "--ledger.update_norm", "--checkpoint.keep_latest_k", "0",
        "--checkpoint.enable_first_step_checkpoint")
REAL_LR3 = ("--optimizer.lr", "0.3", "--lr_scheduler.warmup_steps", "20", *REAL)
REAL_LR1 = ("--optimizer.lr", "1.0", "--lr_scheduler.warmup_steps", "20", *REAL)
# The optimizer-state cause (Bai et al.; the article's section 2.6): a long low-gradient
# stretch -- EASY_DOCS copies of one easy document, 1,759 steps of the tiny model's 1,024
# tokens -- then the ordinary text, at a constant LR under beta2 0.999 and a tiny eps.
EASY_TEXT, EASY_DOCS = " the end." * 400, 1500
REAL_ADAM = ("--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "100", *CONSTANT_LR, "--ledger.update_norm",
             "--checkpoint.keep_latest_k", "0", "--checkpoint.enable_first_step_checkpoint", "--optimizer.betas", "0.9",
             "0.999", "--optimizer.eps", "1e-15")
# Adam's plateau (issue 61; Wortsman et al. 2023b, Bai et al. 2025): one text repeated (the
# ``easy_only`` corpus), a constant LR, no weight decay, QK-norm: the model memorises it (loss
# ~0.007), the gradient falls to ~1e-3, Adam's second moment follows it down and every update
# stays full-size until the loss spikes (7 and 12 flags in 800 steps on two seeds).
PLATEAU = ("--lr_scheduler.warmup_steps", "20", *CONSTANT_LR, "--optimizer.weight_decay", "0", "--model.qk_norm",
           "--ledger.update_norm", "--checkpoint.keep_latest_k", "0", "--checkpoint.enable_first_step_checkpoint")
# the attention-logit stall (issue 61; Wortsman et al. 2023): LR 0.1 after a 20-step warm-up, no
# weight decay, cosine decay: the loss stops improving near 6.3 by step 150 while the max
# attention logit climbs from 2e3 to 5.8e4 -- no spike; the stall rule flags it
STALL = ("--optimizer.lr", "0.1", "--lr_scheduler.warmup_steps", "20", "--optimizer.weight_decay", "0", *REAL)


@dataclass(frozen=True)
class Scenario:
    name: str
    cause: str | None  # the true cause, as diagnose prints it; None: a control
    steps: int
    flags: tuple[str, ...] = ()
    plant: str | None = None  # corpus: repeat | ngram | random
    plant_step: int = 28
    seed: int = 0
    relaunch: tuple[int, tuple[str, ...]] | None = None  # (first launch's last step, flags of the second)
    true_step: int | None = None  # known by construction; else read from the data ledger
    set: str = "tuned"  # tuned | held_out | controls | sharp | attempted | real | long | smoke
    corpus: str = "text"  # text: the bundled documents | copy: the synthetic copy corpus (COPY_*) | easy: EASY_*, then text
    config: str = "debug_cpu.toml"  # train_configs/<config>
    nproc: int = 2
    ckpt_interval: int = 10
    # real: the flags of the same run with the cause's prevention (``Result.prevented``)
    prevention: tuple[str, ...] | None = None
    stall: bool = False  # the cause stalls training, it does not spike: the stall rule's flags are its flags


SCENARIOS = [
    Scenario("bad_data_repeat", "bad_data", 40, plant="repeat"),
    Scenario("bad_data_ngram", "bad_data", 45, plant="ngram", plant_step=36),
    Scenario("lr", "lr", 40, CONSTANT_LR, relaunch=(20, ("--optimizer.lr", "2.4e-2"))),
    Scenario("hardware", "hardware", 40, ("--ledger.rehearsal.inject", "28:0:bitflip"), true_step=28),
    # the first held-out round: run once after tuning on the four above, then tuned on
    # (its misses changed the ratio rule and diagnose's document ranking; README)
    Scenario("bad_data_chars", "bad_data", 45, plant="chars", plant_step=33),
    Scenario("bad_data_repeat_late", "bad_data", 55, plant="repeat_and", plant_step=45),
    Scenario("lr_x20", "lr", 45, CONSTANT_LR, relaunch=(30, ("--optimizer.lr", "1.6e-2"))),
    Scenario("hardware_rank1", "hardware", 40, ("--ledger.rehearsal.inject", "33:1:bitflip"), true_step=33),
    # held out (round 2): run after every threshold was fixed, reported separately
    Scenario("bad_data_ngram_b", "bad_data", 50, plant="ngram_b", plant_step=40, set="held_out"),
    Scenario("bad_data_repeat_b", "bad_data", 40, plant="repeat_is", plant_step=30, set="held_out"),
    Scenario("lr_x10", "lr", 40, CONSTANT_LR, relaunch=(20, ("--optimizer.lr", "8e-3")), set="held_out"),
    Scenario("hardware_step38", "hardware", 45, ("--ledger.rehearsal.inject", "38:0:bitflip"), true_step=38,
             set="held_out"),
    # the control: the runs above without their fault (same corpus order, default flags)
    # not a measurement (in no set but "smoke"): the hardware fault at a quarter of the rows,
    # 16 steps, for tests/bench/test_zoo.py (the bench's plumbing end to end, ~4x cheaper)
    Scenario("hardware_smoke", "hardware", 16, ("--ledger.rehearsal.inject", "12:0:bitflip",
                                                "--training.local_batch_size", "2", "--training.seq_len", "128"),
             true_step=12, set="smoke"),
    Scenario("clean", None, 55, set="controls"),
    Scenario("clean_lr", None, 40, CONSTANT_LR, relaunch=(20, ()), set="controls"),
    # sharp (not in ``all``): the copy-corpus model, run once, nothing tuned on it; an LR
    # fault (3x relaunch at step 150) and its control (the relaunch unchanged)
    Scenario("lr_sharp", "lr", 175, SHARP, relaunch=(150, ("--optimizer.lr", "9e-3")), set="sharp",
             corpus="copy"),
    Scenario("clean_sharp", None, 175, SHARP, relaunch=(150, ()), set="sharp", corpus="copy"),
    # attempted: configurations that carry the cause but produced NO loss spike on this
    # model (the README lists what was measured); kept runnable for a larger model or a GPU
    Scenario("bad_data_random", "bad_data", 70, plant="random", plant_step=60, set="attempted"),
    Scenario("logit_growth", "logit_growth", 100,
             ("--optimizer.lr", "3e-2", "--lr_scheduler.warmup_steps", "80", *CONSTANT_LR), set="attempted"),
    Scenario("precision", "bf16", 100, ("--optimizer.lr", "3e-2", "--lr_scheduler.warmup_steps", "80",
                                         *CONSTANT_LR, "--training.mixed_precision_param", "bfloat16"),
             set="attempted"),
    # the sharp model trained to step 200 at LR 5e-3 (loss ~0.9, max logit ~280), then
    # relaunched at 3x the LR (the max logit climbs into the thousands) or in bf16
    Scenario("logit_growth_sharp", "logit_growth", 250, SHARP_5E3, relaunch=(200, ("--optimizer.lr", "1.5e-2")),
             set="attempted", corpus="copy"),
    Scenario("precision_sharp", "bf16", 240, SHARP_5E3,
             relaunch=(200, ("--training.mixed_precision_param", "bfloat16")), set="attempted", corpus="copy"),
    # real (issue 36; not in ``all``): instabilities the configuration causes, on the tiny
    # model, each with the run under the cause's prevention (``Result.prevented``).
    # LR 0.3 after a 20-step warm-up: the max attention logit climbs from 0.1 to ~8,800
    # and the loss and grad norm spike from step 26 on (2,000-step runs: 2026-12-04).
    # Its truth is the LR: QK-norm bounds the logits (max <= 18) but not the spikes, and a
    # 500-step warm-up removes most of them; both preventions are run.
    Scenario("lr_warmup_real", "lr", 600, REAL_LR3, set="real", config="tiny_cpu.toml", nproc=1, ckpt_interval=20,
             prevention=("--lr_scheduler.warmup_steps", "500")),
    Scenario("logit_growth_real", "logit_growth", 600, REAL_LR3, set="real", config="tiny_cpu.toml", nproc=1,
             ckpt_interval=20, prevention=("--model.qk_norm",)),
    # LR 1.0: the loss climbs from 6 to 17-27 (log Z to 46, grad norm to 7e5) and stays high
    Scenario("lr_divergence_real", "lr", 400, REAL_LR1, set="real", config="tiny_cpu.toml", nproc=1,
             ckpt_interval=20, prevention=("--lr_scheduler.warmup_steps", "300", "--optimizer.lr", "0.1")),
    # the easy stretch, then text at step 1760: Adam's update amplified 56x (beta2 0.95: 9.8x)
    Scenario("optimizer_state_real", "optimizer_state", 2000, REAL_ADAM, set="real", corpus="easy",
             config="tiny_cpu.toml", nproc=1, ckpt_interval=20,
             prevention=("--optimizer.betas", "0.9", "0.95", "--optimizer.eps", "1e-8")),
    # embeddings at std 0.02, unscaled (Takase et al.), LR 0.1 after 20 warm-up steps: 8 acting
    # flags in 2,000 steps, grad norm to 261; the prevention is torchtitan's std 1.0 (0 flags)
    Scenario("embedding_real", "embedding", 600, ("--job.config", "tiny_cpu_small_embedding", "--optimizer.lr", "0.1",
                                                   "--lr_scheduler.warmup_steps", "20", *REAL),
             set="real", config="tiny_cpu.toml", nproc=1, ckpt_interval=20, prevention=("--job.config", "tiny_cpu")),
    # pure bf16 (bf16 master weights and Adam moments, article section 2.3): no spike, but weight
    # decay's relative step (lr x 0.1 = 3e-4) rounds away under bf16's spacing, so the param
    # norm does not shrink (1,000-step runs: 370.1 against 319.3 in fp32, loss 5.16 against
    # 4.96). Caught by the precision audit at start, not by a spike rule: ``audit`` and
    # ``end`` say what a flag cannot; the prevention is fp32 master weights.
    Scenario("precision_real", "bf16", 600, ("--training.dtype", "bfloat16", "--ledger.update_norm",
                                             "--checkpoint.keep_latest_k", "0"),
             set="real", config="tiny_cpu.toml", nproc=1, ckpt_interval=10_000,
             prevention=("--training.dtype", "float32")),
    # output logits (Wortsman et al.: no weight decay, no z-loss, late in a long run), QK-norm on
    # so that the attention logits stay small: log Z's peak drifts up over 10^4 steps
    # (per-1,000-step median of logz_max 10.8 -> 35.9, peak 153) without a flag or a loss
    # divergence; z-loss 1e-4 slows the drift (22.6, peak 47), it does not stop it. Its own
    # set, "long" (2 x 970 s: twice --set real's budget); judged by ``end`` (the last
    # tenth's log Z) against the prevention's, ``prevented`` left None (a drift, no spike).
    Scenario("output_logits_long", "output_logits", 10_000,
             ("--optimizer.lr", "0.1", "--optimizer.weight_decay", "0", "--model.qk_norm", "--lr_scheduler.warmup_steps",
              "500", "--lr_scheduler.decay_ratio", "0.1", "--ledger.update_norm", "--checkpoint.keep_latest_k", "0"),
             set="long", config="tiny_cpu.toml", nproc=1, ckpt_interval=100_000,
             prevention=("--loss.z_loss_weight", "1e-4")),
    # issue 61: Adam's plateau; its prevention eps 1e-6 (measured: no flag); its twin at a third of
    # the LR (the plateau comes later, the spike with it: the LR is not the whole story)
    Scenario("optimizer_state_plateau", "optimizer_state", 800, ("--optimizer.lr", "1e-2", *PLATEAU), set="real",
             corpus="easy_only", config="tiny_cpu.toml", nproc=1, ckpt_interval=20,
             prevention=("--optimizer.eps", "1e-6")),
    Scenario("optimizer_state_plateau_lr3e3", "optimizer_state", 1500, ("--optimizer.lr", "3e-3", *PLATEAU),
             set="real", corpus="easy_only", config="tiny_cpu.toml", nproc=1, ckpt_interval=20,
             prevention=("--optimizer.eps", "1e-6")),
    # issue 61: the attention-logit stall and its twin with a 500-step warm-up (the logits still
    # pass 1e4); the prevention QK-norm (measured: logits ~36, the loss going on down)
    Scenario("logit_stall_real", "logit_growth", 1000, STALL, set="real", config="tiny_cpu.toml", nproc=1,
             ckpt_interval=20, prevention=("--model.qk_norm",), stall=True),
    # the same at LR 0.2: seed-robust (measured before any proof ran, QK-norm twins beside:
    # last-100 loss 6.43 / 6.33 / 6.36 against 5.53 / 5.48 / 5.62 on seeds 0 / 1 / 2, stall
    # flags at 350 on each; at LR 0.1 seed 1 stalled by 0.9% only)
    Scenario("logit_stall_lr02", "logit_growth", 1000, (*STALL, "--optimizer.lr", "0.2"), set="real",
             config="tiny_cpu.toml", nproc=1, ckpt_interval=20, prevention=("--model.qk_norm",), stall=True),
    Scenario("logit_stall_warmup500", "logit_growth", 1000, (*STALL, "--lr_scheduler.warmup_steps", "500"),
             set="real", config="tiny_cpu.toml", nproc=1, ckpt_interval=20, prevention=("--model.qk_norm",),
             stall=True),
    # smoke: the divergence's first spike (step 22 of the 2,000-step run) for the CI test
    Scenario("real_smoke", "lr", 40, REAL_LR1, set="smoke", config="tiny_cpu.toml", nproc=1, ckpt_interval=20),
    Scenario("optimizer_state", "optimizer_state", 100,
             ("--optimizer.lr", "1e-2", *CONSTANT_LR, "--training.max_norm", "1e9", "--optimizer.betas", "0.9",
              "0.999", "--optimizer.eps", "1e-15"), set="attempted"),
]
BY_NAME = {s.name: s for s in SCENARIOS}


def env() -> dict:
    return dict(os.environ, TITAN_LEDGER_DEVICE="cpu", OMP_NUM_THREADS="1", WANDB_MODE="offline",
                HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")


def planted_text(kind: str, seed: int) -> str:
    rnd = random.Random(seed)
    if kind == "repeat":
        return " the" * 1200
    if kind == "repeat_and":
        return " and" * 1200
    if kind == "ngram":
        return " of the data" * 400
    if kind == "repeat_is":
        return " is" * 1500
    if kind == "ngram_b":
        return " return None" * 500
    if kind == "chars":  # a separator line run, as scraped pages have
        return "=" * 4000
    if kind == "random":
        return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz0123456789{}[]<>#@!?") for _ in range(1500))
    raise ValueError(kind)


def copy_documents(tok, seed: int) -> list[dict]:
    """The synthetic copy corpus: COPY_DOCS documents, each a random phrase of
    COPY_PERIOD words (drawn from the first COPY_WORDS words of the bundled corpus
    that are one token each) repeated to 256 tokens."""
    words: list[str] = []
    for line in CORPUS.read_text().splitlines():
        for w in json.loads(line)["text"].split():
            if w.isalpha() and w not in words and len(tok.encode(" " + w, add_bos=False, add_eos=False)) == 1:
                words.append(w)
        if len(words) >= COPY_WORDS:
            break
    rnd = random.Random(seed)
    return [{"text": " " + " ".join([rnd.choice(words[:COPY_WORDS]) for _ in range(COPY_PERIOD)]
                                    * (256 // COPY_PERIOD))} for _ in range(COPY_DOCS)]


def build_corpus(folder: Path, plant: str | None, plant_step: int, seed: int,
                 corpus: str = "text") -> tuple[Path, list[int]]:
    """The bundled documents (or the copy corpus, or the easy stretch then the bundled
    documents) in order, one degenerate document inserted where the sequential order
    reaches it at about ``plant_step``; returns (prefix, its doc ids)."""
    from titan_ledger.data.prepare import load_tokenizer

    tok = load_tokenizer(str(ROOT / "titan_ledger" / "assets" / "tokenizer"))
    text = [json.loads(x) for x in CORPUS.read_text().splitlines() if x.strip()]
    docs = (copy_documents(tok, seed) if corpus == "copy" else
            [{"text": EASY_TEXT}] * EASY_DOCS + text * 3 if corpus == "easy" else
            [{"text": EASY_TEXT}] * EASY_DOCS if corpus == "easy_only" else text)
    out, seen, planted = [], 0, []
    target = (plant_step - 1) * TOKENS_PER_STEP
    for d in docs:
        if plant and not planted and seen >= target:
            planted.append(len(out))
            out.append({"text": planted_text(plant, seed)})
        out.append({"text": d["text"]})
        seen += len(tok.encode(d["text"], add_bos=True, add_eos=True))
    return prepare_documents(folder, out, "zoo"), planted


def prepare_documents(folder: Path, docs: list[dict], name: str) -> Path:
    """``docs`` as a Megatron corpus ``folder/name`` (the ``prepare`` CLI, one process)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"{name}.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in docs))
    prefix = folder / name
    subprocess.run([sys.executable, "-m", "titan_ledger.prepare", "--input", str(src), "--output-prefix",
                    str(prefix), "--workers", "0"], cwd=ROOT, env=env(), check=True, capture_output=True)
    return prefix


@dataclass(frozen=True)
class Split:
    """A document planted across two DP ranks' batches of one step (``plant_across``)."""
    prefix: Path  # the corpus (train with --dataloader.source indexed --dataloader.no_shuffle)
    doc: int  # its document id in the corpus
    step: int  # the step whose batches hold all of it
    dp_ranks: tuple[int, int]  # the two DP ranks it spans
    tokens: tuple[int, int]  # its trained tokens on each


def plant_across(folder: Path, step: int, dp: int, mbs: int, seq_len: int, into: int, word: str = " the",
                 margin: int = 16) -> Split:
    """The bundled documents in order, ONE degenerate document (``word`` repeated) inserted
    so that it starts in DP rank r's batch and ends ``into`` tokens into rank r+1's, both
    at one step: the first step >= ``step`` (and the first r) with a document boundary
    in rank r's batch at least ``margin`` tokens before its end (the sequential order
    without shuffling packs the stream into rows, and rank r's rows of a step come just
    before rank r+1's: ``layout.sample_id``). Documents are only inserted at boundaries,
    so the bundled texts are unchanged; trained tokens are a document's length - 1."""
    from titan_ledger.data.prepare import load_tokenizer

    tok = load_tokenizer(str(ROOT / "titan_ledger" / "assets" / "tokenizer"))
    text = [json.loads(x)["text"] for x in CORPUS.read_text().splitlines() if x.strip()]
    per_rank = mbs * seq_len
    if not 0 < into <= per_rank - margin:
        raise ValueError(f"into={into}: 1..{per_rank - margin} tokens fit in one rank's batch")
    starts, at = [], 0
    for t in text:  # where each document's trained tokens start in the stream
        starts.append(at)
        at += len(tok.encode(t, add_bos=True, add_eos=True)) - 1
    for t in range(step, step + 1000):
        for r in range(dp - 1):
            edge = ((t - 1) * dp + r + 1) * per_rank  # rank r's batch ends, rank r+1's begins
            inside = [i for i, s in enumerate(starts) if edge - per_rank < s <= edge - margin]
            if inside:
                i = inside[-1]
                n = edge - starts[i] + into  # trained tokens: BOS + (n - 1) words + EOS, minus one
                planted = word * (n - 1)
                if len(tok.encode(planted, add_bos=True, add_eos=True)) != n + 1:
                    raise ValueError(f"{word!r} repeated is not one token a repeat")
                prefix = prepare_documents(folder, [{"text": x} for x in text[:i] + [planted] + text[i:]], "split")
                return Split(prefix, i, t, (r, r + 1), (edge - starts[i], into))
    raise ValueError(f"no document boundary near a rank edge in 1000 steps from {step}")


#: ``--seed N``: torchtitan's ``--debug.seed N`` on every launch (the model's init; the
#: data order is the corpus's, read in order): a second seed of each scenario (issue 51)
SEED_ARGS: tuple[str, ...] = ()
# --snapshots EVERY:KEEP: the host-memory ring and its window proof in every launch (issue 51)
SNAPSHOT_ARGS: tuple[str, ...] = ()


def base_args(sc: Scenario, prefix: Path, steps: int) -> list[str]:
    return ["--job.config_file", str(ROOT / "train_configs" / sc.config), "--training.steps", str(steps),
            "--checkpoint.enable", "--checkpoint.interval", str(sc.ckpt_interval), "--dataloader.source", "indexed",
            "--dataloader.paths", str(prefix), "--dataloader.no_shuffle", *sc.flags, *SEED_ARGS,
            *SNAPSHOT_ARGS]


def train(args: list[str], dump: Path, log: Path, nproc: int = 2) -> int:
    cmd = [*torchrun_prefix(), "--standalone", "--nproc_per_node", str(nproc),
           "-m", "titan_ledger.train", *args, "--dump_folder", str(dump)]
    with open(log, "a") as f:
        return subprocess.run(cmd, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT).returncode


def diagnose(dump: Path, *extra: str) -> tuple[dict | None, str]:
    p = subprocess.run([sys.executable, "-m", "titan_ledger.diagnose", str(dump), "--json", *extra], cwd=ROOT,
                       env=env(), capture_output=True, text=True)
    if p.returncode != 0:
        return None, (p.stderr or p.stdout)[-400:]
    return json.loads(p.stdout.strip().splitlines()[-1]), ""


@dataclass
class Result:
    scenario: str
    set: str
    true_cause: str | None
    named_cause: str | None = None
    named_cause_rerun: str | None = None
    true_step: int | None = None
    flagged_step: int | None = None
    other_flags: list[int] = field(default_factory=list)
    true_documents: list[int] | None = None
    named_documents: list[int] | None = None
    first_named_document: int | None = None
    rerun_proven: bool | None = None
    rerun_variants: list[str] | None = None
    train_rc: int = 0
    error: str | None = None
    proof: dict | None = None  # with --prove: proof_verdict() of the run's proofs
    heuristic: str | None = None  # diagnose's cause before a proof decided it (the tree's reading)
    window: list | None = None  # with --snapshots: [step, cause, from_step, seconds, kind] per window proof
    # (kind: "spike", or "stall" for the stall rule's forced proof)
    fingerprint: dict | None = None  # real: the signals before the flagged step (fingerprint())
    prevented: bool | None = None  # real: the run with the prevention has no acting flag
    prevention_flags: list[int] | None = None  # real: its flagged steps
    prevention_fingerprint: dict | None = None  # real: its signals over the same steps
    audit: list[str] | None = None  # real: the precision audit's failed checks at start (end_state())
    end: dict | None = None  # real: the run's end (end_state()); prevention_end: its prevention's
    prevention_audit: list[str] | None = None
    prevention_end: dict | None = None
    seconds: float = 0.0


def run(sc: Scenario, base: Path, rerun: bool = True, prove: str | None = None) -> Result:
    """``prove``: ``--ledger.proof.scope`` for every launch (None: the config's default)
    and the proofs read back against the truth (``Result.proof``)."""
    t0 = time.monotonic()
    dump = base / sc.name
    shutil.rmtree(dump, ignore_errors=True)
    log = base / f"{sc.name}.log"
    log.unlink(missing_ok=True)
    prefix, planted = build_corpus(base / f"corpus_{sc.corpus}_{sc.plant or 'clean'}_{sc.plant_step}_{sc.seed}",
                                   sc.plant, sc.plant_step, sc.seed, sc.corpus)
    res = Result(sc.name, sc.set, sc.cause)
    proving = ["--ledger.proof.scope", prove] if prove else []
    if sc.relaunch is None:
        args = base_args(sc, prefix, sc.steps) + proving
        res.train_rc = train(args, dump, log, sc.nproc)
    else:  # the first launch to the checkpoint, then the relaunch with the changed flags
        first, changed = sc.relaunch
        res.train_rc = train(base_args(sc, prefix, first) + proving, dump, log, sc.nproc)
        args = base_args(sc, prefix, sc.steps) + proving + list(changed)
        res.train_rc = res.train_rc or train(args, dump, log, sc.nproc)
    from titan_ledger.format.reader import RunLedger

    led = RunLedger(dump)
    res.true_step = sc.true_step
    if planted:
        steps = sorted(s for r in led.data.ranks() for s in range(1, led.data.last_step + 1)
                       if (sd := led.data.at(s, r)) and any(seg.doc in planted for t in sd.tags for seg in t.segments))
        res.true_step, res.true_documents = (steps[0] if steps else None), planted
    if sc.relaunch is not None:  # the first step after the relaunch at >= 2x the step before's LR
        rows = led.trained_rows()
        res.true_step = next((b["step"] for a, b in zip(rows, rows[1:])
                              if b["step"] > sc.relaunch[0] and b["lr"] >= 2 * a["lr"]), None)
    flagged = led.spike_steps() if not sc.stall else stall_steps(led)
    if sc.prevention is not None:  # real: the same run with the cause's prevention
        pdump = base / f"{sc.name}_prevented"
        shutil.rmtree(pdump, ignore_errors=True)
        # trained whatever the run's own exit: a run that stopped on a non-finite loss (a
        # second seed of the LR runs: NaN at steps 205 and 546) is the cause's outcome
        prc = train(base_args(sc, prefix, sc.steps) + proving + list(sc.prevention),
                    pdump, base / f"{sc.name}_prevented.log", sc.nproc)
        res.train_rc = res.train_rc or prc
        pled = RunLedger(pdump)
        res.prevention_flags = pled.spike_steps() if not sc.stall else stall_steps(pled)
        res.prevented = not res.prevention_flags
        res.audit, res.end = end_state(led)
        res.prevention_audit, res.prevention_end = end_state(pled)
        if sc.cause == "bf16":  # no spike to prevent: prevented when the audit passes and the run trained better
            res.prevented = (not res.prevention_audit and bool(res.audit)
                             and res.prevention_end["loss_last100_median"] < res.end["loss_last100_median"])
        elif sc.cause == "output_logits" and not res.prevention_flags and not flagged:
            res.prevented = None  # a drift, no spike: ``end`` says how far each run drifted
        if flagged:
            res.prevention_fingerprint = fingerprint(pled.trained_rows(), flagged[0])
    if flagged:
        res.fingerprint = fingerprint(led.trained_rows(), flagged[0])
    if res.true_step is not None:
        near = [s for s in flagged if res.true_step - 1 <= s <= res.true_step + MATCH_AFTER]
    else:
        near = flagged[:1]
    res.flagged_step = near[0] if near else None
    res.other_flags = [s for s in flagged if s != res.flagged_step and s not in near]
    if SNAPSHOT_ARGS:
        res.window = [[step, w.get("cause"), w.get("from_step"), w.get("seconds"), "stall" if w.get("stall") else "spike"]
                      for step, proof in led.proofs() if (w := proof.get("window"))]
    if prove:
        proofs = read_proofs(dump)
        # a real cause has no step by construction: its spike is the first flagged step
        at = res.true_step if res.true_step is not None else res.flagged_step
        res.proof = {**proof_verdict(sc.cause, at, proofs, res.true_documents),
                     "counts": proof_counts(proofs), "steps": [[p["step"], p["tier"], p["verdict"]] for p in proofs]}
    if res.flagged_step is None:
        res.seconds = round(time.monotonic() - t0, 1)
        return res
    d, err = diagnose(dump, "--step", str(res.flagged_step))
    if d is None:
        res.error = f"diagnose: {err}"
    else:
        v = d["spikes"][0]
        res.named_cause = v["cause"]
        res.heuristic = v.get("heuristic", v["cause"])
        if planted:  # diagnose lists the suspect rank's documents furthest from the median first
            docs = [x["doc"] for x in v.get("documents", [])]
            res.named_documents = sorted(set(docs))
            res.first_named_document = docs[0] if docs else None
    if rerun:
        d, err = diagnose(dump, "--step", str(res.flagged_step), "--rerun", "--rerun-max-steps", str(RERUN_MAX_STEPS), "--",
                          *args)
        if d is None:
            res.error = f"diagnose --rerun: {err}"
        else:
            rr = d["spikes"][0].get("rerun") or {}
            res.named_cause_rerun = (rr.get("verdict") or {}).get("cause")
            res.rerun_proven = (rr.get("verdict") or {}).get("proven")
            res.rerun_variants = [x["variant"] for x in rr.get("variants", [])]
    res.seconds = round(time.monotonic() - t0, 1)
    return res


# --------------------------------------------------------------------------- real instabilities
#: the signals a real cause moves before its spike (issue 36): attention logits, output
#: logits (log Z), the pre-clip grad norm, the update Adam applied, the parameter norm
FINGERPRINT_KEYS = ("max_logit", "logz_max", "grad_norm", "update_norm", "param_norm", "loss")


def stall_steps(led) -> list[int]:
    """The steps the stall rule flagged (``components.detection.stall``): a stall's "spike"."""
    return [int(e["step"]) for e in led.response_events() if e.get("stall")]


def fingerprint(rows: list[dict], step: int, window: int = 20) -> dict:
    """What the signals did before ``step`` (pure): per key of :data:`FINGERPRINT_KEYS`,
    the median over the first ``window`` trained steps, the median and max over the
    ``window`` steps before ``step``, and the value at ``step`` (None where the run did not
    record it or has no such step)."""
    import statistics

    def stats(rs: list[dict], key: str) -> list[float] | None:
        vals = [r[key] for r in rs if r.get(key) is not None and r[key] == r[key]]
        return vals or None

    early = rows[:window]
    before = [r for r in rows if step - window <= r["step"] < step]
    at = next((r for r in rows if r["step"] == step), {})
    out: dict = {"step": step}
    for k in FINGERPRINT_KEYS:
        e, b = stats(early, k), stats(before, k)
        out[k] = {"early_median": e and round(statistics.median(e), 4),
                  "before_median": b and round(statistics.median(b), 4), "before_max": b and round(max(b), 4),
                  "at": at.get(k) if at.get(k) is None else round(at[k], 4)}
    return out


def end_state(led) -> tuple[list[str], dict]:
    """A real run's failed precision-audit checks at start and where it ended (param norm,
    median loss over the last 100 steps, the largest log Z and attention logit): what a
    cause that never spikes (pure bf16) leaves behind."""
    import statistics

    failed = [f"{c['check']}: {c['found']}" for c in (led.precision() or []) if c.get("ok") is False]
    rows = led.trained_rows()
    tail = [r["loss"] for r in rows[-100:] if r.get("loss") is not None]
    top = lambda k: max((r[k] for r in rows if r.get(k) is not None), default=None)  # noqa: E731
    last = [r["logz_max"] for r in rows[-max(len(rows) // 10, 1):] if r.get("logz_max") is not None]
    return failed, {"steps": rows[-1]["step"] if rows else 0,
                    "logz_max_last_tenth_median": round(statistics.median(last), 3) if last else None,
                    "logz_max_last_tenth_max": round(max(last), 3) if last else None,
                    "param_norm": rows[-1].get("param_norm") if rows else None,
                    "param_norm_start": rows[0].get("param_norm") if rows else None,
                    "loss_last100_median": round(statistics.median(tail), 4) if tail else None,
                    "logz_max": top("logz_max"), "max_logit": top("max_logit")}


# --------------------------------------------------------------------------- the proof at the alarm
#: the verdict the in-step proof (``--ledger.proof.scope``) should reach for each true
#: cause (``diagnose``'s names): a planted or injected batch is ``bad_data``, a bit flip
#: ``hardware``, an LR relaunch reproducible and not the data (``not_data``). A control
#: (None) has none: no proof on it may find a harmful cause (``format.proofs.HARMFUL``).
EXPECTED_VERDICT = {"bad_data": "bad_data", "hardware": "hardware", "lr": "not_data",
                    # the real causes (issue 36): reproducible, and not the data; Adam's state is
                    # named in the step when its second moment decayed (issue 61: Adam first)
                    "logit_growth": "not_data", "output_logits": "not_data",
                    "optimizer_state": ("not_data", "optimizer_state"), "bf16": "not_data", "embedding": "not_data"}


def proof_rows(events: list[dict]) -> list[dict]:
    """The proofs recorded in a run's ``spikes.jsonl`` events (pure; ``events``: the
    reader's ``RunLedger.spike_events() + note_events()``), one row per proven step in
    step order: ``step``, ``tier`` (``acting``: an acting rule fired; ``note``: notes
    only, proven under ``[ledger.proof] scope = "all"``), ``promoted`` (a note the proof turned into
    an alarm), ``verdict``, ``applied``, ``dp_rank`` (the suspect DP rank), ``dp_ranks``
    (hardware: the DP ranks whose executions differed; bad data convicted by group
    testing: the DP ranks holding its documents), ``documents`` ([source, doc]),
    ``abnormal`` (the first execution's update was abnormal: what the data did)."""
    out = []
    for e in events:
        p = e.get("proof")
        if not p:
            continue
        out.append({"step": int(e["step"]), "tier": "acting" if p.get("acting") else "note",
                    "promoted": bool(e.get("promoted_by_proof")), "verdict": p["verdict"],
                    "applied": p.get("applied"), "dp_rank": (p.get("suspect") or {}).get("dp_rank"),
                    "dp_ranks": p.get("dp_ranks") or (p.get("suspect") or {}).get("dp_ranks"),
                    "documents": p.get("documents"),
                    "abnormal": (p.get("executions") or [{}])[0].get("normal") is False})
    return sorted(out, key=lambda r: r["step"])


def proof_counts(proofs: list[dict]) -> dict:
    """Proofs by tier and verdict (pure): ``{"acting": {verdict: n}, "note": {...}}``."""
    out: dict[str, dict[str, int]] = {}
    for p in proofs:
        by = out.setdefault(p["tier"], {})
        by[p["verdict"]] = by.get(p["verdict"], 0) + 1
    return out


def read_proofs(dump: Path) -> list[dict]:
    """:func:`proof_rows` of a recorded run (through the format's reader)."""
    from titan_ledger.format.reader import RunLedger

    led = RunLedger(dump)
    return proof_rows(led.spike_events() + led.note_events())


def proof_verdict(cause: str | None, true_step: int | None, proofs: list[dict],
                  true_documents: list[int] | None = None, after: int = MATCH_AFTER, before: int = 1) -> dict:
    """The proof against the truth (pure). A fault (``cause`` set): the first proof from
    ``true_step - before`` to ``true_step + after`` (the window ``flagged_step`` uses) is the
    spike's; it matches when its verdict is :data:`EXPECTED_VERDICT` of the cause
    (no proof there: no match). A control (``cause`` None): matches when no proof
    found a harmful cause. ``proof_harmful_elsewhere``: harmful verdicts outside the
    window (every harmful verdict of a control), ``[step, verdict]``; for bad data
    ``proof_named_planted``: the proof's documents include a planted one."""
    from titan_ledger.format.proofs import HARMFUL

    near = [p for p in proofs if cause is not None and true_step is not None
            and true_step - before <= p["step"] <= true_step + after]
    first = near[0] if near else None
    out = {"proof_step": first and first["step"], "proof_verdict": first and first["verdict"],
           "proof_tier": first and first["tier"], "proof_dp_rank": first and first["dp_rank"],
           "proof_dp_ranks": first and first["dp_ranks"], "proof_documents": first and first["documents"],
           "proof_harmful_elsewhere": [[p["step"], p["verdict"]] for p in proofs
                                       if p["verdict"] in HARMFUL and p is not first and p not in near],
           "proofs": len(proofs)}
    if cause is None:
        out["proof_match"] = not out["proof_harmful_elsewhere"]
    else:
        want = EXPECTED_VERDICT.get(cause)
        out["proof_match"] = first is not None and first["verdict"] in (want if isinstance(want, tuple) else (want,))
    if true_documents:
        out["proof_named_planted"] = bool(first) and any(
            int(d) in true_documents for _, d in (first["documents"] or []))
    return out


def proof_line(p: dict) -> str:
    """A scenario's proof in the printed table (pure)."""
    named = (f" DP rank {p['proof_dp_rank']}" if p["proof_dp_rank"] is not None else "") + (
        f" DP ranks {p['proof_dp_ranks']}" if p["proof_dp_ranks"] else "") + (
        f" docs {[f'{s}:{d}' for s, d in p['proof_documents'][:4]]}" if p["proof_documents"] else "")
    head = (f"proof {p['proof_verdict']}@{p['proof_step']} ({p['proof_tier']}{named})"
            if p["proof_step"] is not None else "no proof at the spike")
    return (f"{head} {'MATCH' if p['proof_match'] else 'NO MATCH'}, {p['proofs']} proofs"
            + (f", harmful elsewhere {p['proof_harmful_elsewhere']}" if p["proof_harmful_elsewhere"] else ""))


def adam_peak(beta2: float, normal: int, plateau: int, after: int = 200, beta1: float = 0.9,
              bias_correction: bool = True) -> float:
    """Why the optimizer-state cause is out of reach here (pure): one parameter under
    PyTorch's AdamW recursion sees a steady gradient 1 for ``normal`` steps, 0 for
    ``plateau`` steps (the low-gradient stretch of the design article's section 2.6),
    then 1 again; returns the largest update m_hat / sqrt(v_hat) after the plateau,
    in units of the steady update (1). ``bias_correction=False`` with ``normal=0``
    is the no-history limit: v decayed to nothing before the gradient returns."""
    m = v = 0.0
    peak = 0.0
    for t in range(1, normal + plateau + after + 1):
        g = 0.0 if normal < t <= normal + plateau else 1.0
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        if t > normal + plateau:
            mh, vh = (m / (1 - beta1 ** t), v / (1 - beta2 ** t)) if bias_correction else (m, v)
            peak = max(peak, mh / vh ** 0.5)
    return peak


def adam_table() -> list[str]:
    out = ["peak Adam update after a zero-gradient plateau, x the steady update (bench/zoo.py adam_peak):"]
    for b2 in (0.95, 0.99, 0.999):
        out.append(f"  beta2 {b2}: 100 normal + 100 zero steps {adam_peak(b2, 100, 100):.2f}; "
                   f"30 + 60 {adam_peak(b2, 30, 60):.2f}; v fully decayed (no bias correction) "
                   f"{adam_peak(b2, 0, 0, after=5000, bias_correction=False):.2f}")
    return out


def confusion(results: list[Result], key: str) -> list[str]:
    causes = sorted({r.true_cause or "(control)" for r in results})
    named = sorted({str(getattr(r, key) if r.flagged_step is not None else "(no flag)") for r in results})
    head = ["true \\ named"] + named
    rows = [head]
    for c in causes:
        rows.append([c] + [str(sum(1 for r in results if (r.true_cause or "(control)") == c and
                                   str(getattr(r, key) if r.flagged_step is not None else "(no flag)") == n))
                           for n in named])
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(x.ljust(w[i]) for i, x in enumerate(r)) for r in rows]


def summary(results: list[Result]) -> list[str]:
    out = []
    for s in ("tuned", "held_out", "sharp", "real", "smoke"):
        rs = [r for r in results if r.set == s and r.true_cause]
        if not rs:
            continue
        causes = sorted({r.true_cause for r in rs})
        ok = lambda key: [c for c in causes if all(getattr(r, key) == c for r in rs if r.true_cause == c)]  # noqa: E731
        h, rr = ok("named_cause"), ok("named_cause_rerun")
        step_ok = sum(1 for r in rs if r.flagged_step is not None)
        out.append(f"{s}: {step_ok}/{len(rs)} spikes flagged near the true step; causes named right by the "
                   f"heuristics {len(h)}/{len(causes)} ({', '.join(h) or '-'}), with --rerun {len(rr)}/"
                   f"{len(causes)} ({', '.join(rr) or '-'})")
    bd = [r for r in results if r.true_documents]
    if bd:
        first = sum(1 for r in bd if r.first_named_document in r.true_documents)
        among = sum(1 for r in bd if set(r.true_documents) & set(r.named_documents or []))
        out.append(f"bad data: the planted document named first in {first}/{len(bd)}, among the named in "
                   f"{among}/{len(bd)}")
    ctl = [r for r in results if r.true_cause is None]
    if ctl:
        flagged = [f"{r.scenario}@{[x for x in [r.flagged_step, *r.other_flags] if x is not None]}"
                   for r in ctl if r.flagged_step is not None]
        out.append(f"controls: {len(ctl) - len(flagged)}/{len(ctl)} without a flag"
                   + (f" (flagged: {', '.join(flagged)})" if flagged else ""))
    pr = [r for r in results if r.proof is not None]
    if pr:
        bad = [f"{r.scenario}: {r.proof['proof_verdict']}@{r.proof['proof_step']}" + (
            f" harmful elsewhere {r.proof['proof_harmful_elsewhere']}" if r.proof["proof_harmful_elsewhere"] else "")
            for r in pr if not r.proof["proof_match"]]
        out.append(f"proof at the alarm: verdict matches the truth in {len(pr) - len(bad)}/{len(pr)}"
                   + (f" (not: {'; '.join(bad)})" if bad else ""))
    win = [r for r in results if r.window is not None and r.true_cause]
    if win:  # proven by intervention: the cause named by the first window proof of a spike, and a stall's
        first = {r.scenario: {k: next((w[1] for w in r.window if w[4] == k), "-") for k in ("spike", "stall")}
                 for r in win}
        right = [n for n, r in zip(first, win) if r.true_cause in first[n].values()]
        out.append(f"window proofs name the truth in {len(right)}/{len(win)} runs (first spike proof / stall "
                   f"proof: " + "; ".join(f"{n}: {v['spike']} / {v['stall']}" for n, v in first.items()) + ")")
    fa = [f"{r.scenario}@{r.other_flags}" for r in results if r.true_cause and r.other_flags]
    if fa:
        out.append(f"flags away from the true step in fault runs: {', '.join(fa)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=sorted(BY_NAME), help="run these scenarios (repeatable)")
    ap.add_argument("--set", choices=("tuned", "held_out", "controls", "sharp", "attempted", "real", "long", "smoke",
                                      "all"),
                    default="all", help="all: tuned, held_out and controls (sharp, attempted and the test's "
                                        "smoke scenario only by name or --set)")
    ap.add_argument("--no-rerun", action="store_true", help="heuristics only (no diagnose --rerun)")
    ap.add_argument("--json", action="store_true", help="one JSON object per scenario, then the summary")
    ap.add_argument("--folder", type=Path, default=Path("/tmp/titan_ledger_zoo"))
    ap.add_argument("--keep", action="store_true",
                    help="keep each scenario's checkpoints and rerun folders (about 350 MB a scenario); "
                         "by default only the ledgers and logs stay")
    ap.add_argument("--prove", choices=("off", "acting", "all"),
                    help="--ledger.proof.scope for every launch (default: the config's, acting), and each "
                         "scenario's proofs read back against the truth")
    ap.add_argument("--seed", type=int, help="--debug.seed for every launch (the model's init): a second seed "
                                              "of each scenario; default: the config's")
    ap.add_argument("--snapshots", metavar="EVERY:KEEP",
                    help="--ledger.snapshots.every/keep for every launch: each acting not_data proof's window "
                         "re-run in process from the host snapshot (Result.window)")
    ap.add_argument("--adam-bound", action="store_true",
                    help="print how far Adam's update can grow after a low-gradient stretch, and exit")
    a = ap.parse_args(argv)
    if a.adam_bound:
        print("\n".join(adam_table()))
        return 0
    a.folder.mkdir(parents=True, exist_ok=True)
    global SEED_ARGS, SNAPSHOT_ARGS
    if a.seed is not None:
        SEED_ARGS = ("--debug.seed", str(a.seed))
    if a.snapshots:
        every, _, keep = a.snapshots.partition(":")
        SNAPSHOT_ARGS = ("--ledger.snapshots.every", every, "--ledger.snapshots.keep", keep or "2")
    chosen = [BY_NAME[n] for n in a.only] if a.only else [
        s for s in SCENARIOS if a.set == s.set or (a.set == "all" and s.set not in ("sharp", "attempted", "real",
                                                                                      "long", "smoke"))]
    results = []
    for sc in chosen:
        r = run(sc, a.folder, rerun=not a.no_rerun, prove=a.prove)
        results.append(r)
        if not a.keep:  # the ledgers are the evidence; the checkpoints only fed the reruns
            for sub in ("checkpoint", "rerun"):
                for run_dir in (sc.name, f"{sc.name}_prevented"):
                    shutil.rmtree(a.folder / run_dir / sub, ignore_errors=True)
        if a.json:
            print(json.dumps(r.__dict__), flush=True)
        else:
            print(f"{r.scenario:<26} true {r.true_cause!s:<16} step {r.true_step!s:<5} flagged {r.flagged_step!s:<5}"
                  f" heuristic {r.named_cause!s:<16} rerun {r.named_cause_rerun!s:<16} "
                  f"{r.seconds:.0f}s" + (f"  docs {r.true_documents} -> {r.named_documents}" if r.true_documents else "")
                  + (f"  other flags {r.other_flags}" if r.other_flags else "") + (f"  ERROR {r.error}" if r.error else "")
                  + (f"  {proof_line(r.proof)}" if r.proof is not None else "")
                  + (f"  prevented {r.prevented} (its flags {r.prevention_flags[:8]})" if r.prevented is not None else "")
                  + (f"  audit {r.audit} -> {r.prevention_audit}; end {r.end} -> {r.prevention_end}"
                     if r.audit else ""),
                  flush=True)
    lines = ["heuristic:", *confusion(results, "named_cause"), "with --rerun:",
             *confusion(results, "named_cause_rerun"), *summary(results)]
    if a.json:
        print(json.dumps({"summary": lines}))
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
