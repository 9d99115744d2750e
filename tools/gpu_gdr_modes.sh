#!/usr/bin/env bash
# Issue 20 on the GPU (4 minutes at most on an H100: timeouts 120 + 30 + 90 s): Gated
# DeltaNet's split products against IEEE. FUSETUNE_GDR_DOT=split3: tensor cores, fp32 operands
# split into tf32 halves by hand, 16-bit inputs as they are; bf16x6: the same with three bf16
# pieces, in case tf32 products fault too. Logs under $OUT.
#   1. the split tests, both modes (small shapes that faulted under Triton's own tf32x3,
#      B2 T1024 H4 D128, the split helpers): pytest -n 4 -x; if that fails with a CUDA fault,
#      once more in one process with CUDA_LAUNCH_BLOCKING=1 so the log names the faulting launch;
#   2. tools/gdr_modes_bench.py: fwd+bwd ms, forward ms and peak MiB at B4 T4096 H16 D128 bf16,
#      ieee vs split3 (with the models' l2norm and without) vs bf16x6 vs transformers' torch
#      loop, each split mode's relative gap to ieee on o and every gradient, and split3's GPU
#      time per kernel.
#   bash tools/gpu_gdr_modes.sh
set -u
OUT=${OUT:-/tmp/gdr_modes_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests
SPLIT_TESTS="split or dot_mode"
echo "== 1. split3 / bf16x6 tests (pytest -n 4 -x)"
timeout 120 python -m pytest -q -p no:cacheprovider -rfE -x -n 4 --durations=8 \
    tests/test_gated_delta_rule.py -k "$SPLIT_TESTS" 2>&1 | tee "$OUT/gdr_split_tests.txt"
status=${PIPESTATUS[0]}
echo "== split tests exit $status"
if [ "$status" -ne 0 ] && grep -qiE "illegal memory|CUDA error|misaligned|unspecified launch" \
    "$OUT/gdr_split_tests.txt"; then
    echo "== 1b. CUDA fault: again with CUDA_LAUNCH_BLOCKING=1, one process, -x"
    CUDA_LAUNCH_BLOCKING=1 timeout 30 python -m pytest -q -p no:cacheprovider -rfE -x \
        tests/test_gated_delta_rule.py -k "$SPLIT_TESTS" 2>&1 | tee "$OUT/gdr_split_blocking.txt"
fi
echo "== 2. B4 T4096 H16 D128 bf16: ieee vs split3 vs bf16x6 vs transformers' torch loop"
timeout 90 python tools/gdr_modes_bench.py 2>&1 | tee "$OUT/gdr_modes_bench.txt"
echo "== bench exit ${PIPESTATUS[0]}"
