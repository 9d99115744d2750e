#!/usr/bin/env bash
# Issue 20 on one H100 (~9 minutes): Gated DeltaNet's tensor-core modes (FUSETUNE_GDR_DOT=split3 /
# bf16x6) narrowed down, one case a process (a CUDA fault poisons the context):
#   1. tools/gdr_kernel_diff.py: every chunk kernel's arguments after its launch against the
#      IEEE run's, at the shapes that faulted (K = 12, V = 20) and one that did not (K = 32);
#   2. tools/gdr_fault_case.py at B2 T1024 K = V = 128 bf16 (the models' size), as is and
#      without wgmma (DISABLE_MMA_V3=1: Ampere's mma.sync);
#   3. compute-sanitizer memcheck on the faulting shape.
# Then, with the time left, the default (IEEE) tests compiled. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/gdr_fault_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-gdr
{
    echo "== 1. per-kernel gaps to IEEE"
    for case in "small-fp32 split3" "k32-fp32 split3" "small-bf16 split3"; do
        CUDA_LAUNCH_BLOCKING=1 timeout 100 python tools/gdr_kernel_diff.py $case 2>&1 | tail -16
    done
    echo "== 2. B2 T1024 H4 K=V=128 bf16"
    FUSETUNE_GDR_DOT=split3 timeout 120 python tools/gdr_fault_case.py long-bf16 2>&1 | tail -2
    DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton-v2 FUSETUNE_GDR_DOT=split3 timeout 120 \
        python tools/gdr_fault_case.py long-bf16 2>&1 | tail -2
    echo "== 3. compute-sanitizer, small-fp32 split3"
    FUSETUNE_GDR_DOT=split3 timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        --print-limit 4 python tools/gdr_fault_case.py small-fp32 2>&1 | head -50
} 2>&1 | tee "$OUT/gdr_fault_cases.txt"
left=$((560 - SECONDS))
echo "== 4. default (IEEE) tests, compiled ($left s left)"
((left > 60)) && timeout "$left" python -m pytest -q -p no:cacheprovider -rfE -n 6 \
    tests/test_gated_delta_rule.py -k "not split" 2>&1 | tee "$OUT/gdr_default_tests.txt" | tail -5
echo "done in $SECONDS s"
