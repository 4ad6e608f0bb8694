#!/usr/bin/env bash
# GPU validation pack (issue 17): one command, one JSON object on stdout, exit 1 on a failed check.
#
#   bench/device/run.sh            # CUDA: one H200, <= 8 minutes including this setup
#   bench/device/run.sh --cpu      # the same code on CPU (tiny model); also TITAN_LEDGER_DEVICE=cpu
#
# Progress and where the time goes: stderr, and "time_log" in the JSON. Worker logs and
# pack.json: $OUT/gpu_pack when $OUT is set (the device machine's return folder), else
# outputs/gpu_pack. A venv is created only when .venv cannot import titan_ledger.
set -uo pipefail
cd "$(dirname "$0")/../.."
# Setup (the venv check, or its creation on a fresh machine: 107 s measured) is timed apart
# from the checks: the pack's budget (--budget, default 450 s CUDA / 85 s CPU) starts when
# setup ends, so a slow install cannot eat the checks' time; both are in the JSON
# (setup_s, elapsed_s) and in the one summary line on stderr.
SETUP_T0=$(date +%s.%N)
log() { echo "[gpu-pack $(date +%T)] $*" >&2; }

args=()
for a in "$@"; do
  if [ "$a" = "--cpu" ]; then export TITAN_LEDGER_DEVICE=cpu; else args+=("$a"); fi
done

PY=.venv/bin/python
if ! "$PY" -c "import titan_ledger, torchtitan, torch" >/dev/null 2>&1; then
  t=$(date +%s)
  log "no usable .venv: creating one (system site-packages visible, so a preinstalled torch is reused)"
  python3 -m venv --clear --system-site-packages .venv || { echo '{"ok": false, "error": "python3 -m venv failed"}'; exit 1; }
  if ! .venv/bin/pip install -q -e '.[dev]' >&2; then
    log "pip install -e '.[dev]' failed (offline?): installing titan_ledger alone over the system packages"
    .venv/bin/pip install -q --no-deps --no-build-isolation -e . >&2 \
      || { echo '{"ok": false, "error": "could not install titan_ledger into .venv"}'; exit 1; }
  fi
  "$PY" -c "import titan_ledger, torchtitan, torch" >&2 \
    || { echo '{"ok": false, "error": ".venv cannot import torch/torchtitan/titan_ledger"}'; exit 1; }
  log "venv ready in $(( $(date +%s) - t )) s"
fi
log "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tail -1)"
export PACK_SETUP_S="$(python3 -c "import sys; print(round($(date +%s.%N) - $SETUP_T0, 1))")"
export PACK_T0="$(date +%s.%N)"   # the checks' wall-clock guard counts from here
log "setup: $PACK_SETUP_S s"
exec "$PY" bench/device/pack.py ${args[@]+"${args[@]}"}
