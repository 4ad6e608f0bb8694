"""``python -m titan_ledger.prepare``: the command line of :mod:`titan_ledger.data.prepare`.

Design decision: tokenizing a corpus is data-layer work (the training dataloader
prepares the bundled corpus on first use); this module is only its argument parsing
and its one-line errors, so the data layer never imports a tool.
"""

from __future__ import annotations

import os
import sys

from titan_ledger.data import prepare as lib
from titan_ledger.data.prepare import prepare, prepare_sharded, shard_prefix
from titan_ledger.errors import TitanLedgerError, fail_line
from titan_ledger.rehearsal import backend
from titan_ledger.tools.cli import ToolParser

PROG = "titan_ledger.prepare"


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser.for_tool(__name__, lib.__doc__)
    ap.add_argument("--input", nargs="+", required=True,
                    help="JSONL/Parquet files, folders of them, or a datasets save_to_disk folder")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer folder (the run's hf_assets_path); default: the bundled tokenizer")
    ap.add_argument("--text-key", default="text", help="JSON key / column holding the text")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)),
                    help="tokenizer processes (0: in this process)")
    ap.add_argument("--no-bos", action="store_true", help="do not prepend BOS to each document")
    ap.add_argument("--no-eos", action="store_true", help="do not append EOS to each document")
    ap.add_argument("--num-shards", type=int, default=None,
                    help="split the input files into this many shards (PREFIX.shard-I-of-S), "
                         "prepared one after the other (finished ones kept), then merged")
    ap.add_argument("--shard", type=int, default=None,
                    help="with --num-shards: prepare only this shard (a Slurm array task)")
    ap.add_argument("--merge", action="store_true",
                    help="with --num-shards: only merge the prepared shards into PREFIX")
    a = ap.parse_args(argv)  # argparse itself exits 2 on a malformed command line
    if (a.shard is not None or a.merge) and a.num_shards is None:
        ap.error("--shard and --merge need --num-shards")
    if a.shard is not None and a.merge:
        ap.error("give --shard (prepare one shard) or --merge (merge them all), not both")
    kw = dict(tokenizer_dir=a.tokenizer, workers=a.workers, text_key=a.text_key,
              bos=not a.no_bos, eos=not a.no_eos)
    backend.ensure_installed()  # before torchtitan's tokenizer import binds a device
    try:
        if a.num_shards is not None:
            meta = prepare_sharded(a.input, a.output_prefix, a.num_shards, shard=a.shard,
                                   only_merge=a.merge, **kw)
            if a.shard is not None:
                a.output_prefix = shard_prefix(a.output_prefix, a.shard, a.num_shards)
        else:
            meta = prepare(a.input, a.output_prefix, **kw)
    except TitanLedgerError as e:
        print(fail_line(PROG, e), file=sys.stderr)
        return e.exit_code
    print(f"wrote {a.output_prefix}.bin/.idx: {meta['documents']} documents, {meta['tokens']} "
          f"tokens, {meta['dtype']}, {meta['seconds']} s ({meta['tokens_per_s']} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
