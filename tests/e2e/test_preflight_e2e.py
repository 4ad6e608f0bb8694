"""What a launch can check from files is refused before any rank starts (issue 26):
a missing or empty corpus, a missing HF ``data_files`` path, and a dump folder that
holds a run with another data fingerprint are ONE stderr line and exit 2 from
``python -m titan_ledger.launch`` (no torchrun summary) and from the training entry
itself (``load_config``, before any process group), and the refused launch writes
nothing into the dump folder (no ``structured_logs/``, no lock, no ledger line).

One 2-step training run (module-scoped, ``slow``) is the run already in the folder. Its
data fingerprint hashes the seed, so ``--dataloader.seed 7`` is "another run's data" at
the same seq_len and global batch. One refusal of each entry runs as a real process (the
missing corpus through ``launch``, a fresh interpreter; the other fingerprint through
``train``, forked from the tests' warm launcher: one line on the process's stderr, exit 2);
the others call the entries' ``main`` in this process
(``helpers.launch_here``, ``train_refused_here``: a fresh interpreter imports torch and
torchtitan for ~10 s), and the variants of each check the functions themselves
(``inputs.check_inputs``, ``inputs.data_fingerprint``, ``run_folder.claim_dump_folder``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import CONFIGS, ROOT, child_env, explain, launch_here, py, torchrun, train_argv, train_refused_here

from titan_ledger.config_registry import CORPUS_DIR, TOKENIZER_DIR
from titan_ledger.data.inputs import check_inputs, data_fingerprint
from titan_ledger.data.loader import LedgerDataLoader
from titan_ledger.errors import ConfigError, CorpusError

slow = pytest.mark.slow  # each real-process case imports torch + torchtitan in a fresh process

DEBUG = str(CONFIGS / "debug_cpu.toml")
INDEXED = str(CONFIGS / "debug_cpu_indexed.toml")


def _launch(*train_args):
    return py("-m", "titan_ledger.launch", "--nproc", "2", "--", *map(str, train_args), timeout=600)


def _train(*train_args):
    """``python -m titan_ledger.train`` as one process (WORLD_SIZE=1, no torchrun), forked
    from the warm launcher where it runs (``helpers.train_argv``: its own process, its own
    stderr and exit code, without a fresh interpreter's imports)."""
    env = child_env(WORLD_SIZE="1")
    for k in ("RANK", "LOCAL_RANK"):
        env.pop(k, None)
    return subprocess.run([*train_argv(), *map(str, train_args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


#: a one-process run with debug_cpu's global batch (4 rows x 2 DP ranks)
ONE_PROCESS = ["--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "8"]


def _one_line(p, prog, *needles) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, explain(p)
    assert len(lines) == 1 and lines[0].startswith(f"titan_ledger.{prog}: error: "), p.stderr
    assert "Traceback" not in p.stderr and "torch.distributed" not in p.stderr
    assert p.stdout == "", p.stdout[-2000:]
    for n in needles:
        assert str(n) in lines[0], lines[0]
    return lines[0]


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder`` (folders too): (size, mtime in ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """debug_cpu, 2 steps, 2 ranks, seed 1234: a folder holding a run and its data ledger."""
    dump = tmp_path_factory.mktemp("preflight") / "run"
    p = torchrun(["--job.config_file", DEBUG, "--job.dump_folder", str(dump), "--training.steps", "2"])
    assert p.returncode == 0, explain(p)
    assert (dump / "ledger" / "data_dp0.jsonl").is_file() and (dump / "structured_logs").is_dir()
    return dump


@slow
def test_a_missing_indexed_corpus_is_one_line_before_the_ranks(tmp_path):
    dump = tmp_path / "run"
    prefix = tmp_path / "nonexistent" / "x"
    p = _launch("--job.config_file", INDEXED, "--job.dump_folder", dump,
                "--dataloader.paths", prefix, "--dataloader.prepare_from", "")
    _one_line(p, "launch", f"{prefix}.bin: missing", "--dataloader.paths")
    assert not dump.exists()


@slow
def test_an_empty_corpus_is_one_line_before_the_ranks(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "data.jsonl").write_text("")  # datasets would raise a bare StopIteration on the ranks
    dump = tmp_path / "run"
    args = ["--job.config_file", DEBUG, "--job.dump_folder", dump, "--dataloader.dataset_path", corpus]
    _one_line(launch_here(*args), "launch", f"--dataloader.dataset_path {corpus}", "empty")
    _one_line(train_refused_here(*args, *ONE_PROCESS, WORLD_SIZE="1"), "train",
              f"--dataloader.dataset_path {corpus}", "empty")
    assert not dump.exists()


@slow
def test_a_missing_hf_data_file_is_one_line_before_the_ranks(tmp_path):
    dump = tmp_path / "run"
    missing = tmp_path / "shards" / "*.parquet"
    _one_line(launch_here("--job.config_file", DEBUG, "--job.dump_folder", dump, "--dataloader.source", "hf",
                          "--dataloader.data_files", missing),
              "launch", "--dataloader.data_files", str(missing), "no such file")
    assert not dump.exists()


@slow
def test_a_folder_holding_another_data_fingerprint_is_refused_and_left_untouched(trained):
    before = _files(trained)
    needles = [trained, "fingerprint", "--ledger.new_run", "--dump_folder"]
    other = ["--job.config_file", DEBUG, "--job.dump_folder", trained, "--dataloader.seed", "7"]
    _one_line(launch_here(*other), "launch", *needles)
    assert _files(trained) == before  # no structured_logs/, no lock, no new ledger line
    _one_line(_train(*other, *ONE_PROCESS), "train", *needles)
    assert _files(trained) == before


@slow
def test_the_same_data_resumes_and_new_run_is_accepted(trained):
    same = ["--job.config_file", DEBUG, "--job.dump_folder", trained]
    for extra in ([], ["--dataloader.seed", "7", "--ledger.new_run"]):  # (--print: no run)
        p = launch_here(*same, *extra, opts=["--print"])
        assert p.returncode == 0 and "titan_ledger.train" in p.stdout, explain(p)


@slow
def test_the_fingerprint_costs_nothing_in_a_fresh_folder_and_none_when_resuming(trained, tmp_path):
    """``claim_dump_folder`` calls a layout function only when it can decide."""
    import shutil

    from titan_ledger.components.run.run_folder import claim_dump_folder

    calls = []

    def fingerprint():
        calls.append(1)
        return "another"

    layout = {"seq_len": 256, "global_batch": 8, "fingerprint": fingerprint}
    assert claim_dump_folder(tmp_path / "fresh", "ledger", layout, read_only=True) == [] and not calls
    with pytest.raises(ConfigError, match="fingerprint"):
        claim_dump_folder(trained, "ledger", layout, read_only=True)
    assert calls == [1]
    assert claim_dump_folder(trained, "ledger", layout, read_only=True, new_run=True) == []
    assert (trained / "ledger").is_dir()  # read-only: never moved aside
    resumed = tmp_path / "resumed"
    shutil.copytree(trained / "ledger", resumed / "ledger")
    (resumed / "checkpoint" / "step-2").mkdir(parents=True)
    (resumed / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")
    assert claim_dump_folder(resumed, "ledger", layout, read_only=True) == [] and calls == [1]


# --------------------------------------------------------------------------- in this process
@pytest.fixture(scope="module")
def tok():
    from titan_ledger.data.prepare import load_tokenizer

    return load_tokenizer(TOKENIZER_DIR)


def _refused(err, cfg, *needles, **kw):
    with pytest.raises(err) as e:
        check_inputs(cfg, **kw)
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    for n in needles:
        assert str(n) in str(e.value), str(e.value)


def test_check_inputs_names_the_flag_and_the_path(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")  # blank: datasets cannot read it either
    Config = LedgerDataLoader.Config
    _refused(CorpusError, Config(source="hf", data_files=[str(empty)]), f"--dataloader.data_files {empty}",
             "empty file")
    _refused(CorpusError, Config(source="hf", hf_path=str(tmp_path / "nope")), "--dataloader.hf_path",
             tmp_path / "nope")
    _refused(ConfigError, Config(dataset="no_such_dataset"), "--dataloader.dataset 'no_such_dataset'")
    _refused(CorpusError, Config(dataset="c4_test"), "--dataloader.dataset c4_test", "tests/assets/c4_test")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "LICENSE").write_text("not data")
    _refused(CorpusError, Config(dataset_path=str(folder)), f"--dataloader.dataset_path {folder}",
             "no .arrow/.csv/.json/.jsonl/.parquet/.txt files")
    prefix = tmp_path / "corpora" / "web"
    _refused(CorpusError, Config(source="indexed", paths=[str(prefix)]), f"{prefix}.bin: missing",
             "--dataloader.paths")
    _refused(CorpusError, Config(source="indexed", paths=[str(prefix)], prepare_from=str(folder)),
             f"--dataloader.prepare_from {folder}")
    empty_prefix = tmp_path / "empty" / "web"
    empty_prefix.parent.mkdir()
    for suffix in (".bin", ".idx"):
        Path(f"{empty_prefix}{suffix}").write_bytes(b"")
    _refused(CorpusError, Config(source="indexed", paths=[str(empty_prefix)]), f"{empty_prefix}.idx",
             "truncated")
    # accepted: a first-use prepare from a corpus, a dry run without its corpus, the bundled data
    check_inputs(Config(source="indexed", paths=[str(prefix)], prepare_from=str(CORPUS_DIR)))
    check_inputs(Config(source="indexed", paths=[str(prefix)]), dry_run=True)
    check_inputs(Config(dataset_path=str(CORPUS_DIR)))
    check_inputs(Config(source="hf", data_files=[str(CORPUS_DIR)]))


@pytest.mark.parametrize("source", ["text", "hf"])
def test_data_fingerprint_is_the_loaders(tok, source, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    kw = ({"dataset_path": str(CORPUS_DIR)} if source == "text" else
          {"source": "hf", "data_files": [str(CORPUS_DIR / "data.jsonl")]})
    cfg = LedgerDataLoader.Config(seed=5, **kw)
    loader = LedgerDataLoader(cfg, dp_world_size=2, dp_rank=0, tokenizer=tok, seq_len=64,
                              local_batch_size=2)
    assert data_fingerprint(cfg, tok, 64, 2) == loader.fingerprint
    assert data_fingerprint(LedgerDataLoader.Config(seed=6, **kw), tok, 64, 2) != loader.fingerprint
