#!/usr/bin/env bash
# Issue 20 on the GPU (about 2-4 minutes on an H100): Gated DeltaNet's split3 products
# (FUSETUNE_GDR_DOT=split3: tensor cores, fp32 operands split into tf32 halves by hand, 16-bit
# inputs as they are) against IEEE. Logs under $OUT.
#   1. the split3 tests (small shapes that faulted under Triton's own tf32x3, B2 T1024 H4 D128,
#      the split helper): pytest -n 4 -x; if that fails with a CUDA fault, once more one test at
#      a time with CUDA_LAUNCH_BLOCKING=1 so the log names the faulting kernel launch;
#   2. tools/gdr_modes_bench.py: fwd+bwd ms, forward ms and peak MiB at B4 T4096 H16 D128 bf16,
#      ieee vs split3 (with the models' l2norm and without) vs transformers' torch loop, and
#      split3's relative gap to ieee on o and every gradient.
#   bash tools/gpu_gdr_modes.sh
set -u
OUT=${OUT:-/tmp/gdr_modes_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests
SPLIT3_TESTS="split3 or tf32_split or dot_mode"
echo "== 1. split3 tests (pytest -n 4 -x)"
timeout 100 python -m pytest -q -p no:cacheprovider -rfE -x -n 4 tests/test_gated_delta_rule.py \
    -k "$SPLIT3_TESTS" 2>&1 | tee "$OUT/gdr_split3_tests.txt"
status=${PIPESTATUS[0]}
echo "== split3 tests exit $status"
if [ "$status" -ne 0 ] && grep -qiE "illegal memory|CUDA error|misaligned|unspecified launch" \
    "$OUT/gdr_split3_tests.txt"; then
    echo "== 1b. CUDA fault: again with CUDA_LAUNCH_BLOCKING=1, one process, -x"
    CUDA_LAUNCH_BLOCKING=1 timeout 40 python -m pytest -q -p no:cacheprovider -rfE -x \
        tests/test_gated_delta_rule.py -k "$SPLIT3_TESTS" 2>&1 | tee "$OUT/gdr_split3_blocking.txt"
fi
echo "== 2. B4 T4096 H16 D128 bf16: ieee vs split3 vs transformers' torch loop"
timeout 100 python tools/gdr_modes_bench.py 2>&1 | tee "$OUT/gdr_modes_bench.txt"
echo "== bench exit ${PIPESTATUS[0]}"
