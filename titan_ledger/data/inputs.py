"""What a ``LedgerDataLoader`` opens, opened the same way before any process group.

Design decision: the files a run reads are named in one place. The loader's constructor
opens its source through :func:`open_source` (text: ``text.TextStream``; hf:
``hf.open_source``; indexed: :func:`build_blend` over ``indexed.IndexedCorpus``), and the
entry points check a launch through the same functions before torchrun starts the ranks
(``titan_ledger.train.check_files``): :func:`check_inputs` (every input file exists and
holds data; no tokenizer, no write) and :func:`data_fingerprint` (the fingerprint the
loader will have, compared with the data ledger already in the dump folder). So a missing
or empty file, or another run's data, is refused in one line before any process group,
and the check cannot drift from what training opens.

Its own module: none of this needs the loader's iteration or checkpoint state, and the
loader needs none of its callers (``train``, ``launch``): the loader imports this module,
never the other way. A bundled corpus prepared on first use (``prepare_from``) is prepared
here too (:func:`prepare_once`), by global rank 0, which broadcasts success or its error
message, so every rank raises the same ``CorpusError`` (none hangs).

``config`` below is a ``LedgerDataLoader.Config`` (not annotated: importing the loader
here would be an import cycle).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.distributed as dist
from torchtitan.tools.logging import logger

from titan_ledger.data.indexed import Blend, IndexedCorpus, open_files
from titan_ledger.data.text import TextStream, check_local_input, is_local_path, locate_dataset
from titan_ledger.errors import CorpusError, TitanLedgerError


def fingerprint(described: str, tokenizer, seq_len: int, seed: int) -> str:
    """The data fingerprint (``LedgerDataLoader.fingerprint``): the source's description,
    the tokenizer, ``seq_len`` and the seed, hashed; a resume or a dump folder holding
    another one is refused (``--ledger.allow_data_change`` accepts it)."""
    tok = getattr(tokenizer, "tokenizer", None)
    tok_blob = tok.to_str() if hasattr(tok, "to_str") else repr(type(tokenizer))
    h = hashlib.sha256()
    for part in (described, hashlib.sha256(tok_blob.encode()).hexdigest(), f"L{seq_len}",
                 f"seed{seed}"):
        h.update(part.encode() + b"|")
    return h.hexdigest()[:16]


def open_source(config, tokenizer, seq_len: int, dp_rank: int, dp_size: int):
    """``(source, description)`` of a loader of ``config`` for ``dp_rank`` of ``dp_size``:
    the description is the first part of the data fingerprint. Prepares a first-use
    indexed corpus (``prepare_from``; global rank 0, with a process group)."""
    if config.source == "hf":
        from titan_ledger.data import hf

        config.validate()
        source = hf.open_source(config, tokenizer, seq_len, dp_rank, dp_size)
        return source, source.describe()
    if config.source == "indexed":
        source = build_blend(config, tokenizer, seq_len)
        return source, f"indexed:{source.fingerprint()}"
    source = TextStream(config.dataset, config.dataset_path, tokenizer, seq_len,
                        dp_rank, dp_size, config.seed)
    return source, source.describe()


def build_blend(config, tokenizer, seq_len: int) -> Blend:
    """The indexed source of ``config``: its corpora blended by weight (equal by default),
    a first-use corpus prepared first (``prepare_from``)."""
    config.validate()  # (a config changed after construction)
    weights = list(config.weights) or [1.0] * len(config.paths)
    if config.prepare_from:
        prepare_once(config.prepare_from, config.paths[0], tokenizer)
    corpora = [IndexedCorpus(p, seq_len, config.seed, config.cache_dir or None,
                             shuffle=config.shuffle) for p in config.paths]
    return Blend(corpora, weights)


def unprepared(prefix: str) -> bool:
    """``PREFIX.bin`` or ``PREFIX.idx`` is missing: ``prepare_from`` writes them first."""
    return not (Path(prefix + ".bin").exists() and Path(prefix + ".idx").exists())


#: what ``titan_ledger.prepare`` reads from a folder (``prepare.iter_texts``)
PREPARE_SUFFIXES = (".jsonl", ".json", ".parquet")


def check_inputs(config, *, dry_run: bool = False) -> None:
    """Every input file of a loader of ``config`` exists and holds data, checked before
    any process group: no tokenizer, no ``datasets`` loading, no write (constant time per
    file). ``text``: the dataset's local path (``dataset_path`` or the registry's); ``hf``:
    ``hf.check_files``; ``indexed``: each ``PREFIX.bin`` + ``.idx`` as the loader opens
    them first (``indexed.open_files``), or, for a prefix not yet prepared,
    ``prepare_from``. A dry run
    (``dry_run``: the fake backend) builds an indexed loader without its corpus, so its
    corpora are not checked. Raises ``ConfigError`` / ``CorpusError`` naming the flag and
    the path."""
    from titan_ledger.data import hf

    config.validate()
    if config.source == "hf":
        hf.check_files(config)
    elif config.source == "indexed":
        if dry_run:
            return
        if config.prepare_from and unprepared(config.paths[0]):  # (validate: the one path)
            src = Path(config.prepare_from).expanduser()
            if not (src.is_dir() and ((src / "dataset_info.json").exists()
                                      or (src / "state.json").exists())):  # a save_to_disk folder
                check_local_input("--dataloader.prepare_from", config.prepare_from,
                                  PREPARE_SUFFIXES)
            return
        for prefix in config.paths:
            open_files(prefix)
    else:
        path, _, _ = locate_dataset(config.dataset, config.dataset_path)
        if is_local_path(path):
            flag = ("--dataloader.dataset_path" if config.dataset_path else
                    f"--dataloader.dataset {config.dataset} (no --dataloader.dataset_path: "
                    f"torchtitan's path)")
            check_local_input(flag, path, hf.BUILDERS)


def data_fingerprint(config, tokenizer, seq_len: int, dp_size: int) -> str | None:
    """The data fingerprint (``LedgerDataLoader.fingerprint``: source description,
    tokenizer, seq_len, seed) a loader of ``config`` will have, without a process group.
    The description is the whole source's, the same on every DP rank; it is built for the
    last DP rank, so a corpus with fewer documents than DP ranks is refused here too.
    Costs what the loader's constructor costs (text/hf: ``load_dataset`` of the files,
    memory-mapped; indexed: the .idx headers). ``None`` when it cannot be known before
    training: an indexed corpus still to be prepared (``prepare_from``)."""
    if config.source == "indexed" and config.prepare_from and unprepared(config.paths[0]):
        return None
    import datasets
    from datasets.utils import logging as ds_logging

    bars, verbosity = datasets.is_progress_bar_enabled(), ds_logging.get_verbosity()
    datasets.disable_progress_bars()  # ("Generating train split": a check prints nothing)
    ds_logging.set_verbosity_error()
    try:
        _, described = open_source(config, tokenizer, seq_len, dp_size - 1, dp_size)
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    return fingerprint(described, tokenizer, seq_len, config.seed)


def prepare_once(src: str, prefix: str, tokenizer) -> None:
    """Tokenize ``src`` into ``prefix`` on global rank 0 if missing.

    Rank 0 broadcasts ``None`` (done, or nothing to do) or its error message; the
    broadcast is also the wait of the other ranks, and every rank raises the same
    ``CorpusError`` if rank 0 failed, so no rank waits forever on a failed rank 0.
    """
    from titan_ledger.data import prepare

    multi = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    error: str | None = None
    cause: BaseException | None = None
    if rank == 0:
        if unprepared(prefix):
            logger.info(f"titan_ledger: preparing {prefix}.bin/.idx from {src} (first use)")
            try:
                prepare.prepare([src], prefix, tokenizer=tokenizer, workers=0, progress=False)
            except Exception as e:  # every failure reaches the other ranks
                cause = e
                error = str(e) if isinstance(e, TitanLedgerError) else f"{type(e).__name__}: {e}"
    if multi:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CorpusError(f"--dataloader.prepare_from {src}: preparing {prefix}.bin/.idx on rank 0 "
                          f"failed: {error}") from cause
