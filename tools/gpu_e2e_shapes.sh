#!/usr/bin/env bash
# bench e2e on the shapes beyond Llama (issues 18 and 19), Unsloth in the same run. Carry
# .unsloth and .bnb (Unsloth imports bitsandbytes). One bench invocation per shape, each under
# its own timeout, within BUDGET seconds; logs under $OUT.
#   SHAPES="gemma3-1b qwen2.5-0.5b" VARIANTS=hf+peft,hf+peft+fusetune,unsloth bash tools/gpu_e2e_shapes.sh
set -uo pipefail
OUT=${OUT:-/tmp/fusetune-gpu-e2e-shapes}
mkdir -p "$OUT"
BUDGET=${BUDGET:-570}
# shellcheck source=tools/unsloth_env.sh
source tools/unsloth_env.sh
variants=${VARIANTS:-hf+peft,hf+peft+fusetune,hf+peft+fusetune+compile,unsloth}
for shape in ${SHAPES:-gemma3-1b qwen2.5-0.5b}; do
  left=$((BUDGET - SECONDS))
  ((left < 60)) && { echo "no time left for $shape" | tee -a "$OUT/e2e.log"; continue; }
  timeout "$left" python3 -m fusetune bench e2e --shapes "$shape" --variants "$variants" \
    --steps 20 --max-batch off --timeout 150 --out "$OUT/$shape" 2>&1 | tee -a "$OUT/e2e.log"
done
echo "done in $SECONDS s" | tee -a "$OUT/e2e.log"
