"""Adversarial clean corpora (issue 60 item 6): the spike response's false-action rate where nothing was planted.

    python bench/adversarial.py [--only NAME ...] [--seeds 0 1 ...] [--policy observe act] [--steps N]
                                [--jobs J] [--folder DIR] [--corpora-dir DIR] [--fresh] [--json]

Design decision: the clean runs of ``bench/false_alarms.py`` train on ordinary text;
the spike response's mistakes are likelier on corpora that are clean but unusual --
a text the model memorises, a duplicated document, code and tables, very short or
very long documents, a change of document length. Six such corpora, each built
deterministically (fixed seeds, sorted inputs) from what every Python install has,
are prepared once as indexed corpora (``python -m titan_ledger.prepare``, the bundled
tokenizer; ``bench/zoo.py``'s ``prepare_documents``) under
``<corpora-dir>/adversarial_<name>-<hash>/corpus`` and reused while the hash of their
manifest (every document's kind, source, size and content hash, the build parameters,
the tokenizer: ``bench/corpora.py``'s ``manifest``) matches. Nothing is planted in any
of them: every flag is a false alarm and every action (an update withheld or replaced,
a document masked or quarantined, a rollback) a false action.

The corpora (token counts with the bundled tokenizer, BOS and EOS included; a step of
the tiny model is 8 rows x 128 tokens = 1,024 trained tokens, and a document of ``n``
tokens contributes ``n - 1`` of them to the stream):

* ``plateau``: the memorisation plateau -- ``" the end." * 400`` (zoo's ``EASY_TEXT``,
  1,202 tokens) as 1,500 identical documents, read in order, under the issue's flags
  (``PLATEAU_FLAGS``: LR 1e-2 after 20 warm-up steps, constant, no weight decay,
  QK-norm): the loss falls to ~0 and every later step is the same text. The run that
  once convicted an innocent document and stopped on a NaN under acting proofs.
* ``duplication``: the bundled docstrings (457 documents) interleaved one to one with
  copies of ONE licence text (the standard library's ``LICENSE.txt``, cut as
  ``bench/corpora.py`` cuts it): half the documents identical, shuffled.
* ``code_tables``: the heterogeneous corpus's ``source`` (standard-library ``.py``
  files) and ``table`` (CSV tables) documents (``bench/corpora.py``'s builders),
  shuffled.
* ``short_docs``: ``SHORT_DOCS`` documents of <= ``SHORT_MAX`` tokens each: the bundled
  docstrings' words, in order, cut into chunks of a seeded target length in
  [``SHORT_MIN``, ``SHORT_MAX``] tokens; shuffled (each row holds ~10 documents).
* ``long_doc``: the bundled docstrings in order (those over ``BACKGROUND_MAX`` tokens
  split at line ends, so nothing else is long), repeated to cover the run, with ONE
  document of > ``LONG_MIN`` tokens (> 25 steps: the last bundled docstrings
  concatenated) inserted at the document boundary nearest the start of step
  ``LONG_STEP`` (100); read in order, so the steps it fills are known
  (``long_doc_steps``).
* ``length_shift``: the bundled docstrings' words cut into documents of a seeded
  target in [60, 120] tokens for the first half of the run's stream, then into
  documents of 10x that target (600-1,200 tokens) for the second half; read in
  order, so the mean document length rises ~10x at ``shift_step`` (half-way).

Each corpus's property is measured with the bundled tokenizer when it is built and
kept in its manifest (``properties``) and in every run's JSON (``corpus_props``):
``max_doc_tokens`` (short_docs), ``long_doc_tokens`` / ``long_doc_steps``
(long_doc), ``mean_ratio`` / ``shift_step`` (length_shift), the licence's share
(duplication), ``distinct_docs`` (plateau).

The runs: the tiny model (``train_configs/tiny_cpu.toml``: 2-layer llama3, dim 64) in
one process, ``--training.steps`` (``--steps``, default 800), ``--debug.seed`` and
``--dataloader.seed`` = seed, ``--metrics.log_freq 100``, the corpus's own flags, and
otherwise the spike response's defaults (``[ledger.proof] scope = "all"``, ``[ledger.response] policy = "observe"``);
``--policy act`` adds ``--ledger.response.policy act``. The grid is corpora x seeds x
policies; ``--jobs`` trainings run at once (one process each). A run recorded complete
under ``--folder`` (its ``<run>.json``: exit 0, the step target reached, the same
corpus hash) is read again instead of retrained unless ``--fresh``.

What it measures, per run (read back through ``titan_ledger.format.reader.RunLedger``
and ``spikes.jsonl``'s full history): ``flags`` (events with acting ``rules``),
``notes`` (note-only events), ``proofs_by_verdict``, ``actions`` (proofs whose update
was not the original -- ``masked``, ``control``, ``same``, ``none`` -- ladder decisions
other than ``none``/``exhausted`` not held back, rewinds), ``masked_updates`` (proofs
applied ``masked``/``control``), ``would_act`` (proofs a policy or a bound held back,
by ``held_back``), ``quarantined`` (lines of the run's ``proven_documents.jsonl``),
``tokens_masked`` (signals rows' ``masked_tokens``), ``no_token_steps``, ``breaker``
events, ``response_failures``, ``completed`` (exit 0 and the step target reached).
The goal: every run completes, no document quarantined and no update masked, under
``act`` as well as ``observe``. ``--json``: one object per run, then one summary
object; a markdown table (one row per run, for docs/benchmarks.md) ends the output
(on stderr with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import corpora  # noqa: E402
from bench.zoo import EASY_DOCS, EASY_TEXT, prepare_documents, train  # noqa: E402

CONFIG = ROOT / "train_configs" / "tiny_cpu.toml"
OUT = ROOT / "outputs" / "bench_adversarial"
TOKENS_PER_STEP = 8 * 128  # tiny_cpu: one process, 8 rows x 128 tokens
CORPORA = ("plateau", "duplication", "code_tables", "short_docs", "long_doc", "length_shift",
           # issue 68: clean corpora where a conviction would mean "new", "a copy" or "a broken model"
           "shift_language", "shift_code", "shift_tables", "near_dups", "drift", "broken_lr", "broken_lr_text")
#: the corpora before issue 68 (the first six)
OLD_CORPORA = CORPORA[:6]
POLICIES = ("observe", "act")

#: the memorisation plateau's flags (issue 60): a constant LR high enough to memorise
#: the one text within ~100 steps, no weight decay, QK-norm
PLATEAU_FLAGS = ("--dataloader.no_shuffle", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "20",
                 "--lr_scheduler.min_lr_factor", "1.0", "--optimizer.weight_decay", "0", "--model.qk_norm")
#: each corpus's own training flags (the others: the defaults, a seeded shuffle)
#: a model a high LR left broken (issue 68): peak LR 0.45 after 5 warm-up steps, cosine decay -- the
#: loss never leaves ~6.6, and late (the LR decayed, its fingerprint gone) the grad norm still jumps
BROKEN_FLAGS = ("--optimizer.lr", "0.45", "--lr_scheduler.warmup_steps", "5", "--lr_scheduler.decay_type", "cosine")
FLAGS = {"plateau": PLATEAU_FLAGS, "long_doc": ("--dataloader.no_shuffle",),
         "length_shift": ("--dataloader.no_shuffle",), "shift_language": ("--dataloader.no_shuffle",),
         "shift_code": ("--dataloader.no_shuffle",), "shift_tables": ("--dataloader.no_shuffle",),
         "drift": ("--dataloader.no_shuffle",), "broken_lr": BROKEN_FLAGS, "broken_lr_text": BROKEN_FLAGS}
#: corpora trained from the bundled text source (read as it streams), not an indexed corpus
TEXT_SOURCE = ("broken_lr_text",)
#: gettext catalogs' languages (the multilingual text: /usr/share/locale/<lang>/LC_MESSAGES/*.mo), in turn:
#: a script the tokenizer splits into bytes first (the issue's shift: the first new document far off)
LANGUAGES = ("ru", "ja", "de", "fr", "es", "pl")
SHIFT_DOC_CHARS = 2400  # a multilingual document: its catalogs' translations joined to about this many characters
NEAR_SHARE, NEAR_CHARS = 0.10, (20, 2000)  # near_dups: a tenth of the documents a run of one character
RUN_CHARS = ("\t", "*", "=", "-", "#", "~")
BUILD_SEED = 60  # the chunk lengths' seed (short_docs, length_shift)
SHORT_DOCS, SHORT_MIN, SHORT_MAX = 40_000, 8, 16
BACKGROUND_MAX = 8 * TOKENS_PER_STEP  # long_doc: no other document over 8 steps' tokens
LONG_MIN = 25 * TOKENS_PER_STEP  # the long document: over 25 steps' tokens (> 20 x 8 x 128)
LONG_STEP = 100  # ... starting where the order reaches this step
SHIFT_MIN, SHIFT_MAX, SHIFT_FACTOR = 60, 120, 10


# --------------------------------------------------------------------------- building the corpora
def tokenizer():
    from titan_ledger.data.prepare import load_tokenizer

    return load_tokenizer(str(corpora.TOKENIZER))


#: token counts of texts already counted (the bundled tokenizer is the only one used)
_COUNTED: dict[str, int] = {}
_WORDS: dict[tuple[str, bool], int] = {}


def n_tokens(tok, text: str) -> int:
    """Tokens of one document as ``prepare`` writes it (BOS and EOS included)."""
    if text not in _COUNTED:
        _COUNTED[text] = len(tok.encode(text, add_bos=True, add_eos=True))
    return _COUNTED[text]


def bundled_texts() -> list[str]:
    return [d["text"] for d in corpora.bundled_documents()]


def words_of(texts: list[str]) -> list[str]:
    return [w for t in texts for w in t.split()]


def word_chunks(words: list[str], tok, targets, limit: int, count: int | None = None,
                stream: int | None = None, start: int = 0) -> tuple[list[str], list[int], int]:
    """Consecutive chunks of ``words`` (from ``start``, wrapping around), each its words
    joined by spaces: chunk i holds the words that fit ``next(targets)`` tokens (BOS and
    EOS included; at least one word, never over ``limit``: a word alone over it is
    skipped). Stops after ``count`` chunks or once the chunks' stream (``n - 1`` tokens
    each) reaches ``stream`` tokens. Returns (texts, their token counts, next word)."""
    def tokens_of(w: str, first: bool) -> int:  # the tokenizer splits at spaces: counts add up (checked below)
        key = (w, first)
        if key not in _WORDS:
            _WORDS[key] = len(tok.encode(w if first else " " + w, add_bos=False, add_eos=False))
        return _WORDS[key]

    texts, lengths, i, total, skipped = [], [], start, 0, 0
    while (count is None or len(texts) < count) and (stream is None or total < stream):
        target, chunk, used = min(next(targets), limit), [], 2
        while True:
            w = words[i % len(words)]
            c = tokens_of(w, not chunk)
            if chunk and used + c > target:
                break
            i += 1
            if not chunk and used + c > limit:  # one word over the limit alone: left out
                skipped += 1
                if skipped > len(words):
                    raise ValueError(f"no word fits {limit} tokens")
                continue
            chunk.append(w)
            used += c
            if used >= target:
                break
        n = n_tokens(tok, " ".join(chunk))
        while n > limit and len(chunk) > 1:  # the counts did not add up: the last words back
            chunk.pop()
            i -= 1
            n = n_tokens(tok, " ".join(chunk))
        texts.append(" ".join(chunk))
        lengths.append(n)
        total += n - 1
    return texts, lengths, i


def split_text(tok, text: str, limit: int) -> list[str]:
    """``text`` cut at line ends (a space, else anywhere, when a half has none) into
    pieces of <= ``limit`` tokens each, halving by characters."""
    if n_tokens(tok, text) <= limit or len(text) < 2:
        return [text]
    mid = len(text) // 2
    cut = mid
    for sep in ("\n", " "):  # the separator nearest the middle, line ends first
        found = [c for c in (text.rfind(sep, 0, mid), text.find(sep, mid)) if 0 < c < len(text) - 1]
        if found:
            cut = min(found, key=lambda c: abs(c - mid)) + 1
            break
    return [p for half in (text[:cut], text[cut:]) if half.strip() for p in split_text(tok, half, limit)]


def doc(text: str, kind: str, source: str) -> dict:
    return {"text": text, "kind": kind, "source": source}


def plateau_docs() -> tuple[list[dict], dict]:
    return [doc(EASY_TEXT, "plateau", "zoo:EASY_TEXT")] * EASY_DOCS, {"docs": EASY_DOCS}


def licence_text() -> tuple[str, str]:
    """The duplicated licence: the standard library's LICENSE.txt (as ``bench/corpora.py``
    reads and cuts it), else the first licence the hetero corpus finds."""
    path = corpora.stdlib_dir() / "LICENSE.txt"
    if path.is_file():
        return corpora.cut(path.read_text(encoding="utf-8")), "stdlib:LICENSE.txt"
    first = corpora.licence_documents()[0]
    return first["text"], first["source"]


def duplication_docs() -> tuple[list[dict], dict]:
    text, source = licence_text()
    out = []
    for d in corpora.bundled_documents():
        out += [doc(d["text"], "docstrings", d["source"]), doc(text, "licence", source)]
    return out, {"licence": source}


def code_tables_docs() -> tuple[list[dict], dict]:
    return corpora.source_documents() + corpora.table_documents(), {
        "source_chars": corpora.SOURCE_CHARS, "max_doc_chars": corpora.MAX_DOC_CHARS, "n_tables": corpora.N_TABLES,
        "table_seed": corpora.TABLE_SEED, "python": sys.version.split()[0]}


def short_docs(tok, n: int = SHORT_DOCS) -> tuple[list[dict], dict]:
    rnd = random.Random(BUILD_SEED)
    targets = iter(lambda: rnd.randint(SHORT_MIN, SHORT_MAX), None)
    texts, _, _ = word_chunks(words_of(bundled_texts()), tok, targets, SHORT_MAX, count=n)
    return [doc(t, "short", f"chunk:{i}") for i, t in enumerate(texts)], {
        "docs": n, "seed": BUILD_SEED, "min_target": SHORT_MIN, "max_tokens": SHORT_MAX}


def stream_starts(lengths: list[int]) -> list[int]:
    """Where each document's trained tokens start in the stream read in order (a
    document of ``n`` tokens contributes ``n - 1``: inputs ``d[:-1]``, labels ``d[1:]``)."""
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += n - 1
    return out


def step_of(position: int) -> int:
    """The step (1-based) whose batch holds stream token ``position`` (one process, in order)."""
    return position // TOKENS_PER_STEP + 1


def long_doc_docs(tok, steps: int) -> tuple[list[dict], dict]:
    """The bundled docstrings in order (split to <= BACKGROUND_MAX tokens), repeated to
    cover the run, ONE document of > LONG_MIN tokens (the last pieces joined) inserted at
    the document boundary nearest step LONG_STEP's first token."""
    pieces = [p for t in bundled_texts() for p in split_text(tok, t, BACKGROUND_MAX)]
    lengths = [n_tokens(tok, p) for p in pieces]
    k, long_text = 0, ""
    while n_tokens(tok, long_text) <= LONG_MIN:  # the pieces' counts first, the joined text's to confirm
        while sum(lengths[len(lengths) - k:]) - 2 * k <= LONG_MIN:
            k += 1
        long_text = "\n\n".join(pieces[-k:])
        k += 1
    k -= 1
    long_n = n_tokens(tok, long_text)
    at = (LONG_STEP - 1) * TOKENS_PER_STEP
    out, seen, placed, i = [], 0, None, 0
    while placed is None or seen < max(steps + 1, step_of(placed + long_n - 2) + 1) * TOKENS_PER_STEP:
        j = i % len(pieces)
        if placed is None and (seen >= at or at - seen < seen + lengths[j] - 1 - at):  # the nearest boundary
            placed = seen
            out.append(doc(long_text, "long", f"bundled:last {k} pieces"))
            seen += long_n - 1
        out.append(doc(pieces[j], "docstrings", f"bundled:piece {j}"))
        seen += lengths[j] - 1
        i += 1
    return out, {"background_max": BACKGROUND_MAX, "long_min": LONG_MIN, "long_step": LONG_STEP, "steps": steps,
                 "long_pieces": k}


def length_shift_docs(tok, steps: int) -> tuple[list[dict], dict]:
    """Short documents (a target in [SHIFT_MIN, SHIFT_MAX] tokens) for the first half of
    the run's stream, then documents of SHIFT_FACTOR x that target, the words in order."""
    rnd = random.Random(BUILD_SEED)
    words = words_of(bundled_texts())
    half = steps // 2 * TOKENS_PER_STEP
    short, _, nxt = word_chunks(words, tok, iter(lambda: rnd.randint(SHIFT_MIN, SHIFT_MAX), None), SHIFT_MAX,
                                stream=half)
    long_max = SHIFT_FACTOR * SHIFT_MAX
    long, _, _ = word_chunks(words, tok, iter(lambda: SHIFT_FACTOR * rnd.randint(SHIFT_MIN, SHIFT_MAX), None),
                             long_max, stream=(steps + 1) * TOKENS_PER_STEP - half, start=nxt)
    return ([doc(t, "short", f"chunk:{i}") for i, t in enumerate(short)]
            + [doc(t, "long", f"chunk:{i}") for i, t in enumerate(long)]), {
        "seed": BUILD_SEED, "short_tokens": [SHIFT_MIN, SHIFT_MAX], "factor": SHIFT_FACTOR, "steps": steps}


def multilingual_documents(limit: int = SHIFT_DOC_CHARS, count: int = 4000) -> list[dict]:
    """Translated messages of the machine's gettext catalogs (``LANGUAGES`` in turn, each
    catalog's translations in message order, joined by newlines into documents of about
    ``limit`` characters): real text in other languages and scripts."""
    import gettext

    per_lang: dict[str, list[str]] = {}
    for lang in LANGUAGES:
        texts = []
        for f in sorted(Path("/usr/share/locale", lang, "LC_MESSAGES").glob("*.mo")):
            try:
                with open(f, "rb") as fh:
                    cat = gettext.GNUTranslations(fh)._catalog
            except Exception:
                continue
            texts += [v.strip() for k, v in sorted(cat.items(), key=lambda kv: str(kv[0]))
                      if isinstance(v, str) and k and v.strip()]
        per_lang[lang] = texts
    out, idx = [], {lang: 0 for lang in per_lang}
    while len(out) < count and any(idx[lang] < len(t) for lang, t in per_lang.items()):
        for lang, texts in per_lang.items():
            parts, n = [], 0
            while idx[lang] < len(texts) and n < limit:
                parts.append(texts[idx[lang]])
                n += len(texts[idx[lang]]) + 1
                idx[lang] += 1
            if parts:
                out.append(doc("\n".join(parts), f"lang:{lang}", f"gettext:{lang}"))
    if not out:
        raise SystemExit("no gettext catalogs under /usr/share/locale: the multilingual corpus needs them")
    return out


#: where in its step the first new document starts (tokens of 1,024): the issue's shift held 635 old
#: tokens and 389 new ones; a boundary this far in leaves both kinds a large share of the step
SHIFT_OFFSET = (400, 700)


def shift_docs(tok, steps: int, before: list[dict], after: list[dict]) -> tuple[list[dict], dict]:
    """``before`` documents (in turn, repeated) for the first half of the run's stream, then
    ``after`` documents: the shift falls at a document boundary ``SHIFT_OFFSET`` tokens into a
    step (read in order; the last old document cut short at a line or word end to land there)."""
    half = steps // 2 * TOKENS_PER_STEP
    out, seen, i = [], 0, 0
    while seen < half:
        d = before[i % len(before)]
        out.append(d)
        seen += n_tokens(tok, d["text"]) - 1
        i += 1
    want = (seen // TOKENS_PER_STEP) * TOKENS_PER_STEP + (SHIFT_OFFSET[0] + SHIFT_OFFSET[1]) // 2
    if want <= seen:
        want += TOKENS_PER_STEP
    d = before[i % len(before)]
    text = d["text"]
    while len(text) > 1 and seen + n_tokens(tok, text) - 1 > want:  # cut to land in the window
        text = text[:int(len(text) * 0.9)]
    out.append(doc(text, d["kind"], d["source"] + " (cut)"))
    seen += n_tokens(tok, text) - 1
    shift_at = seen
    j = 0
    while seen < (steps + 2) * TOKENS_PER_STEP:
        d = after[j % len(after)]
        out.append(d)
        seen += n_tokens(tok, d["text"]) - 1
        j += 1
    return out, {"steps": steps, "shift_token": shift_at, "before": before[0]["kind"], "after": after[0]["kind"]}


def bundled_docs() -> list[dict]:
    return [doc(d["text"], "docstrings", d["source"]) for d in corpora.bundled_documents()]


def near_dup_docs() -> tuple[list[dict], dict]:
    """The bundled docstrings with a tenth of the documents runs of one character (a tab,
    ``*``, ``=``, ...) of seeded lengths in ``NEAR_CHARS``: near-copies of each other of
    different lengths, the rest ordinary text."""
    rnd = random.Random(BUILD_SEED)
    base = bundled_docs() * 3
    out = []
    for d in base:
        out.append(d)
        if rnd.random() < NEAR_SHARE / (1 - NEAR_SHARE):
            c = rnd.choice(RUN_CHARS)
            out.append(doc(c * rnd.randint(*NEAR_CHARS), "run", f"run:{c!r}"))
    return out, {"seed": BUILD_SEED, "share": NEAR_SHARE, "chars": list(NEAR_CHARS), "runs": list(RUN_CHARS)}


def drift_docs(tok, steps: int) -> tuple[list[dict], dict]:
    """Docstrings drifting into source code: document i of the run's stream is code with
    probability i / n (seeded), read in order -- a shift no step holds."""
    rnd = random.Random(BUILD_SEED)
    prose, code = bundled_docs(), corpora.source_documents()
    target = (steps + 2) * TOKENS_PER_STEP
    out, seen, ip, ic = [], 0, 0, 0
    while seen < target:
        if rnd.random() < seen / target:
            d, ic = code[ic % len(code)], ic + 1
        else:
            d, ip = prose[ip % len(prose)], ip + 1
        out.append(d)
        seen += n_tokens(tok, d["text"]) - 1
    return out, {"seed": BUILD_SEED, "steps": steps}


def documents(name: str, tok, steps: int) -> tuple[list[dict], dict]:
    """The documents of corpus ``name`` (``text``, ``kind``, ``source``) and its build parameters."""
    if name == "plateau":
        return plateau_docs()
    if name == "duplication":
        return duplication_docs()
    if name == "code_tables":
        return code_tables_docs()
    if name == "short_docs":
        return short_docs(tok)
    if name == "long_doc":
        return long_doc_docs(tok, steps)
    if name == "length_shift":
        return length_shift_docs(tok, steps)
    if name == "shift_language":
        return shift_docs(tok, steps, bundled_docs(), multilingual_documents())
    if name == "shift_code":
        return shift_docs(tok, steps, corpora.source_documents(), bundled_docs())
    if name == "shift_tables":
        return shift_docs(tok, steps, bundled_docs(), corpora.table_documents())
    if name == "near_dups":
        return near_dup_docs()
    if name == "drift":
        return drift_docs(tok, steps)
    if name in ("broken_lr", "broken_lr_text"):
        return bundled_docs(), {"flags": list(BROKEN_FLAGS)}
    raise ValueError(f"unknown corpus {name!r} (one of {', '.join(CORPORA)})")


def measure(name: str, docs: list[dict], tok) -> dict:
    """The corpus's properties with the bundled tokenizer: documents, tokens (all, per
    kind), the longest / mean document, steps per epoch, and the property it was built for."""
    lengths = [n_tokens(tok, d["text"]) for d in docs]
    starts = stream_starts(lengths)
    kinds: dict[str, list[int]] = {}
    for d, n in zip(docs, lengths):
        kinds.setdefault(d["kind"], []).append(n)
    out = {"docs": len(docs), "tokens": sum(lengths), "max_doc_tokens": max(lengths),
           "mean_doc_tokens": round(sum(lengths) / len(lengths), 1),
           "steps_per_epoch": (sum(lengths) - len(lengths)) // TOKENS_PER_STEP,
           "by_kind": {k: {"docs": len(v), "tokens": sum(v), "max_tokens": max(v)} for k, v in sorted(kinds.items())}}
    if name == "plateau":
        out["distinct_docs"] = len({d["text"] for d in docs})
    if name == "duplication":
        lic = kinds["licence"]
        out.update(licence_tokens=lic[0], licence_doc_share=round(len(lic) / len(docs), 4),
                   licence_token_share=round(sum(lic) / sum(lengths), 4))
    if name == "long_doc":
        (i,) = [j for j, d in enumerate(docs) if d["kind"] == "long"]
        others = [n for j, n in enumerate(lengths) if j != i]
        out.update(long_doc_tokens=lengths[i], long_doc_index=i, long_doc_steps=[
            step_of(starts[i]), step_of(starts[i] + lengths[i] - 2)], others_max_tokens=max(others))
    if name.startswith("shift_"):
        first = next(j for j, d in enumerate(docs) if d["kind"] != docs[0]["kind"])
        out.update(shift_step=step_of(starts[first]), shift_offset=starts[first] % TOKENS_PER_STEP,
                   before=docs[0]["kind"], after=docs[first]["kind"])
    if name == "near_dups":
        runs = kinds.get("run", [])
        out.update(runs=len(runs), run_share=round(len(runs) / len(docs), 3), run_tokens=[min(runs), max(runs)])
    if name == "length_shift":
        first = next(j for j, d in enumerate(docs) if d["kind"] == "long")
        short, long = kinds["short"], kinds["long"]
        out.update(short_mean_tokens=round(sum(short) / len(short), 1), long_mean_tokens=round(sum(long) / len(long), 1),
                   mean_ratio=round(sum(long) / len(long) / (sum(short) / len(short)), 2),
                   short_range=[min(short), max(short)], long_range=[min(long), max(long)],
                   shift_step=step_of(starts[first]))
    return out


def prepare(name: str, steps: int, out: Path = corpora.OUT, tok=None, log=lambda m: None) -> tuple[Path, dict]:
    """Corpus ``name`` as an indexed corpus (prepared when its manifest hash has no folder
    yet); returns its prefix and its ``done.json`` (hash, properties, build parameters)."""
    tok = tok or tokenizer()
    docs, params = documents(name, tok, steps)
    m = corpora.manifest(f"adversarial_{name}", docs)
    m["params"].update(params)
    h = corpora.manifest_hash(m)
    folder = out / f"adversarial_{name}-{h}"
    prefix = folder / "corpus"
    done = folder / "done.json"
    if done.is_file() and Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
        return prefix, json.loads(done.read_text())
    t0 = time.monotonic()
    props = measure(name, docs, tok)
    shutil.rmtree(folder, ignore_errors=True)
    prepare_documents(folder, [{"text": d["text"]} for d in docs], "corpus")
    Path(f"{prefix}.jsonl").unlink(missing_ok=True)  # the manifest names every document; the .bin holds the tokens
    (folder / "manifest.json").write_text(json.dumps({**m, "properties": props}) + "\n")
    info = {"corpus": name, "hash": h, "params": m["params"], "properties": props,
            "prepared_tokens": corpora.n_tokens(prefix), "prepare_s": round(time.monotonic() - t0, 1)}
    if info["prepared_tokens"] != props["tokens"]:
        raise SystemExit(f"{name}: prepare wrote {info['prepared_tokens']} tokens, the tokenizer counts "
                         f"{props['tokens']}")
    done.write_text(json.dumps(info) + "\n")
    log(f"corpus {name}: {props['docs']:,} documents, {props['tokens']:,} tokens ({info['prepare_s']} s) {prefix}")
    return prefix, info


#: the measured property each corpus was built for, in the table
def key_property(name: str, p: dict) -> str:
    if name == "plateau":
        return f"{p['docs']:,} docs, {p['distinct_docs']} distinct, {p['max_doc_tokens']:,} tokens each"
    if name == "duplication":
        return (f"{p['licence_doc_share']:.0%} of docs one licence ({p['licence_tokens']:,} tokens, "
                f"{p['licence_token_share']:.0%} of tokens)")
    if name == "code_tables":
        return ", ".join(f"{k} {v['docs']:,} docs / {v['tokens']:,} tokens" for k, v in p["by_kind"].items())
    if name == "short_docs":
        return f"{p['docs']:,} docs of <= {p['max_doc_tokens']} tokens (mean {p['mean_doc_tokens']})"
    if name == "long_doc":
        return (f"one doc of {p['long_doc_tokens']:,} tokens at steps {p['long_doc_steps'][0]}-"
                f"{p['long_doc_steps'][1]}; others <= {p['others_max_tokens']:,}")
    if name == "length_shift":
        return (f"mean {p['short_mean_tokens']} -> {p['long_mean_tokens']} tokens ({p['mean_ratio']}x) at step "
                f"{p['shift_step']}")
    if name.startswith("shift_"):
        return (f"{p['before']} -> {p['after']} at step {p['shift_step']}, {p['shift_offset']} tokens into it")
    if name == "near_dups":
        return f"{p['runs']:,} runs of one character ({p['run_share']:.0%} of docs, {p['run_tokens'][0]}-" \
               f"{p['run_tokens'][1]} tokens)"
    if name == "drift":
        return ", ".join(f"{k} {v['docs']:,} docs" for k, v in p["by_kind"].items())
    if name.startswith("broken_lr"):
        return "the bundled docstrings; peak LR 0.45 after 5 warm-up steps, cosine" + (
            " (text source)" if name in TEXT_SOURCE else "")
    return ""


# --------------------------------------------------------------------------- reading a run
def spike_history(dump: Path) -> list[dict]:
    """Every event of the run's ``spikes.jsonl`` (flags, notes, forced proofs, ladder
    decisions, rewinds, breaker and failure events), superseded rows left out."""
    from titan_ledger.format import records

    path = Path(dump) / "ledger" / records.SPIKES_FILE
    return records.read_ledger(path, records.SPIKES).history if path.is_file() else []


def proven_lines(dump: Path) -> int:
    """Documents in the run's quarantine (``proven_documents.jsonl``, one per line)."""
    from titan_ledger.format import records

    path = Path(dump) / "ledger" / records.PROVEN_FILE
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip() and "schema" not in json.loads(line))


def count_events(events: list[dict]) -> dict:
    """The response's record (pure; ``events``: :func:`spike_history`). ``actions``:
    proofs whose update was not the original, ladder decisions that act (not ``none``
    or ``exhausted``, not held back) and rewinds; ``would_act``: proofs a policy or a
    bound held back."""
    flags = [e for e in events if e.get("rules")]
    notes = [e for e in events if e.get("notes") and not e.get("rules")]
    proofs = [e for e in events if isinstance(e.get("proof"), dict)]
    acted = [e for e in proofs if e["proof"].get("applied") not in (None, "original")]
    ladder = [e for e in events if e.get("ladder") and e.get("action") not in ("none", "exhausted")
              and "held_back" not in e]
    rewinds = [e for e in events if "rewind_to" in e]
    held = [e for e in proofs if "held_back" in e["proof"]]
    masked = [e for e in proofs if e["proof"].get("applied") in ("masked", "control")]
    return {
        "flags": len(flags), "notes": len(notes), "proofs": len(proofs),
        "proofs_by_verdict": dict(sorted(Counter(e["proof"].get("verdict") for e in proofs).items())),
        "actions": len(acted) + len(ladder) + len(rewinds), "masked_updates": len(masked),
        "would_act": len(held), "would_act_by": dict(sorted(Counter(e["proof"]["held_back"] for e in held).items())),
        "no_token_steps": sum(1 for e in events if e.get("no_tokens")),
        "breaker": sum(1 for e in events if "breaker" in e),
        "response_failures": sum(1 for e in events if "response_failure" in e or "proof_failed" in e),
        "flag_steps": [int(e["step"]) for e in flags],
        "action_steps": sorted([[int(e["step"]), e["proof"]["verdict"], e["proof"]["applied"]] for e in acted]
                               + [[int(e["step"]), "ladder", e["action"]] for e in ladder]
                               + [[int(e["step"]), "rewind", e["rewind_to"]] for e in rewinds]),
        "would_act_steps": [[int(e["step"]), e["proof"].get("verdict"), e["proof"]["held_back"]] for e in held]}


def read_run(dump: Path) -> dict:
    """A run's counts (:func:`count_events`) plus ``steps_done`` (the last signals row's
    step), ``quarantined``, ``tokens_masked`` and the loss at the start and the end;
    ``read_error`` when the ledger is missing or unreadable."""
    from titan_ledger.errors import LedgerError
    from titan_ledger.format.reader import RunLedger

    out = {"steps_done": 0, "quarantined": 0, "tokens_masked": 0, "loss_first": None, "loss_last": None,
           **count_events([])}
    try:
        rows = RunLedger(dump).signal_rows()
        out.update(count_events(spike_history(dump)))
        out["quarantined"] = proven_lines(dump)
    except (LedgerError, OSError, ValueError) as e:
        return {**out, "read_error": str(e)[-400:]}
    if rows:
        out["steps_done"] = int(rows[-1].get("last_step") or rows[-1]["step"])
    out["tokens_masked"] = sum(int(r.get("masked_tokens") or 0) for r in rows)
    losses = [float(r["loss"]) for r in rows if not r.get("skipped") and isinstance(r.get("loss"), (int, float))]
    if losses:
        out["loss_first"], out["loss_last"] = round(losses[0], 4), round(sum(losses[-20:]) / len(losses[-20:]), 4)
    return out


# --------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Run:
    corpus: str
    seed: int
    policy: str
    steps: int

    @property
    def name(self) -> str:
        return f"{self.corpus}_s{self.seed}_{self.policy}_{self.steps}st"


def grid(names, seeds, policies, steps) -> list[Run]:
    return [Run(c, s, p, steps) for c in names for s in seeds for p in policies]


def train_args(run: Run, prefix: Path) -> list[str]:
    source = [] if run.corpus in TEXT_SOURCE else ["--dataloader.source", "indexed", "--dataloader.paths", str(prefix)]
    args = ["--job.config_file", str(CONFIG), "--training.steps", str(run.steps), *source,
            "--debug.seed", str(run.seed), "--dataloader.seed", str(run.seed), "--metrics.log_freq", "100",
            *FLAGS.get(run.corpus, ())]
    if run.policy == "act":
        args += ["--ledger.response.policy", "act"]
    return args


def run_one(run: Run, prefix: Path, info: dict, folder: Path, fresh: bool) -> dict:
    """Trains ``run`` into ``folder/run.name`` (reused when recorded complete on the same
    corpus and not ``fresh``) and reads it back."""
    dump, log, record = folder / run.name, folder / f"{run.name}.log", folder / f"{run.name}.json"
    old = json.loads(record.read_text()) if record.is_file() and not fresh else None
    reused = bool(old and old.get("rc") == 0 and old.get("corpus_hash") == info["hash"])
    if reused:
        rc, seconds = 0, old["seconds"]
    else:
        shutil.rmtree(dump, ignore_errors=True)
        log.unlink(missing_ok=True)
        t0 = time.monotonic()
        rc = train(train_args(run, prefix), dump, log, nproc=1)
        seconds = round(time.monotonic() - t0, 1)
    res = {**asdict(run), "steps_target": run.steps, "rc": rc, **read_run(dump)}
    if reused and res["steps_done"] != run.steps:  # the record says complete, the ledger does not: train again
        return run_one(run, prefix, info, folder, fresh=True)
    res.update(completed=rc == 0 and res["steps_done"] == run.steps, seconds=seconds, reused=reused,
               corpus_hash=info["hash"], corpus_props=info["properties"], flags_args=list(FLAGS.get(run.corpus, ())),
               dump=str(dump))
    if rc != 0 and log.is_file():
        res["error"] = log.read_text(errors="replace")[-1500:]
    if not reused:
        record.write_text(json.dumps({"rc": rc, "seconds": seconds, "corpus_hash": info["hash"]}) + "\n")
    return res


# --------------------------------------------------------------------------- the summary
TOTALS = ("runs", "completed", "flags", "notes", "proofs", "actions", "masked_updates", "would_act", "quarantined",
          "tokens_masked", "no_token_steps", "response_failures")


def summarize(results: list[dict]) -> dict:
    """Totals per policy and the goal: every run completes, no document quarantined, no update masked."""
    by: dict[str, dict] = {}
    for r in results:
        t = by.setdefault(r["policy"], {k: 0 for k in TOTALS})
        t["runs"] += 1
        t["completed"] += int(r["completed"])
        for k in TOTALS[2:]:
            t[k] += int(r.get(k) or 0)
    goal = {"all_completed": all(r["completed"] for r in results),
            "quarantined": sum(r["quarantined"] for r in results),
            "masked_updates": sum(r["masked_updates"] for r in results)}
    goal["met"] = bool(results) and goal["all_completed"] and goal["quarantined"] == 0 and goal["masked_updates"] == 0
    return {"by_policy": by, "goal": goal}


def goal_line(s: dict) -> str:
    g, by = s["goal"], s["by_policy"]
    runs = sum(t["runs"] for t in by.values())
    done = sum(t["completed"] for t in by.values())
    return (f"goal {'MET' if g['met'] else 'NOT MET'}: {done}/{runs} runs complete, {g['quarantined']} documents "
            f"quarantined, {g['masked_updates']} masked updates; "
            + "; ".join(f"{p}: {t['actions']} actions, {t['would_act']} would act, {t['flags']} flags"
                        for p, t in by.items()))


def table(results: list[dict]) -> list[str]:
    """One markdown row per run (docs/benchmarks.md)."""
    head = ["corpus", "seed", "policy", "steps", "completed", "flags", "notes", "proofs by verdict", "actions",
            "masked", "would act", "quarantined", "tokens masked", "no-token steps", "failures", "s"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in results:
        verdicts = ", ".join(f"{k} {v}" for k, v in r["proofs_by_verdict"].items()) or "-"
        would = (f"{r['would_act']} ({', '.join(f'{k} {v}' for k, v in r['would_act_by'].items())})"
                 if r["would_act"] else "0")
        out.append("| " + " | ".join(str(x) for x in [
            r["corpus"], r["seed"], r["policy"], f"{r['steps_done']}/{r['steps_target']}",
            "yes" if r["completed"] else f"NO (rc {r['rc']})", r["flags"], r["notes"], verdicts, r["actions"],
            r["masked_updates"], would, r["quarantined"], r["tokens_masked"], r["no_token_steps"],
            r["response_failures"], f"{r['seconds']:.0f}"]) + " |")
    return out


def corpora_table(infos: dict[str, dict]) -> list[str]:
    out = ["| corpus | documents | tokens | steps/epoch | property (bundled tokenizer) |", "|---|---|---|---|---|"]
    for name, info in infos.items():
        p = info["properties"]
        out.append(f"| {name} | {p['docs']:,} | {p['tokens']:,} | {p['steps_per_epoch']:,} | "
                   f"{key_property(name, p)} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=CORPORA, help="these corpora (default: all)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--policy", nargs="+", choices=POLICIES, default=["observe"],
                    help="observe: the default response; act: --ledger.response.policy act")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--jobs", type=int, default=2, help="trainings at once (one process each)")
    ap.add_argument("--folder", type=Path, default=OUT)
    ap.add_argument("--corpora-dir", type=Path, default=corpora.OUT, help="prepared corpora (cached by hash)")
    ap.add_argument("--fresh", action="store_true", help="retrain runs already recorded complete")
    ap.add_argument("--json", action="store_true", help="one JSON object per run, then the summary (progress and "
                                                        "the table on stderr)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if a.json else (lambda m: print(m, flush=True))
    a.folder.mkdir(parents=True, exist_ok=True)
    names = a.only or list(CORPORA)
    tok = tokenizer()
    infos = {}
    for name in names:  # prepared one after the other, before any training
        prefix, info = prepare(name, a.steps, a.corpora_dir, tok, log)
        infos[name] = {**info, "prefix": prefix}
    plan = grid(names, a.seeds, a.policy, a.steps)
    results: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        futures = {pool.submit(run_one, r, infos[r.corpus]["prefix"], infos[r.corpus], a.folder, a.fresh): r
                   for r in plan}
        for f in as_completed(futures):
            res = f.result()
            results[futures[f].name] = res
            if a.json:
                print(json.dumps(res), flush=True)
            else:
                log(f"{futures[f].name}: {'complete' if res['completed'] else 'NOT COMPLETE'} "
                    f"({res['steps_done']}/{res['steps_target']}, rc {res['rc']}), {res['flags']} flags, "
                    f"{res['notes']} notes, proofs {res['proofs_by_verdict']}, {res['actions']} actions, "
                    f"{res['masked_updates']} masked, would act {res['would_act_by']}, {res['quarantined']} "
                    f"quarantined, {res['seconds']:.0f} s" + (" (reused)" if res["reused"] else ""))
    ordered = [results[r.name] for r in plan]
    s = summarize(ordered)
    lines = [goal_line(s), "", *corpora_table(infos), "", *table(ordered)]
    (a.folder / "results.json").write_text(json.dumps({"runs": ordered, **s}, indent=1) + "\n")
    if a.json:
        print(json.dumps({"summary": s["by_policy"], "goal": s["goal"], "goal_line": lines[0],
                          "corpora": {n: {"hash": i["hash"], **i["properties"]} for n, i in infos.items()},
                          "seconds": round(time.monotonic() - t0, 1)}), flush=True)
        print("\n".join(lines), file=sys.stderr, flush=True)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
