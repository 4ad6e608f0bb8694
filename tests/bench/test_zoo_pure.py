"""bench/zoo.py's pure parts, without training.

The synthetic copy corpus (the "sharp" model's data): each document must be one
phrase of COPY_PERIOD one-token words repeated, so that after the first period every
token is predictable only by looking back COPY_PERIOD positions (attention), the
property the sharp scenarios rely on. ``adam_peak``: the Adam recursion behind the
README's argument that the optimizer-state cause needs thousands of steps.
"""

import math

import pytest
from helpers import ROOT, load_bench


def test_copy_documents_repeat_one_phrase_of_one_token_words():
    zoo = load_bench("zoo")
    from titan_ledger.data.prepare import load_tokenizer

    tok = load_tokenizer(str(ROOT / "titan_ledger" / "assets" / "tokenizer"))
    docs = zoo.copy_documents(tok, seed=0)
    assert len(docs) == zoo.COPY_DOCS
    for d in docs[:50]:
        ids = tok.encode(d["text"], add_bos=False, add_eos=False)
        p = zoo.COPY_PERIOD
        assert len(ids) == 256 // p * p
        assert ids == ids[:p] * (256 // p), d["text"][:80]  # one token per word, one phrase repeated
    vocab = {w for d in docs for w in d["text"].split()}
    assert 100 < len(vocab) <= zoo.COPY_WORDS
    assert docs[0] != docs[1] and zoo.copy_documents(tok, seed=0)[:3] == docs[:3]  # seeded
    assert zoo.copy_documents(tok, seed=1)[:3] != docs[:3]


def test_adam_peak_matches_the_closed_forms():
    zoo = load_bench("zoo")
    for b2 in (0.95, 0.99, 0.999):
        # a steady gradient under bias-corrected Adam: every update is exactly 1
        assert zoo.adam_peak(b2, 100, 0) == pytest.approx(1.0)
        # no history and no bias correction: (1 - b1^k) / sqrt(1 - b2^k), maximised over k
        closed = max((1 - 0.9 ** k) / math.sqrt(1 - b2 ** k) for k in range(1, 5001))
        assert zoo.adam_peak(b2, 0, 0, after=5000, bias_correction=False) == pytest.approx(closed)
    assert zoo.adam_peak(0.999, 0, 0, after=5000, bias_correction=False) == pytest.approx(6.568520, abs=1e-6)  # the README's 6.57
    # a short run: bias correction keeps v_hat the plain mean of g^2 so far, so a
    # 100-step plateau after 100 normal steps amplifies the next updates by < 1.4x
    assert zoo.adam_peak(0.999, 100, 100) == pytest.approx(1.303384, abs=1e-6)
