#!/usr/bin/env bash
# GPU checks of `finetune --compile` (issue 18, item 2):
# 1. tests/test_compile_layers.py with Inductor (eager vs compiled LoRA training of a 4-layer
#    Llama and a 2-layer Gemma 3, fused ops counted in the compiled step; finetune --compile).
# 2. python -m fusetune finetune --compare on the tiny default model, eager, then --compile
#    (both runs compiled), then --compile reduce-overhead (CUDA graphs): losses, tokens/s and
#    the steps left out of them.
# Logs under $OUT (or ./gpu_out). Env: TEST_TIMEOUT (s, 240), FT_TIMEOUT (s, 90 per run).
# Usage: bash tools/gpu_finetune_compile.sh   (<= 9 minutes in all)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider --durations=10 \
  tests/test_compile_layers.py 2>&1 | tee "$OUT/test_compile_layers.log" | tail -n 20
[ "${PIPESTATUS[0]}" = 0 ] || status=1
run() {  # name, then finetune options
  local name=$1
  shift
  timeout "${FT_TIMEOUT:-90}" python3 -m fusetune finetune --steps 30 --batch-size 8 --compare \
    --output "$OUT/finetune-$name" "$@" 2>&1 | tee "$OUT/finetune-$name.log" | tail -n 24
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
run eager
run compile --compile
run compile-cudagraphs --compile reduce-overhead
exit $status
