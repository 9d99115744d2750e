#!/usr/bin/env bash
# Issue 20, item 4 on the GPU (~4-5 minutes on an H100): GSA's fp16 chunk-mode precision against
# the float64 oracle, and the GSA tests the fix concerns, compiled. Logs under $OUT.
#   1. (side by side) the fp16 / varlen / long-sequence GSA tests (pytest -n 4, log only, shown
#      after step 2) and tools/gsa_precision.py issue: max abs errors per case, algorithm and
#      precision of fp16 chunk mode's computed products (tf32x3 = the fix, tf32 = before,
#      ieee), then the issue's table;
#   2. tools/gsa_precision.py times: fp16 and bf16 fwd+bwd ms at B4 T4096 H16 D=M=64 per mode.
#   bash tools/gpu_gsa_precision.sh
set -u
OUT=${OUT:-/tmp/gsa_precision_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1  # a study cut off at its cap still shows its rows
timeout 210 python -m pytest -q -p no:cacheprovider -rfE -n 4 tests/test_gsa.py \
    -k "fp16 or varlen or long_sequences" >"$OUT/gsa_tests.txt" 2>&1 &
tests=$!
timeout 300 python tools/gsa_precision.py issue tf32x3 tf32 ieee 2>&1 | tee "$OUT/gsa_precision.txt"
wait "$tests"
echo "== tests/test_gsa.py -k 'fp16 or varlen or long_sequences' (exit $?; full log $OUT/gsa_tests.txt)"
tail -n 40 "$OUT/gsa_tests.txt"
timeout 80 python tools/gsa_precision.py times tf32x3 tf32 ieee 2>&1 | tee "$OUT/gsa_times.txt"
