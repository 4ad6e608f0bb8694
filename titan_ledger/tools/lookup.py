"""``python -m titan_ledger.lookup``: what did each DP rank train on at step T?

Design decision: read only the data ledger (``data_dp<r>.jsonl``) and, for text or
derived rows, the data source named in its header; never start a trainer or a
process group. ``--json`` prints the machine form::

    {"step": T, "skipped": bool,
     "ranks": {"0": [{"sample_id": .., "source": .., "segments": [{"doc": .., "start": .., "end": ..}]}]}}

(with ``--text`` every segment also has ``"text"``). Offsets are into the
document's tokens as stored (BOS first), over its input tokens.

Examples::

    python -m titan_ledger.lookup outputs/debug_cpu --step 5
    python -m titan_ledger.lookup outputs/debug_cpu --step 5 --rank 1 --text
    python -m titan_ledger.lookup outputs/debug_cpu --step 5 --json
    python -m titan_ledger.lookup outputs/indexed --sample 123456 --text
"""

from __future__ import annotations

import json
import sys

from titan_ledger.data.layout import RowTag
from titan_ledger.errors import LedgerError
from titan_ledger.format import records
from titan_ledger.format.data_reader import DataLedger
from titan_ledger.format.reader import RunLedger
from titan_ledger.tools.cli import ToolParser, add_dump_folder, parse_args, run_tool
from titan_ledger.tools.postmortem import actions_at


class TextSource:
    """Decode segments back to text with the run's tokenizer and data source."""

    def __init__(self, ledger: DataLedger):
        self.ledger = ledger
        self.hdr = ledger.header()
        self._tok = None
        self._dec = None
        self._ds = None

    def tokenizer(self):
        if self._tok is None:
            from titan_ledger.data.prepare import load_tokenizer

            self._tok = load_tokenizer(self.hdr["tokenizer"])
        return self._tok

    def doc_tokens(self, source: str, doc: int):
        if self.hdr["source_kind"] == "indexed":
            blend = self.ledger.blend(self.hdr)
            corpus = next(c for c in blend.corpora if c.name == source)
            return corpus.doc_tokens(doc).tolist()
        if self.hdr["source_kind"] == "hf":
            from titan_ledger.data.hf import document_text

            text = document_text(self.hdr["spec"], int(doc))
            return self.tokenizer().encode(text, add_bos=True, add_eos=True)
        if self._ds is None:
            from titan_ledger.rehearsal import backend

            backend.ensure_installed()
            from titan_ledger.data.text import locate_dataset

            spec = self.hdr["spec"]
            path, loader, processor = locate_dataset(spec["dataset"], spec["dataset_path"])
            self._ds, self._proc = loader(path), processor
        text = self._proc(self._ds[int(doc)])
        return self.tokenizer().encode(text, add_bos=True, add_eos=True)

    def decoder(self):
        """Decoding needs no torch (``prepare.load_decoder``): an indexed corpus's documents
        are shown without importing it; text and hf sources encode with the run's own."""
        if self._dec is None:
            from titan_ledger.data.prepare import load_decoder

            self._dec = load_decoder(self.hdr["tokenizer"])
        return self._dec

    def text(self, source: str, doc: int, start: int, end: int) -> str:
        return self.decoder().decode(list(self.doc_tokens(source, doc)[start:end]))


def describe(tags: list[RowTag], text: TextSource | None) -> list[dict]:
    out = []
    for t in tags:
        d = t.as_dict()
        if text is not None:
            for seg in d["segments"]:
                seg["text"] = text.text(t.source, seg["doc"], seg["start"], seg["end"])
        out.append(d)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser.for_tool(__name__, __doc__)
    add_dump_folder(ap)
    ap.add_argument("--step", type=int, help="training step (1-indexed)")
    ap.add_argument("--sample", type=int, help="a sample id instead of a step (indexed corpora)")
    ap.add_argument("--rank", type=int, help="only this DP rank")
    ap.add_argument("--text", action="store_true", help="decode each segment's text")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--top", type=int, metavar="K",
                    help="with --step: the K highest-loss documents of the step across DP ranks "
                         "(and the K lowest: repeated text gives a very low loss), from the "
                         "per-document losses the run recorded")
    a = parse_args(ap, argv)
    if a.top is not None and (a.step is None or a.top < 1):
        ap.error("--top K needs --step T and K >= 1")
    if (a.step is None) == (a.sample is None):
        ap.error("give exactly one of --step or --sample")
    return run_tool("titan_ledger.lookup", lambda: _main(a))


def _main(a) -> int:
    ledger = RunLedger(a.dump_folder, a.ledger_folder).data
    text = TextSource(ledger) if a.text else None
    if a.sample is not None:
        if a.sample < 0:
            raise LedgerError(f"--sample {a.sample}: sample ids start at 0")
        tag = ledger.sample(a.sample)  # checked against the samples the run consumed
        out = describe([tag], text)[0]
        print(json.dumps(out, indent=None if a.json else 1))
        return 0
    if a.step < 1:
        raise LedgerError(f"--step {a.step}: steps start at 1 (the ledger covers steps 1-{ledger.last_step})")
    ranks = [a.rank] if a.rank is not None else ledger.ranks_at(a.step)
    got = {r: ledger.at(a.step, r) for r in ranks}
    missing = [r for r, g in got.items() if g is None]
    lost = ledger.missing_ranks(a.step) if a.rank is None and got else []
    if lost:  # never show a partial step as if it were the whole step
        names = ", ".join(str(ledger.folder / records.data_file(r)) for r in lost)
        raise LedgerError(f"{names}: no row for step {a.step}, but the run had {len(lost) + len(got)} "
                          f"DP ranks (the file is missing, empty or cut); restore it, or pass --rank "
                          f"{min(got)} to see the ranks that have it")
    if not got or missing:
        raise LedgerError(f"{ledger.folder}: no data for step {a.step}"
                          + (f" on DP rank(s) {missing}" if missing else "")
                          + f" (the ledger covers steps 1-{ledger.last_step})")
    if a.top is not None:
        return _top(a, ledger, text)
    skipped = any(g.skipped for g in got.values())
    result = {"step": a.step, "skipped": skipped,
              "ranks": {str(r): describe(g.tags, text) for r, g in got.items()}}
    # what the trainer did about the step (a rollback that undid it, a skipped update)
    # and whose batch an injection replaced, as the step trained
    run = RunLedger(a.dump_folder, a.ledger_folder)
    facts = actions_at(run, a.step)
    acted = facts["flagged"] or facts["rewind"] or facts["update_skipped"]
    if acted:
        result["actions"] = facts
    injected = {r: k for r, k in ledger.injected_at(a.step).items() if r in got}
    if injected:
        result["injected"] = {str(r): k for r, k in injected.items()}
    # the per-document losses the run recorded (each rank's highest and lowest segments)
    docs, median = ledger.doc_losses(a.step)
    if median is not None:
        result["median_segment_loss"] = median
    for d in docs:
        if str(d["dp_rank"]) in result["ranks"]:
            row = result["ranks"][str(d["dp_rank"])][d["row"]]
            row["segments"][d["segment"]].update(loss=d["loss"], tokens=d["tokens"])
    if a.json:
        print(json.dumps(result))
        return 0
    window = next((g.window for g in got.values() if g.window), None)
    state = "SKIPPED" + (f" (window {window[0]}-{window[1]})" if window else "") if skipped else "trained"
    print(f"step {a.step}: {state}")
    if acted:
        print(f"  {facts['summary']}")
    for r, rows in result["ranks"].items():
        kind = injected.get(int(r))
        print(f"DP rank {r}" + (f"  (batch replaced by an injection ({kind}, --ledger.rehearsal.inject): "
                                f"these documents never trained)" if kind else ""))
        for row in rows:
            spans = "  ".join(f"doc {s['doc']} [{s['start']}:{s['end']})"
                              + (f" loss {s['loss']:.3f}" if s.get("loss") is not None else "")
                              for s in row["segments"])
            print(f"  sample {row['sample_id']:>8}  {row['source']}  {spans}")
            if a.text:
                for s in row["segments"]:
                    print(f"    doc {s['doc']}: {s['text']!r}")
    return 0


def _top(a, ledger, text) -> int:
    """``--top K``: the step's most extreme documents by mean loss, across DP ranks."""
    docs, median = ledger.doc_losses(a.step)
    if not docs:
        raise LedgerError(f"{ledger.folder}: no per-document losses at step {a.step} (the run had "
                          f"--ledger.doc_loss.no_enable, or the step was skipped)")
    if a.rank is not None:
        docs = [d for d in docs if d["dp_rank"] == a.rank]
    ranked = sorted((d for d in docs if d["loss"] is not None), key=lambda d: -d["loss"])
    high, low = ranked[:a.top], sorted(ranked, key=lambda d: d["loss"])[:a.top]
    for d in high + low:
        d["vs_median"] = d["loss"] / median if median else None
        if text is not None or not a.json:
            try:
                src = text or TextSource(ledger)
                d["text"] = src.text(d["source"], d["doc"], d["start"], d["end"])
            except Exception as e:
                d["text"] = None
                d["text_error"] = f"{type(e).__name__}: {e}"
    if a.json:
        print(json.dumps({"step": a.step, "median_segment_loss": median, "highest": high, "lowest": low}))
        return 0
    print(f"step {a.step}: median segment loss {median:.4f} (median of the DP ranks' medians)")
    for title, rows in (("highest loss", high), ("lowest loss", low)):
        print(title)
        for d in rows:
            ratio = f"{d['vs_median']:.2f}x median" if d["vs_median"] else ""
            print(f"  DP rank {d['dp_rank']}  {d['source']} doc {d['doc']} [{d['start']}:{d['end']})  "
                  f"loss {d['loss']:.4f} over {d['tokens']} tokens  {ratio}")
            if d.get("text"):
                excerpt = d["text"].replace("\n", " ")
                print(f"    {excerpt[:160]!r}{'...' if len(excerpt) > 160 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
