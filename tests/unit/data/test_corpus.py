"""The bundled corpus and tokenizer load the way torchtitan loads them."""

import subprocess
import sys

import pytest
from helpers import ROOT

from titan_ledger.config_registry import CORPUS_DIR, TOKENIZER_DIR


def test_tokenizer_fits_the_debug_model_vocabulary():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer.Config().build(tokenizer_path=str(TOKENIZER_DIR))
    assert tok.get_vocab_size() == 2048
    ids = tok.encode("Return the absolute value of the argument.", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert max(ids) < 2048
    assert tok.decode(ids[1:-1]) == "Return the absolute value of the argument."


def test_corpus_loads_with_torchtitan_loader():
    from datasets import load_dataset

    ds = load_dataset(str(CORPUS_DIR), split="train")
    assert len(ds) == 457 and set(ds.column_names) == {"id", "source", "text"}
    assert sum(len(t) for t in ds["text"]) > 1_000_000


@pytest.mark.slow
def test_regenerates_byte_for_byte():
    proc = subprocess.run([sys.executable, "scripts/make_corpus.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
