"""bench/zoo.py's synthetic copy corpus (the "sharp" model's data), without training.

Each document must be one phrase of COPY_PERIOD one-token words repeated, so that
after the first period every token is predictable only by looking back COPY_PERIOD
positions (attention): the property the sharp scenarios rely on.
"""

from helpers import ROOT, load_bench


def test_copy_documents_repeat_one_phrase_of_one_token_words():
    zoo = load_bench("zoo")
    from titan_ledger.prepare import load_tokenizer

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
