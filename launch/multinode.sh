#!/usr/bin/env bash
# One node of a multi-node job, rendezvous over torchrun's c10d store.
#
#   NNODES=2 NPROC_PER_NODE=8 MASTER_ADDR=node0 MASTER_PORT=29500 JOB_ID=run42 \
#     launch/multinode.sh --job.config_file train_configs/llama3_70b.toml
#
# Run it once per node (launch/slurm.sbatch does this with srun). Every node
# uses the same MASTER_ADDR:MASTER_PORT (a host that runs one of the nodes) and
# JOB_ID; ranks are assigned by the rendezvous, so no NODE_RANK is needed.
#
# Console: one rank of the whole job logs (titan_ledger.train filters by global
# rank: 0, or the rank holding the loss under pipeline parallelism), so the step
# line appears once, not once per node; every rank still prints warnings and
# errors. TITAN_LEDGER_LOG_RANKS=all (or =0,8) shows more ranks.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${NNODES:?set NNODES}"
: "${MASTER_ADDR:?set MASTER_ADDR (host of the rendezvous)}"
MASTER_PORT=${MASTER_PORT:-29500}
JOB_ID=${JOB_ID:-titan_ledger}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count() or 1)')}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # set: no torchrun banner about it

# The config is parsed once on this node for the whole job's world size
# (NNODES x NPROC_PER_NODE, python -m titan_ledger.launch): a bad flag prints ONE
# line and exits 2 before the rendezvous; otherwise torchrun is exec'd.
exec python -m titan_ledger.launch --nproc "$NPROC_PER_NODE" --nnodes "$NNODES" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$JOB_ID" \
  -- "$@"
