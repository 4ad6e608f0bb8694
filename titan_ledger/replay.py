"""``python -m titan_ledger.replay``: the entry point of :mod:`titan_ledger.tools.replay`.

Design decision: the tools live in ``titan_ledger/tools/`` (the layer above the trainer);
these three-line modules keep every documented command line working."""

import sys

from titan_ledger.tools.replay import main

if __name__ == "__main__":
    sys.exit(main())
