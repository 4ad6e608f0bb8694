"""The conviction of data at the alarm: which documents a proof convicts, and whether the conviction holds.

Design decision: the prover (:mod:`.prover`) executes the step and judges the executions
(``verdict.judge``); what follows a ``bad_data`` verdict -- group testing down to the
documents the update hangs on (``bisection.bisect_documents``, the executions its glue
asks for), then the checks that a convicted document is harmful, not merely new, a copy,
or in a broken model (issue 68: near copies, a run unstable as a whole, the LR's
fingerprint, content seen before, the model's own abnormal updates, the data of the same
novelty) and the quarantine's coverage -- is one concern, here. :class:`Conviction` is
built by the prover for each use from its state as it stands then (``model_made`` and
``next_rec`` are set between proofs by ``Recovery``), executes through the prover's own
``_run`` (passed in: this module does not import the prover, no cycle among siblings), and
hands back the convicted masks (:attr:`Conviction.hits`) for ``Prover.convict``. The
proof's working state (:class:`ProofCase`), which the prover's steps and these fill in
turn, is declared here too, so the prover imports from this module and never the
reverse. Split from :mod:`.prover` (one concern per file).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from titan_ledger.components.response.bisection import BISECT_BALANCE, bisect_documents
from titan_ledger.components.response.bounds import Coverage, quarantine_coverage
from titan_ledger.components.response.config import ConvictionConfig, ProofConfig
from titan_ledger.components.response.host import LedgerPort, RunFacts
from titan_ledger.components.response.reexecution import Reexecution
from titan_ledger.components.response.verdict import (
    Execution,
    Suspect,
    Verdict,
    document_tokens,
    mask_labels,
    normal_update,
    stands_out,
)
from titan_ledger.format.proofs import Applied, Finding

#: the steps before a conviction whose flags say whether the run is unstable as a whole
#: (``--ledger.conviction.unstable_flags``; the ledger keeps the last 64 rows written)
UNSTABLE_WINDOW = 64
#: how many model-made abnormal steps the prover remembers (only the latest within the look-back is asked)
MODEL_MADE_KEPT = 64
#: documents whose loss is within this log ratio of the rest of their step's "do not stand out": the
#: broken-LR runs' convictions of ordinary docstrings were 0.03-0.09 (1.03-1.09x); the zoo's planted
#: documents -0.59 to +0.19 (0.55-1.20x), one of six within it (bad_data_ngram_b, 0.95x: convicted
#: because its model never spiked on its own) (bench/adversarial.py broken_lr_text; bench/zoo.py, issue 68)
ORDINARY_LOSS = 0.15


@dataclass
class ProofCase:
    """One proof's working state, which its steps (``Prover._prove``) fill in order. Declared
    here, beside the side that fills its later half (the bisection, the holders, the content,
    the coverage, the checks), so that the prover imports it from here and nothing here
    imports the prover: no cycle between sibling modules."""

    rec: Any
    again: Reexecution
    first_grads: Any  # the first execution's gradients (in the step) or what a deferral kept
    original: Execution  # the first execution, gathered
    groups: list  # the step's batches
    detector: Any  # the run's spike detector (its history judges every execution)
    rtol: float
    factor: float
    repeats: list = field(default_factory=list)  # the same batch again (one, or two)
    distances: list | None = None  # the executions' noise, where no two agree bit for bit
    adam: dict | None = None  # Adam's check
    suspect: Suspect | None = None
    ctrl: Suspect | None = None
    c_groups: list | None = None  # the batches with the control's data masked
    control: Execution | None = None
    masked: Execution | None = None
    hits: list = field(default_factory=list)  # this rank's masked segments of the suspect
    tags_by_dp: dict = field(default_factory=dict)
    after: list = field(default_factory=list)  # executions after the verdict (a convicted control, group testing)
    bisection: Any = None
    everywhere: bool = False  # the convicted documents masked on every rank that holds them
    holders: list = field(default_factory=list)
    content: dict | None = None
    coverage: Coverage | None = None
    fragile: dict | None = None  # the LR's fingerprint where it held back a conviction
    checks: dict | None = None  # the conviction's content checks (near copies, stands out, seen before, novelty)


@dataclass
class Conviction:
    """The conviction's side of one proof (``Prover`` builds it where a verdict convicts
    data, from its state as it is then): group testing (:meth:`group_test`) and the
    conviction's checks (:meth:`check`)."""

    ledger: LedgerPort
    facts: RunFacts
    proof: ProofConfig  # [ledger.proof] (``bisect``)
    config: ConvictionConfig  # [ledger.conviction]
    run: Callable[..., Execution]  # the prover's execution of the step (``Prover._run``)
    groups: dict  # the prover's batches per applied variant (an update applied later is executed from them)
    model_made: list[int]  # the prover's model-made abnormal steps (``Prover.model_made``)
    next_rec: Any  # the step after the one proven, fetched (deferred decisions), else None
    #: this rank's [row, segment] of the convicted documents where the conviction holds (``Prover.convict``
    #: applies them), else None
    hits: list | None = field(default=None, init=False)

    def group_test(self, case: ProofCase, v: Verdict) -> Verdict:
        """Group testing (``[ledger.proof] bisect``): where the step is abnormal and no document is
        named yet, halves of the step's documents masked round by round; the documents
        whose mask alone brings the update back are convicted, their update in place."""
        from torchtitan.components.loss import IGNORE_INDEX

        c = case
        topo = self.facts.topo
        sizes = _documents(c.tags_by_dp, None if v.verdict == Finding.NOT_DATA or c.suspect is None
                           else c.suspect.dp_rank)
        if not (self.proof.bisect and len(sizes) > 1 and not c.original.normal and (
                v.verdict == Finding.NOT_DATA or (v.verdict == Finding.BAD_DATA and c.suspect is not None
                                                  and c.suspect.docs is None))):
            return v
        # searching the whole step, the halves are each other's only control: the size rule
        # (BISECT_BALANCE); inside a rank whose whole batch an equal-size mask (the other
        # rank's) already convicted, the rounds only narrow it down
        c.bisection, trail = self._bisect(c.again, c.rec, c.groups, c.first_grads, c.original, sizes,
                                          BISECT_BALANCE if v.verdict == Finding.NOT_DATA else None)
        c.after.extend(trail)
        if c.bisection.documents:
            docs = c.bisection.documents
            m_groups, c.hits = mask_labels(c.groups, c.rec.tags, Suspect(topo.dp_rank, docs), IGNORE_INDEX)
            # the convicted set's update, in place (its own name: ``masked`` stays the rank
            # mask's execution, which the record lists before the bisection's)
            in_place = self.run(Applied.MASKED, c.again, m_groups, c.first_grads)
            in_place.normal = normal_update(c.detector, in_place.loss, in_place.grad_norm, c.original.loss)
            c.after.append(in_place)
            self.groups[Applied.MASKED] = m_groups
            c.holders = sorted(dp for dp, tags in c.tags_by_dp.items() if set(document_tokens(tags or [])) & docs)
            c.suspect, c.everywhere = Suspect(c.holders[0] if c.holders else 0, docs, "bisection"), True
            searched = len(c.bisection.path[0]["a"] | c.bisection.path[0]["b"])
            return Verdict(Finding.BAD_DATA, Applied.MASKED,
                           why=f"group testing: masking {len(docs)} of the step's {searched} documents brings the "
                               f"update back to normal; masking the other half, at every round, does not")
        if v.applied in (Applied.MASKED, Applied.CONTROL):  # a whole rank stands: its update in place again
            rerun = self.run(v.applied, c.again, self.groups[v.applied], c.first_grads)
            rerun.normal = normal_update(c.detector, rerun.loss, rerun.grad_norm, c.original.loss)
            c.after.append(rerun)
        return v

    def check(self, case: ProofCase, v: Verdict) -> Verdict:
        """Data convicted: harmful, not merely new, a copy, or in a broken model (issue 68).
        Not where a near-copy of its content trained beside it, where the run is unstable
        as a whole or its LR made it fragile, where content like theirs trained before
        without a flag, where the model made an update abnormal with no data to blame within
        the look-back and the documents' loss does not stand out from the rest's (a model a
        high LR broke spikes on ordinary text), nor where the data of the same novelty --
        the next step's, the convicted content masked, on the same weights -- is abnormal
        too; otherwise its masks are kept for ``Prover.convict`` (:attr:`hits`). Without a next step to ask (a
        decision made in the step; a next step that is the convicted document itself), data
        harder than the rest of its step is not convicted -- a new kind of text is harder, and
        so is garbage, and without the data of the same novelty they cannot be told apart --
        while data easier than the rest (repeated, degenerate: no shift makes text easier) is;
        where neither can be measured the conviction stands unacted (``novelty``). The
        quarantine's coverage is measured either way. The documents' own loss against the
        rest of the step's (``content.stands_out``) is no bar by itself: a cold model gives
        everything the same loss -- the tour's injected batch of one repeated token trained
        at 7.63 against the step's 7.64 at step 10, and is bad data all the same."""
        from titan_ledger.components.response import content_checks as cc
        from titan_ledger.data.content import NEAR

        c = case
        ledger = self.ledger
        docs = c.suspect.docs
        if docs is None:  # the whole batch of the suspect rank: its documents
            docs = frozenset(document_tokens(c.tags_by_dp.get(c.suspect.dp_rank) or []))
        c.suspect = replace(c.suspect, docs=frozenset(docs))
        every = set(_documents(c.tags_by_dp, None))
        c.content = self._content(sorted(every))
        here = sum(n for d, n in _documents(c.tags_by_dp, None).items() if d in docs)
        c.coverage = self._coverage(sorted(docs), c.content, c.tags_by_dp)
        before = (c.coverage.ahead or {}).get("before_clean", 0) if c.coverage.ahead else 0
        conv = cc.convicted_shingles(c.groups, c.rec.tags, docs, self.facts.topo)
        shared = cc.shared_shares(c.groups, c.rec.tags, conv, self.facts.topo, self.facts.device)
        copies = sorted(d for d, x in shared.items() if x >= NEAR)
        c.checks = {"near_copies": {f"{s}:{d}": round(x, 3) for (s, d), x in shared.items()}}
        if copies:  # the control must be other content: a copy of it trained normally beside it
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but a near-copy of {len(copies)} of the {len(docs)} convicted documents "
                               f"(>= {NEAR:.0%} of their token shingles) trained unmasked in this step: masking them "
                               f"explains nothing a mask of their copies would not")
        if unstable := self._unstable(c.rec.step):  # the run flags step after step: its fragility, not data
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the run flagged {unstable} of the {UNSTABLE_WINDOW} steps before this "
                               f"one: unstable as a whole, a document that triggers a step in it is not proven bad "
                               f"(--ledger.conviction.unstable_flags {self.config.unstable_flags})")
        if not self.config.fragile and (fragile := self._fragile()) is not None:
            # the LR's fingerprint holds: every update moves the weights so far that masking
            # any data changes the step; a document that triggers it is not proven bad
            c.fragile = fragile
            moved = fragile.get("relative_update_pre_median") or fragile.get("param_norm_change_pre_median") or 0
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the LR's fingerprint holds (the updates moved the weights {moved:.1%} "
                               f"of their norm a step): in a run the LR made this fragile, a document that triggers "
                               f"a step is not proven bad (--ledger.conviction.fragile to convict anyway)")
        applied = self._convicted_execution(c, v)
        if applied is not None:  # their own loss against the rest of the step's (recorded; not a bar: below)
            theirs, rest, y = stands_out(c.original, applied)
            c.checks["stands_out"] = {"loss": _r(theirs), "rest": _r(rest), "log_ratio": _r(y)}
        past = ledger.history()
        seen = cc.seen_shares(past.content, conv, c.rec.step, past.flagged, self.facts.topo, self.facts.device)
        c.checks["seen_before"] = {f"{s}:{d}": round(x, 3) for (s, d), x in seen.items()}
        if seen and all(x >= NEAR for x in seen.values()):
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but content like the convicted documents' (>= {NEAR:.0%} of their token "
                               f"shingles) trained in earlier steps without a flag: their content is not what made "
                               f"this step abnormal")
        if before >= here > 0:  # the same documents trained before, as much of them, without a flag
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the convicted documents trained {before} tokens in earlier steps "
                               f"without a flag ({here} here): what made this step abnormal is not their content")
        y = (c.checks.get("stands_out") or {}).get("log_ratio")
        made = self._model_made(c.rec.step)
        if made is not None:
            c.checks["model_made"] = {"step": made}
        if made is not None and y is not None and abs(y) < ORDINARY_LOSS:
            # a model that spikes on its own, and documents it finds no harder or easier than the rest: the
            # step hangs on them, but nothing in them is what a harmful document's loss shows
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the model made an abnormal update with no data to blame at step {made}, "
                               f"and the documents' loss is ordinary ({math.exp(y):.2f}x the rest's): in a model that "
                               f"spikes on its own, data that does not stand out is not proven bad")
        novel = self._novelty(c, docs, conv)
        if novel is not None and not novel.normal:
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but the next step's data, the convicted content masked, is abnormal on "
                               f"the same weights too (grad norm {novel.grad_norm:.3g}): the data of the same "
                               f"novelty is as abnormal -- new data, not bad data")
        if novel is None and y is not None and y > 0:
            # no data of the same novelty to ask, and the documents are harder than the rest: a new kind of
            # text is, and so is garbage -- they cannot be told apart here (repeated, degenerate content is
            # easier than the rest, and no shift makes text easier)
            return Verdict(Finding.NOT_DATA, Applied.ORIGINAL,
                           why=f"{v.why}; but no data of the same novelty was there to ask "
                               f"({c.checks['novelty']['why']}), and the documents are harder than the rest "
                               f"(loss {math.exp(y):.2g}x): new data and bad data cannot be told apart without it")
        if c.everywhere or c.suspect.dp_rank == self.facts.topo.dp_rank:
            self.hits = c.hits  # applied only if the step acts on the conviction (Prover.convict)
        return v

    @staticmethod
    def _convicted_execution(c: ProofCase, v: Verdict) -> Execution | None:
        """The execution with exactly the convicted documents masked: group testing's in-place
        run, the suspect's mask, or a convicted control's re-run."""
        if v.applied == Applied.MASKED and c.bisection is not None and c.bisection.documents:
            return next((e for e in reversed(c.after) if e.variant == Applied.MASKED), None)
        if v.applied == Applied.CONTROL:
            return next((e for e in reversed(c.after) if e.variant == Applied.CONTROL), None)
        return c.masked

    def _novelty(self, c: ProofCase, docs, conv: dict) -> Execution | None:
        """The control of the same novelty (issue 68): the next step's batches -- fetched
        before a deferred decision is made, on every rank -- with the convicted content
        masked, executed on the weights the flagged step saw (its update is held), judged
        by the run's rules. None where there is no next step (a decision made in the step):
        the conviction then stands without acting (``novelty``)."""
        from torchtitan.components.loss import IGNORE_INDEX

        from titan_ledger.components.response import content_checks as cc

        nxt = self.next_rec
        if nxt is None or not nxt.batches:
            c.checks["novelty"] = {"available": False,
                                   "why": "decided in the step: the next step's data was not fetched yet"}
            return None
        groups, hits = cc.masked_next(nxt.batches, nxt.tags, docs, conv, IGNORE_INDEX)
        if not cc.any_label(groups, self.facts.topo, self.facts.device):
            c.checks["novelty"] = {"available": False, "why": f"the next step ({nxt.step}) is the convicted content "
                                                              f"itself: nothing else to compare with"}
            return None
        ex = self.run("novelty", c.again, groups, c.first_grads)
        ex.normal = normal_update(c.detector, ex.loss, ex.grad_norm)
        c.after.append(ex)
        c.checks["novelty"] = {"available": True, "step": nxt.step, "normal": ex.normal,
                               "grad_norm": round(ex.grad_norm, 6), "loss": round(ex.loss, 6),
                               "masked_segments": hits}
        return ex

    def _fragile(self) -> dict | None:
        """The LR's fingerprint in the rows written before this step (``diagnose``'s F2 over
        the last 20: the update >= 1% of the weights' norm a step, or without
        ``--ledger.update_norm`` the norm itself moving >= 0.2%): its reading, else None."""
        from titan_ledger.components.detection import fingerprints as fp

        rows = list(self.ledger.history().recent)[-20:]
        reading = {"update": fp.relative_update(rows, {})}
        if len(rows) >= 5 and fp.lr_scale(reading, fp.Bars()):
            return {"cause": "lr", **reading["update"]}
        return None

    def _model_made(self, step: int) -> int | None:
        """The latest step before ``step``, within the look-back (``[ledger.conviction]
        lookback``), whose update the model made abnormal with no data to blame, or None."""
        horizon = int(self.config.lookback)
        return next((s for s in reversed(self.model_made) if step - horizon <= s < step), None)

    def _unstable(self, step: int) -> int:
        """The flagged steps among the :data:`UNSTABLE_WINDOW` written before ``step`` when
        they reach ``unstable_flags`` (else 0): a run diverging as a whole."""
        bar = int(self.config.unstable_flags)
        if bar <= 0:
            return 0
        n = sum(1 for r in self.ledger.history().recent
                if r.get("spike") and step - UNSTABLE_WINDOW <= int(r.get("step", 0)) < step)
        return n if n >= bar else 0

    def _coverage(self, docs: list, content: dict, tags_by_dp: dict) -> Coverage:
        """How much of the data quarantining ``docs`` would mask (``bounds``), with --
        an indexed corpus, read in its order from the flagged step's first sample -- the
        next 1,000 steps (an emptied one?) and the 1,000 before (``before_clean``: their
        tokens in earlier steps this process did not flag)."""
        from titan_ledger.data.layout import round_start

        ledger = self.ledger
        loader = self.facts.loader
        sizes = {d: (content.get(d) or (None, None))[0] for d in docs}
        shares = {d: (loader.corpus_share(d[0], sizes[d]) if loader is not None and sizes[d] is not None else None)
                  for d in docs}
        seq_len = int(self.facts.seq_len)
        gb = self.facts.global_batch
        step_tokens = gb * seq_len
        ahead = None
        first = next(((dp, tags[0]) for dp, tags in sorted(tags_by_dp.items()) if tags), None)
        if loader is not None and hasattr(loader, "scan") and first is not None:
            start = round_start(first[1].sample_id, first[0], int(self.facts.local_batch_size))
            ahead = loader.scan(set(docs), start, 1000, gb)
            back = min(1000, start // gb) if gb else 0
            behind = loader.scan(set(docs), start - back * gb, back, gb) if back else None
            if ahead is not None:
                flagged_at = ledger.history().flagged_at
                ahead["before_clean"] = sum(n for k, n in (behind or {}).get("with", [])
                                            if start - (back - k) * gb not in flagged_at)
        # read as it streams (text, hf), a DP rank's rows are its own documents': one document
        # can fill a step only at DP 1
        lone = step_tokens if self.facts.topo.dp_size == 1 else None
        return quarantine_coverage(docs, sizes, shares, step_tokens, float(self.config.max_share),
                                   ahead=ahead, lone_doc_step=lone)

    def _content(self, docs) -> dict:
        """(tokens, content digest) of each document (the corpus's, read back by the
        loader; None where it cannot be): the content control and the quarantine bound."""
        loader = self.facts.loader
        return {d: (loader.document_facts(*d) if loader is not None else None) for d in docs}

    def _bisect(self, again: Reexecution, rec, groups, first_grads, original: Execution, sizes: dict,
                balance: float | None):
        """Group testing over the step's documents (``sizes``: tokens per document, every
        DP rank's or the convicted rank's): each round masks one half on every rank that
        holds its segments, then the other half as its control
        (``verdict.bisect_documents``; ``balance``: its size rule, None inside a rank an
        equal-size mask already convicted). Returns the bisection and its executions
        (variant ``bisect``)."""
        from torchtitan.components.loss import IGNORE_INDEX

        detector = self.ledger.detector
        mine = self.facts.topo.dp_rank
        trail: list[Execution] = []

        def normal_without(docs) -> bool:
            masked = mask_labels(groups, rec.tags, Suspect(mine, frozenset(docs)), IGNORE_INDEX)[0]
            ex = self.run("bisect", again, masked, first_grads)
            ex.normal = normal_update(detector, ex.loss, ex.grad_norm, original.loss)
            trail.append(ex)
            return ex.normal

        return bisect_documents(sizes, normal_without, balance), trail


def _documents(tags_by_dp: dict[int, list], dp_rank: int | None) -> dict:
    """Tokens per (source, doc) in the step: every DP rank's rows, or ``dp_rank``'s."""
    pool = tags_by_dp if dp_rank is None else {dp_rank: tags_by_dp.get(dp_rank) or []}
    sizes: dict = {}
    for tags in pool.values():
        for d, n in document_tokens(tags or []).items():
            sizes[d] = sizes.get(d, 0) + n
    return sizes


def _r(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, 6)
