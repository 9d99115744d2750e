#!/usr/bin/env bash
# Unsloth beside fusetune in the same run (issues 18 item 4 and 22), on the GPU machine.
# Carry .unsloth (unsloth 2026.10.9, unsloth_zoo and what they import that the GPU image may
# lack: ~19 MB) and .bnb (bitsandbytes 0.50.2, 43 MB); tools/carried_wheels.py installs only the
# wheels whose distribution is not installed already (unsloth's own, trl 1.15 and datasets 4.3
# always). Steps, most important first, each under `timeout` and all within ~9 minutes:
#   a) import unsloth, versions;  b) bench e2e Llama-3.2-1B b4: hf+peft, fusetune, unsloth;
#   c) QLoRA 1B b4: hf, fusetune, unsloth, fusetune compiled;  d) QLoRA 8B b2 with gradient
#   checkpointing: fusetune, unsloth, fusetune with offloaded checkpointing (as Unsloth's mode).
#   The first unsloth step of a shape saves its random weights under /tmp (cached).
# Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/fusetune-gpu-unsloth}
mkdir -p "$OUT"
BUDGET=${BUDGET:-530} # seconds for everything
cap() { # a step's timeout: its own limit, or what is left of the budget
  local left=$((BUDGET - SECONDS))
  ((left < 10)) && left=10
  echo $(($1 < left ? $1 : left))
}
# shellcheck source=tools/unsloth_env.sh
source tools/unsloth_env.sh

echo "== a) import unsloth" | tee "$OUT/a-import.log"
timeout "$(cap 90)" python3 -c "
import time; t = time.time()
import unsloth
from unsloth import FastLanguageModel
print('import unsloth: %.1f s' % (time.time() - t))
import importlib, torch
for name in ('unsloth', 'unsloth_zoo', 'torch', 'triton', 'transformers', 'peft', 'trl',
             'datasets', 'accelerate', 'bitsandbytes', 'xformers', 'cut_cross_entropy'):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, '__version__', '?'), m.__file__)
    except ImportError as e:
        print(name, 'not importable:', e)
print(torch.cuda.get_device_name())
" 2>&1 | tee -a "$OUT/a-import.log"

echo "== b) bench e2e" | tee "$OUT/b-e2e.log"
timeout "$(cap ${E2E_LIMIT:-240})" python3 -m fusetune bench e2e --shapes llama-3.2-1b \
  --variants "${E2E_VARIANTS:-hf+peft,hf+peft+fusetune,unsloth}" --steps 20 --max-batch off --timeout 150 \
  --out "$OUT/e2e" 2>&1 | tee -a "$OUT/b-e2e.log"

qlora() { # shape batch variant limit [flags]
  local shape=$1 batch=$2 variant=$3 limit=$4
  shift 4
  echo "== $shape b$batch $variant $*" >>"$OUT/qlora.log"
  timeout "$(cap "$limit")" python3 tools/bench_qlora.py --shape "$shape" --batch "$batch" \
    --variant "$variant" "$@" 2>&1 | tee -a "$OUT/qlora.log" | grep -E "RESULT|LARGEST|Error|error" | tail -2
}
echo "== c) QLoRA 1B b4" | tee -a "$OUT/qlora.log"
for variant in hf fusetune unsloth; do
  qlora llama-3.2-1b 4 "$variant" 70
done
qlora llama-3.2-1b 4 fusetune 120 --compile # Unsloth compiles its decoder layers too
echo "== d) QLoRA 8B b2, gradient checkpointing" | tee -a "$OUT/qlora.log"
qlora llama-8b 2 fusetune 150 --gradient-checkpointing
qlora llama-8b 2 unsloth 180 --gradient-checkpointing
# Unsloth's mode offloads the checkpointed inputs to the host: fusetune's offloaded mode beside it
qlora llama-8b 2 fusetune 150 --gradient-checkpointing offload
echo "done in $SECONDS s" | tee -a "$OUT/qlora.log"
