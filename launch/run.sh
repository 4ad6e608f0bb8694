#!/usr/bin/env bash
# Single node: launch/run.sh [NPROC] --job.config_file train_configs/X.toml [--section.key value ...]
#
# NPROC defaults to the number of visible GPUs, or 2 on a machine without one
# (the CPU rehearsal backend). Extra arguments go to titan_ledger.train.
#
# The config is parsed once, here, for NPROC ranks (python -m titan_ledger.launch):
# a bad flag or TOML key prints ONE line, `titan_ledger.launch: error: ...`, and
# exits 2 before any rank starts; otherwise torchrun is exec'd.
#
# Console: titan_ledger.train itself picks the rank that logs (global rank 0, or the
# rank holding the loss under pipeline parallelism); the others print warnings and
# errors only. TITAN_LEDGER_LOG_RANKS=all (or =0,1) shows more ranks. torchrun's
# --local-ranks-filter is not used: it would hide the other ranks' errors too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python
if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; fi

if [[ "${1:-}" =~ ^[0-9]+$ ]]; then NPROC=$1; shift; else
  NPROC=$("$PY" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
# One intra-op thread per rank on CPU: ranks share the cores (set, torchrun
# also skips its OMP_NUM_THREADS banner).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

exec "$PY" -m titan_ledger.launch --nproc "$NPROC" --standalone --nnodes 1 -- "$@"
