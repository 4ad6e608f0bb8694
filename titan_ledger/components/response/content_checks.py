"""What a conviction asks of content, across the DP ranks (issue 68).

Design decision: "removing these documents brings the update back" proves only that the
step hangs on them. Data is convicted when it is *harmful*, not merely new, a copy, or
in a model that is broken, so the prover asks, on top of its masks and controls
(:mod:`.prover`), questions of the documents' content -- token shingles
(:mod:`titan_ledger.data.content`), never their ids:

* a near-copy of a convicted document trained unmasked in the same step (a tab run
  beside another tab run of another length): :func:`shared_shares`;
* content like it trained before without a flag (the ``*`` runs before a 381-``*``
  document): :func:`seen_shares`, read from the ledger's :class:`~titan_ledger.data.content.ContentMemory`;
* the data of the same novelty -- the next step's, fetched before a deferred decision is
  made -- with the convicted content masked (:func:`masked_next`), executed on the same
  weights: abnormal too, the step was new data, not bad data.

Each rank holds its own batches' tokens; the convicted documents' shingles are gathered to
every rank (one ``all_gather_object``, a flagged step only) and each answer is reduced
(one ``all_reduce``). Tokens are read from the batches' inputs: a label shifted by one is
the same text.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from titan_ledger.data.content import NEAR, covered, segments_of, shingles


def _tokens_by_doc(groups, tags: list) -> dict[tuple[str, int], np.ndarray]:
    """Each document's tokens in the step's batches (this rank), joined over segments."""
    out: dict[tuple[str, int], list] = {}
    row0 = 0
    for microbatches in groups or ():
        for input_dict, labels in microbatches:
            n = labels.shape[0]
            rows = tags[row0:row0 + n]
            if rows:
                for d, t in segments_of(input_dict["input"].detach().to("cpu").numpy(), rows).items():
                    out.setdefault(d, []).append(t)
            row0 += n
    return {d: np.concatenate(p) for d, p in out.items()}


def _gather(value: Any, topo) -> list:
    import torch.distributed as dist

    if topo.world <= 1:
        return [value]
    every: list = [None] * topo.world
    dist.all_gather_object(every, value)
    return every


def _any(flags: np.ndarray, topo, device) -> np.ndarray:
    """Element-wise OR over every rank (one all_reduce)."""
    import torch.distributed as dist

    if topo.world <= 1 or flags.size == 0:
        return flags
    t = torch.as_tensor(flags.astype(np.float32), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().numpy() > 0


def convicted_shingles(groups, tags: list, docs, topo) -> dict[tuple[str, int], np.ndarray]:
    """The convicted documents' shingles, from every rank's share of them in the step."""
    mine = {d: t for d, t in _tokens_by_doc(groups, tags).items() if d in docs}
    out: dict[tuple[str, int], list] = {}
    for part in _gather({d: t.tolist() for d, t in mine.items()}, topo):
        for d, t in (part or {}).items():
            out.setdefault(tuple(d), []).append(np.asarray(t, dtype=np.int64))
    return {d: shingles(np.concatenate(p)) for d, p in out.items()}


def _shares(conv: dict, flags_of, topo, device) -> dict[tuple[str, int], float]:
    """Per convicted document, the share of its shingles ``flags_of(all hashes)`` marks on
    any rank."""
    keys = sorted(conv)
    allh = np.concatenate([conv[d] for d in keys]) if keys else np.zeros(0, dtype=np.uint64)
    hit = _any(flags_of(allh), topo, device)
    out, at = {}, 0
    for d in keys:
        n = conv[d].size
        out[d] = float(hit[at:at + n].mean()) if n else 0.0
        at += n
    return out


def shared_shares(groups, tags: list, conv: dict, topo, device) -> dict[tuple[str, int], float]:
    """Per convicted document, the share of its shingles that the step's other documents
    (every rank's, not convicted) hold: >= ``NEAR``, a copy of it trained beside it."""
    others = [shingles(t) for d, t in _tokens_by_doc(groups, tags).items() if d not in conv]
    pool = np.unique(np.concatenate(others)) if others else np.zeros(0, dtype=np.uint64)
    return _shares(conv, lambda h: np.isin(h, pool), topo, device)


def seen_shares(memory, conv: dict, step: int, flagged, topo, device) -> dict[tuple[str, int], float]:
    """Per convicted document, the share of its shingles an earlier unflagged step fetched
    (any rank's memory, within its window)."""
    if memory is None:
        return {d: 0.0 for d in conv}
    return _shares(conv, lambda h: memory.seen_before(h, step, flagged), topo, device)


def masked_next(groups, tags: list, docs, conv: dict, ignore: int) -> tuple[list, int]:
    """The next step's batches (this rank's) with the convicted documents and their
    near-copies masked (new label tensors): the control of the same novelty. Returns
    (groups, segments masked)."""
    pool = [h for h in conv.values() if h.size]
    out, hits, row0 = [], 0, 0
    for microbatches in groups or ():
        mbs = []
        for input_dict, labels in microbatches:
            labels = labels.clone()
            n = labels.shape[0]
            tok = input_dict["input"].detach().to("cpu").numpy()
            for r in range(n):
                tag = tags[row0 + r] if row0 + r < len(tags) else None
                start = 0
                for seg in tag.segments if tag else ():
                    key = (tag.source, int(seg.doc))
                    span = tok[r, start:start + len(seg)]
                    if key in docs or any(covered(shingles(span), h) >= NEAR for h in pool):
                        labels[r, start:start + len(seg)] = ignore
                        hits += 1
                    start += len(seg)
            row0 += n
            mbs.append((input_dict, labels))
        out.append(mbs)
    return out, hits


def any_label(groups, topo, device) -> bool:
    """Whether any rank's batches keep a label (the masked next step can be executed)."""
    left = sum(int((labels != -100).sum()) for mbs in groups or () for _, labels in mbs)
    return bool(_any(np.array([left > 0]), topo, device)[0])
