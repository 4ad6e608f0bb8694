"""``LedgerDataLoader``: torchtitan's ``ParallelAwareDataloader`` with a data ledger.

Design decision: the loader's position is the number of samples *training* has
consumed (see ``titan_ledger.data.layout``), counted where the trainer takes a
batch (this class's ``__iter__``), never in the workers. Workers, prefetching and
torchdata's ``StatefulDataLoader`` snapshots therefore do not enter the state:
on resume (or after a skip) the iterator is rebuilt at the position, and what
workers had prefetched is simply dropped. What the workers run (``Rows``: worker
``w`` of ``n`` builds the batches ``q`` with ``q % n == w``) is
``titan_ledger.data.batches``.

Each batch carries its rows' provenance (``RowTag``: sample id, source, document
spans); ``__iter__`` strips it before torchtitan sees the batch (torchtitan hands
every extra ``input_dict`` key to ``model.forward``) and keeps it for the
trainer, which writes it to the data ledger. Sources (pure, unit-tested):
``text`` (``titan_ledger.data.text``), ``indexed`` (``titan_ledger.data.indexed``) and
``hf`` (``titan_ledger.data.hf``: local parquet/json/arrow files or cached hub datasets,
map-style or streaming). ``text`` and ``hf`` keep a per-rank cursor; ``indexed`` is
global. For ``indexed`` each ``RowTag`` also carries a 64-bit hash of its row's
tokens (``row_digest``, computed where the row is built), so the data ledger can
store a step as (sample range, hash) and derive the rows (``derive_rows``).

Any base config: ``as_ledger_dataloader`` replaces torchtitan's own loader config
in a trainer config by ``LedgerDataLoader.Config``; the TOML front end calls it when
``[dataloader] source`` / ``--dataloader.source`` is given. Under torchtitan's fake
backend (a dry run) a missing indexed corpus is a warning, not an error.

Bad input: ``Config.__post_init__`` checks every ``--dataloader.*`` value it can
without I/O or a process group (``ConfigError`` naming the flag), so a bad flag
stops before any process group starts; so does a missing or empty input file
(``inputs.check_inputs``) and, where the dump folder already holds a data ledger,
another data fingerprint (``inputs.data_fingerprint``): the entry points call both
before any process group, through the functions the constructor opens its source
with (``titan_ledger.data.inputs``, which also prepares a first-use corpus).

Profiling: the provenance work (building tags where a batch is built, in ``Rows``;
handing them to the trainer in ``__iter__`` / ``take_tags``) runs inside
``torch.profiler.record_function(TAGGING_SPAN)`` spans (host only, no device sync),
so a profile can sum the ledger's data-side cost.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from titan_ledger.data.batches import TAGGING_SPAN, Rows
from titan_ledger.data.inputs import fingerprint, open_source
from titan_ledger.data.layout import RowTag, round_size, sample_id
from titan_ledger.data.text import Cursor, register_bundled
from titan_ledger.errors import ConfigError, CorpusError, DataStateError

# the bundled corpus by name (--dataloader.dataset stdlib_docs), for torchtitan's
# validator dataloader as well as ours
register_bundled()

STATE_KEY = "titan_ledger_data"


@dataclass
class SkipInfo:
    position_before: int
    position_after: int
    tags: list[RowTag] | None  # this DP rank's skipped rows (text streams); None if derivable


class LedgerDataLoader(ParallelAwareDataloader):
    """Tagged, skippable, exactly resumable packed-text dataloader."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "stdlib_docs"
        """``source = "text"``: a dataset of torchtitan's registry: ``stdlib_docs`` (the
        bundled corpus, ``titan_ledger/assets/corpus``) or torchtitan's own (``c4_test``
        reads a local folder of JSONL; ``dataset_path`` overrides a registry path)."""

        source: Literal["text", "indexed", "hf"] = "text"
        """``text``: tokenize documents on the fly, per DP rank (DP size fixed on
        resume). ``indexed``: Megatron .bin/.idx corpora from ``paths`` with a global
        sample order (O(1) skip; DP size may change on resume). ``hf``: Hugging Face
        ``datasets`` (local parquet/json/arrow ``data_files`` or a cached hub dataset
        ``hf_path``), map-style or ``streaming``, tokenized on the fly like ``text``."""

        hf_path: str = ""
        """``source = "hf"``: ``load_dataset``'s path: a cached hub dataset id, a local
        folder, or a builder (parquet, json, arrow); default: from the suffix of
        ``data_files``."""

        data_files: list[str] = field(default_factory=list)
        """``source = "hf"``: data files (globs and folders expanded, sorted); document
        id = file index << 40 | row (with one file: the row)."""

        hf_name: str = ""
        """``source = "hf"``: the dataset's configuration name (``load_dataset(path, name)``)."""

        split: str = "train"
        """``source = "hf"``: the split."""

        text_key: str = "text"
        """``source = "hf"``: the column holding the document text."""

        streaming: bool = False
        """``source = "hf"``: read as an ``IterableDataset`` (no random access: DP rank
        r of n takes rows r, r+n, ... of each file; resume skips to (file, row))."""

        paths: list[str] = field(default_factory=list)
        """``source = "indexed"``: corpus prefixes (``PREFIX.bin`` + ``PREFIX.idx``)."""

        weights: list[float] = field(default_factory=list)
        """``source = "indexed"``: mixture weights, one per path (default: equal)."""

        prepare_from: str = ""
        """``source = "indexed"`` with one path: if its .bin/.idx are missing, tokenize
        this JSONL file or folder into it first (global rank 0; the others wait)."""

        seed: int = 1234
        """Shuffle seed: document and row order of the indexed corpus, document order
        of text epochs after the first."""

        shuffle: bool = True
        """``source = "indexed"``: shuffle documents and rows per epoch (off: the
        corpus order, identical to the text stream for one DP rank)."""

        cache_dir: str = ""
        """``source = "indexed"``: where index arrays are cached (default
        ``PREFIX.cache/`` beside each corpus)."""

        tagging: bool = True
        """Tag rows with sample id and document spans and write the data ledger
        (``<dump_folder>/ledger/data_dp<r>.jsonl``)."""

        derive_rows: bool = True
        """``source = "indexed"``: a step's data-ledger row holds its sample range and
        a 64-bit hash of the tokens trained instead of every row's provenance (O(1)
        per step; ``lookup`` derives the rows from the corpus and checks the hash).
        Off: the rows are written out as for text sources."""

        def __post_init__(self) -> None:
            # slots=True rebuilds the class, so zero-argument super() would fail here
            parent = getattr(super(LedgerDataLoader.Config, self), "__post_init__", None)
            if parent is not None:
                parent()
            # `--dataloader.paths ''` clears a TOML's list (e.g. to switch a recipe's source)
            self.paths = [p for p in self.paths if str(p)]
            self.data_files = [f for f in self.data_files if str(f)]
            self.validate()

        def validate(self) -> None:
            """What can be checked without I/O or a process group; ``ConfigError``
            naming the flag (``--dataloader.X``)."""
            if self.source not in ("text", "indexed", "hf"):
                raise ConfigError(f"--dataloader.source {self.source!r}: expected 'text', "
                                  f"'indexed' or 'hf'")
            for flag in ("shuffle", "tagging", "streaming"):
                if not isinstance(getattr(self, flag), bool):
                    raise ConfigError(f"--dataloader.{flag} {getattr(self, flag)!r}: expected true "
                                      f"or false")
            if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
                raise ConfigError(f"--dataloader.seed {self.seed!r}: expected an integer >= 0")
            if self.num_workers < 0:
                raise ConfigError(f"--dataloader.num_workers {self.num_workers}: expected >= 0")
            if self.prefetch_factor is not None:
                if self.prefetch_factor < 1:
                    raise ConfigError(f"--dataloader.prefetch_factor {self.prefetch_factor}: "
                                      f"expected >= 1")
                if self.num_workers == 0:
                    raise ConfigError("--dataloader.prefetch_factor needs --dataloader.num_workers "
                                      "> 0 (batches are prefetched by workers)")
            hf_only = ("hf_path", "data_files", "hf_name", "streaming")
            if self.source != "hf":
                for flag in hf_only:
                    if getattr(self, flag):
                        raise ConfigError(f"--dataloader.{flag} is only read with "
                                          f"--dataloader.source hf (source is {self.source!r})")
            if self.source == "hf":
                for flag in ("paths", "weights", "prepare_from"):
                    if getattr(self, flag):
                        raise ConfigError(f"--dataloader.{flag} is only read with "
                                          f"--dataloader.source indexed (source is 'hf')")
                if not self.hf_path and not self.data_files:
                    raise ConfigError("--dataloader.source hf needs --dataloader.data_files (local "
                                      "parquet/json/arrow files) or --dataloader.hf_path (a cached "
                                      "hub dataset or a local folder)")
                if not self.text_key:
                    raise ConfigError("--dataloader.text_key: empty; name the text column")
                return
            if self.source == "text":
                if not self.dataset:
                    raise ConfigError("--dataloader.dataset: empty; name a dataset (stdlib_docs, the "
                                      "bundled corpus, or c4_test with --dataloader.dataset_path) "
                                      "or use --dataloader.source indexed")
                for flag in ("paths", "weights", "prepare_from"):
                    if getattr(self, flag):
                        raise ConfigError(f"--dataloader.{flag} is only read with "
                                          f"--dataloader.source indexed (source is 'text')")
                return
            paths = list(self.paths)
            if not paths:
                raise ConfigError("--dataloader.source indexed needs --dataloader.paths (corpus "
                                  "prefixes: PREFIX.bin + PREFIX.idx; see python -m "
                                  "titan_ledger.prepare)")
            for p in paths:
                if not str(p) or str(p).endswith(("/", "\\")):
                    raise ConfigError(f"--dataloader.paths {p!r}: a corpus prefix names files "
                                      f"(corpora/web for corpora/web.bin + .idx), not a folder")
            names = [Path(p).name for p in paths]
            if len(set(names)) != len(names):
                raise ConfigError(f"--dataloader.paths {paths}: corpus names (the last path "
                                  f"component) must be distinct, they name the source in the ledger")
            if self.weights:
                if len(self.weights) != len(paths):
                    raise ConfigError(f"--dataloader.weights has {len(self.weights)} entries for "
                                      f"{len(paths)} --dataloader.paths")
                if not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0
                           for w in self.weights):
                    raise ConfigError(f"--dataloader.weights {list(self.weights)}: each must be a "
                                      f"finite number > 0")
            if self.prepare_from and len(paths) != 1:
                raise ConfigError(f"--dataloader.prepare_from needs exactly one --dataloader.paths, "
                                  f"got {len(paths)}")

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = None,
                 **kwargs):
        self.kind = config.source
        self.mbs = int(local_batch_size)
        self.seq_len = int(seq_len)
        try:
            source, described = open_source(config, tokenizer, seq_len, dp_rank, dp_world_size)
        except CorpusError as e:
            if config.source != "indexed" or not _dry_run():
                raise
            # torchtitan's fake backend builds, never iterates: a recipe checked on
            # a laptop before its corpus is prepared still builds
            logger.warning(f"titan_ledger: dry run: {e} -- the indexed loader is built "
                           f"without its corpus; prepare it before training")
            source, described = None, "indexed:unopened-dry-run"
        self.source = source
        self.spec = {"dataset": (config.dataset if config.source != "hf"  # (hf: see spec["hf"])
                                 else f"hf:{source.name}"),
                     "dataset_path": (str(Path(config.dataset_path).resolve())
                                      if config.dataset_path else None),
                     "paths": [str(Path(p).resolve()) for p in config.paths],
                     "weights": list(config.weights) or [1.0] * len(config.paths),
                     "seed": config.seed, "shuffle": config.shuffle,
                     "cache_dir": config.cache_dir,
                     "hf": ({"hf_path": config.hf_path, "hf_name": config.hf_name,
                             "data_files": source.spec.files, "builder": source.spec.builder,
                             "split": config.split, "text_key": config.text_key,
                             "streaming": config.streaming} if config.source == "hf" else None),
                     # how Blend picks a corpus per sample (titan_ledger.data.indexed.BLEND_RULE);
                     # absent in ledgers written before rule 2, which used rule 1
                     "blend_rule": getattr(source, "rule", None)}
        self.fingerprint = fingerprint(described, tokenizer, seq_len, config.seed)
        self.description = described
        self.tagging = config.tagging
        self.derive_rows = bool(config.derive_rows) and config.source == "indexed"
        self.allow_data_change = False  # set by LedgerTrainer from --ledger.allow_data_change
        self._position = 0
        self._cursor = Cursor()
        self._tags: list[RowTag] = []
        self._restart = False
        rows = Rows(config.source, source, self.mbs, dp_rank, dp_world_size, config.tagging)
        super().__init__(
            rows, dp_rank=dp_rank, dp_world_size=dp_world_size,
            batch_size=None,  # Rows yields whole batches (a worker owns a batch)
            num_workers=config.num_workers,
            persistent_workers=False,  # a restart must see the new start position
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            # torchdata's snapshots are never read (our state is the position): take none
            snapshot_every_n_steps=1 << 40,
        )
        if config.persistent_workers:
            logger.warning("titan_ledger: --dataloader.persistent_workers is ignored (workers "
                           "restart at the consumed position after a skip or resume)")

    # ------------------------------------------------------------------ iteration
    @property
    def position(self) -> int:
        """Samples consumed by training (all DP ranks), including skipped ones."""
        return self._position

    @property
    def round(self) -> int:
        return round_size(self.mbs, self.dp_world_size)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            self.dataset.start_position = self._position
            self.dataset.start_cursor = self._cursor
            self._restart = False
            it = super().__iter__()
            for input_dict, labels, meta in it:
                # consumed now: the trainer asked for this batch
                self._position += self.round
                if meta["cursor"] is not None:
                    self._cursor = Cursor.from_json(meta["cursor"])
                if meta["tags"] is not None:
                    with torch.profiler.record_function(TAGGING_SPAN):
                        self._tags.extend(meta["tags"])
                yield input_dict, labels
                if self._restart:
                    break
            else:
                return
            del it  # shuts its workers down; their prefetched batches were never consumed

    def take_tags(self) -> list[RowTag]:
        """Provenance of the rows consumed since the last call (this DP rank)."""
        with torch.profiler.record_function(TAGGING_SPAN):
            tags, self._tags = self._tags, []
        return tags

    def skip(self, n_batches: int) -> SkipInfo:
        """Consume ``n_batches`` batches per DP rank without building them.

        Indexed corpus: an addition. Text stream: the tokenizer walks the
        documents (no batch tensors). The next batch comes from a fresh iterator.
        """
        before = self._position
        tags = None
        if self.kind != "indexed":
            stream = self.source.rows(self._cursor, build=False)
            n_rows = n_batches * self.mbs
            tags = [] if self.tagging else None
            for k in range(n_rows):
                segs, cursor, _, _ = next(stream)
                if tags is not None:
                    q, j = divmod(k, self.mbs)
                    sid = sample_id(before + q * self.round, self.dp_rank, self.mbs, j)
                    tags.append(RowTag(sid, self.source.name, segs))
                self._cursor = cursor
        self._position = before + n_batches * self.round
        self._restart = True
        return SkipInfo(before, self._position, tags)

    # ------------------------------------------------------------------ documents
    def document_facts(self, source: str, doc: int) -> tuple[int, str] | None:
        """``(tokens, content digest)`` of document ``doc`` of corpus ``source`` as this
        run's corpus holds it (BOS and EOS included): a proof's content control and its
        quarantine bound read them, on a flagged step only. None where the source cannot
        read a document back by its id (a streaming source) or does not hold ``source``."""
        src = self.source
        if src is None:
            return None
        if self.kind == "indexed":
            corpus = next((c for c in src.corpora if c.name == source), None)
            if corpus is None:
                return None
            tokens = corpus.doc_tokens(int(doc))
        elif getattr(src, "name", None) == source and hasattr(src, "doc_tokens"):
            tokens = src.doc_tokens(int(doc))
        else:
            return None
        arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
        return len(arr), hashlib.blake2b(arr.tobytes(), digest_size=8).hexdigest()

    def corpus_share(self, source: str, tokens: int) -> float | None:
        """The share of the training data that ``tokens`` tokens of corpus ``source`` are:
        over that corpus's tokens, times its blend weight (an indexed corpus: the
        expected share of any stretch of a shuffled run, exact over an epoch); None where
        the corpus's size is not known before it is read (text and hf sources)."""
        if self.kind != "indexed" or self.source is None:
            return None
        for corpus, weight in zip(self.source.corpora, self.source.weights):
            if corpus.name == source:
                total = int(np.asarray(corpus.lengths, dtype=np.int64).sum())
                return float(tokens) / total * float(weight) if total else None
        return None

    def scan(self, docs: set, first: int, steps: int, global_batch: int, max_rows: int = 200_000) -> dict | None:
        """``docs`` ({(source, doc)}) in the ``steps`` steps from global sample position
        ``first`` on, read in the corpus's own order (the layout's sample ids, all DP ranks;
        at most ``max_rows`` rows): ``{"steps", "rows", "tokens"`` (theirs) ``, "total"``
        (all) ``, "empty"`` (step offsets every token of which is theirs) ``, "with"``
        (``[offset, their tokens]`` of each step holding some) ``}``. An indexed corpus only
        (its rows are a function of the sample id); None for text and hf sources, which
        are read as they stream. A proof's quarantine reads the steps ahead of a
        conviction (would one be emptied?) and behind it (did these documents train
        before without a flag?)."""
        if self.kind != "indexed" or self.source is None or global_batch <= 0 or steps <= 0:
            return None
        first = max(0, int(first))
        n = max(1, min(int(steps), int(max_rows) // global_batch))
        mine = tot = 0
        empty, holding = [], []
        for t in range(n):
            step_mine = step_tot = 0
            for i in range(first + t * global_batch, first + (t + 1) * global_batch):
                tag = self.source.tag(i)
                for seg in tag.segments:
                    step_tot += len(seg)
                    if (tag.source, seg.doc) in docs:
                        step_mine += len(seg)
            if step_mine:
                holding.append([t, step_mine])
                if step_mine == step_tot:
                    empty.append(t)
            mine, tot = mine + step_mine, tot + step_tot
        return {"steps": n, "rows": n * global_batch, "tokens": mine, "total": tot, "empty": empty, "with": holding}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        cursors = {str(self.dp_rank): self._cursor.to_json()}
        if self.kind != "indexed" and dist.is_initialized() and dist.get_world_size() > 1:
            # One global value for all ranks (DCP keeps one copy of a shared key), so a
            # resume with another DP size can be told apart from a missing key.
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, cursors)
            cursors = {k: v for c in gathered for k, v in c.items()}
        state = {"position": self._position, "dp_size": self.dp_world_size, "kind": self.kind,
                 "mbs": self.mbs, "fingerprint": self.fingerprint, "source": self.description,
                 "cursors": cursors if self.kind != "indexed" else {}}
        return {STATE_KEY: json.dumps(state, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        blob = state_dict.get(STATE_KEY)
        if blob is None:
            raise DataStateError(
                "the checkpoint's dataloader state was not written by LedgerDataLoader; to start "
                "its data from the beginning, add 'dataloader' to --checkpoint.exclude_from_loading")
        state = json.loads(blob)
        if state["fingerprint"] != self.fingerprint and not self.allow_data_change:
            raise DataStateError(
                f"the data changed since the checkpoint (source, tokenizer, seq_len, seed or "
                f"the blend rule): "
                f"checkpoint {state['source']} fingerprint {state['fingerprint']}, this run "
                f"{self.description} fingerprint {self.fingerprint}; pass "
                f"--ledger.allow_data_change to continue at sample {state['position']} anyway")
        if self.kind != "indexed" and state["dp_size"] != self.dp_world_size:
            what = ("a streaming dataset's" if self.kind == "hf" and self.spec["hf"]["streaming"]
                    else f"a {self.kind} source's")
            raise DataStateError(
                f"the checkpoint was written with {state['dp_size']} DP ranks, this run has "
                f"{self.dp_world_size}: {what} position is per DP rank (each rank's own "
                f"cursor: file/document, row, token offset). Keep the DP "
                f"size, or train from an indexed corpus (--dataloader.source indexed, see "
                f"`python -m titan_ledger.prepare`), whose position is global")
        self._position = int(state["position"])
        if self.kind != "indexed" and state.get("kind") == self.kind:
            self._cursor = Cursor.from_json(state["cursors"][str(self.dp_rank)])
        else:
            self._cursor = Cursor()
        self._restart = True

    def header(self) -> dict[str, Any]:
        """What the data ledger's header records about this loader."""
        return {"source_kind": self.kind, "source": self.description,
                "fingerprint": self.fingerprint, "mbs": self.mbs, "seq_len": self.seq_len,
                "dp_size": self.dp_world_size, "dp_rank": self.dp_rank, "spec": self.spec}


#: Fields every ``ParallelAwareDataloader.Config`` (and torchtitan's HF text loader) has
#: that ``LedgerDataLoader.Config`` keeps when it replaces another loader's config.
_CARRIED = ("dataset", "dataset_path", "num_workers", "pin_memory", "prefetch_factor")


def as_ledger_dataloader(trainer_config) -> bool:
    """Give ``trainer_config`` a ``LedgerDataLoader.Config`` in place of its loader config.

    For base configs built around torchtitan's own loader (e.g. ``--module
    torchtitan.models.llama3 --config llama3_8b``, or titan_ledger's 8B/70B/405B
    recipes): the TOML front end calls it when ``[dataloader] source`` (or
    ``--dataloader.source``) is given, so any base config can read any source with
    no new config function. Carries ``dataset``, ``dataset_path`` and the worker
    settings over; every other field
    takes ``LedgerDataLoader.Config``'s default and is then set by the flags.
    Returns True if it replaced the config (False: already ours).
    """
    old = trainer_config.dataloader
    if isinstance(old, LedgerDataLoader.Config):
        return False
    kept = {k: getattr(old, k) for k in _CARRIED if getattr(old, k, None) is not None}
    if not kept.get("dataset"):
        kept.pop("dataset", None)
    if (kept.get("num_workers") or 0) == 0:
        kept.pop("prefetch_factor", None)  # (validate: needs workers)
    trainer_config.dataloader = LedgerDataLoader.Config(**kept)
    return True


def _dry_run() -> bool:
    """A torchtitan ``--comm.mode fake_backend`` process group (builds, moves no data)."""
    return dist.is_initialized() and dist.get_backend() == "fake"
