#!/usr/bin/env bash
# One-GPU readiness check of megatron_csbp (see scripts/gpu_check.py): flex kernels against the dense
# fp64 reference in fp32 and bf16, kernel TFLOP/s on the BDLM mask against dense causal attention, the gated
# delta rule against its fp64 recurrence, and
# training steps of a ~1B BDLM GPT model. Prints the numbers and writes ${OUT:-.}/gpu_check.json.
#
#   scripts/gpu_check.sh [gpu_check.py flags]     e.g.  OUT=runs/gpu scripts/gpu_check.sh
#
# GPU_CHECK_TIMEOUT_S (default 540) bounds the whole run; PYTHON picks the interpreter (default: python3 on PATH;
# give the one that has torch and megatron_csbp installed, e.g. PYTHON=.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-.}"
mkdir -p "$OUT"
exec timeout --kill-after=20 "${GPU_CHECK_TIMEOUT_S:-540}" \
    "${PYTHON:-python3}" scripts/gpu_check.py --json "$OUT/gpu_check.json" "$@"
