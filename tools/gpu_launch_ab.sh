#!/usr/bin/env bash
# fusetune's cached Triton launch (fusetune._triton.jit) against Triton's own launch
# (FUSETUNE_FAST_LAUNCH=0), alternating on one machine; 1 GPU, carry .bnb (~8 minutes):
#   1. tools/bench_launch.py (host us per launch), the launch test and test_quant4 on the GPU;
#   2. the QLoRA Llama-3.2-1B b4 step (tools/bench_qlora.py), old / new / old / new, then HF;
#   3. the 16-bit LoRA step (bench e2e llama-3.2-1b, fusetune only), old / new.
# Logs: $OUT/launch.log, $OUT/ab.log (RESULT lines and e2e tables).
set -u
OUT=${OUT:-/tmp/fusetune-launch-ab}
mkdir -p "$OUT"
bash tools/install_carried.sh .bnb >"$OUT/install.log" 2>&1
export PYTHONPATH=src:tests:/tmp/site PYTHONUNBUFFERED=1
timeout 90 python3 tools/bench_launch.py 2>&1 | tee "$OUT/launch.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_launch.py \
  tests/test_quant4.py 2>&1 | tail -4 | tee -a "$OUT/launch.log"
qlora() { # fast(0|1) variant
  echo "== FUSETUNE_FAST_LAUNCH=$1 $2" | tee -a "$OUT/ab.log"
  FUSETUNE_FAST_LAUNCH=$1 timeout 80 python3 tools/bench_qlora.py --shape llama-3.2-1b --batch 4 \
    --variant "$2" --steps 20 2>&1 | grep RESULT | tee -a "$OUT/ab.log"
}
qlora 0 fusetune; qlora 1 fusetune; qlora 0 fusetune; qlora 1 fusetune; qlora 1 hf
for fast in 0 1; do
  echo "== FUSETUNE_FAST_LAUNCH=$fast e2e" | tee -a "$OUT/ab.log"
  FUSETUNE_FAST_LAUNCH=$fast timeout 100 python3 -m fusetune bench e2e --shapes llama-3.2-1b \
    --variants hf+peft+fusetune --steps 20 --max-batch off 2>&1 | tail -6 | tee -a "$OUT/ab.log"
done
echo "done in $SECONDS s"
