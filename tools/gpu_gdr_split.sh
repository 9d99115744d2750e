#!/usr/bin/env bash
# Issue 20 on one GPU (~9 minutes): Gated DeltaNet's tensor-core modes after the 32-wide tile
# floor (gdr_chunk.min_block): the shapes that faulted, then tools/gdr_modes_bench.py at
# B4 T4096 H16 D128 bf16 (ieee and split3 beside transformers' torch loop, the modes' gaps to
# IEEE, split3's time per kernel). Logs under $OUT.
set -u
OUT=${OUT:-/tmp/gdr_split_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
{
    for mode in split3 ieee; do
        for shape in small-fp32 small-bf16; do
            FUSETUNE_GDR_DOT=$mode timeout 60 python tools/gdr_fault_case.py $shape 2>&1 | tail -1
        done
    done
} 2>&1 | tee "$OUT/gdr_small_cases.txt"
timeout $((580 - SECONDS)) python tools/gdr_modes_bench.py --repeats 5 2>&1 \
    | tee "$OUT/gdr_modes_bench.txt"
echo "done in $SECONDS s"
