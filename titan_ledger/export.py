"""``python -m titan_ledger.export``: the entry point of :mod:`titan_ledger.tools.export`.

Design decision: the tools live in ``titan_ledger/tools/`` (the layer above the trainer);
these three-line modules keep every documented command line working."""

import sys

from titan_ledger.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
