#!/usr/bin/env bash
# Issue 20 on one H100 (~9 minutes): the Gated DeltaNet default (IEEE) tests compiled, then the
# tensor-core fault of FUSETUNE_GDR_DOT=split3 / bf16x6 narrowed down, one case a process
# (tools/gdr_fault_case.py): as is with CUDA_LAUNCH_BLOCKING=1, without wgmma
# (DISABLE_MMA_V3=1: Ampere's mma.sync), under compute-sanitizer. The chunk kernels' TTGIR are
# copied out of Triton's cache for reading. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/gdr_fault_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
echo "== 1. default (IEEE) Gated DeltaNet tests, compiled"
timeout 230 python -m pytest -q -p no:cacheprovider -rfE -n 6 --durations=5 \
    tests/test_gated_delta_rule.py -k "not split" 2>&1 | tee "$OUT/gdr_default_tests.txt" | tail -15
one() {  # timeout shape [VAR=value ...]: one case in its own process
    local limit=$1 shape=$2; shift 2
    echo "-- $shape $*"
    env "$@" timeout "$limit" python tools/gdr_fault_case.py "$shape" 2>&1 | tail -2
}
echo "== 2. fault cases"
{
    export TRITON_CACHE_DIR=/tmp/triton-gdr CUDA_LAUNCH_BLOCKING=1
    for mode in split3 bf16x6; do
        for shape in small-fp32 small-bf16 k32-fp32 long-bf16; do
            one 60 $shape FUSETUNE_GDR_DOT=$mode
        done
    done
    one 60 small-fp32 FUSETUNE_GDR_DOT=split3 DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton-v2
    one 60 long-bf16 FUSETUNE_GDR_DOT=split3 DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton-v2
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    echo "-- compute-sanitizer: ${sanitizer:-none}"
    if [ -n "$sanitizer" ]; then
        FUSETUNE_GDR_DOT=split3 timeout 150 "$sanitizer" --tool memcheck --print-limit 4 \
            python tools/gdr_fault_case.py small-fp32 2>&1 | head -60
    fi
} 2>&1 | tee "$OUT/gdr_fault_cases.txt"
mkdir -p "$OUT/ttgir"
find /tmp/triton-gdr -name "*_kernel.ttgir" -exec cp {} "$OUT/ttgir/" \; 2>/dev/null
ls "$OUT/ttgir"
echo "done in $SECONDS s"
