#!/usr/bin/env bash
# GPU checks of the fine-tuning command and the end-to-end benchmark (issue 8, part B).
# 1. python -m fusetune bench e2e: one LoRA step of Llama-3.2-1B / Qwen2.5-0.5B shapes, HF + PEFT,
#    + fusetune, + Liger-Kernel (its wheel from .peers/: carry it), a subprocess per variant,
#    with a per-kernel profile; table in $OUT/e2e/e2e.txt, worker logs beside it.
# 2. python -m fusetune finetune --compare on the tiny default model (bf16, picked by auto).
# 3. the same with --precision fp16 (GradScaler path).
# Logs under $OUT (or ./gpu_out). Env: E2E_TIMEOUT (s, 260), FT_TIMEOUT (60), FP16_TIMEOUT (40),
# E2E_ARGS (extra bench e2e options, e.g. "--max-batch verify"), SKIP_E2E=1, SKIP_FT=1.
# Usage: bash tools/gpu_finetune.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .peers/liger_kernel-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/liger_kernel-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/peers
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/gpu_finetune_env.txt"

status=0
if [ "${SKIP_E2E:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  # 5 warm-up steps: in the first run fusetune's steps were still getting faster after 2.
  timeout "${E2E_TIMEOUT:-260}" python3 -m fusetune bench e2e --profile --warmup 5 --steps 5 \
    --variants hf+peft,hf+peft+fusetune,hf+peft+liger --timeout 150 --out "$OUT/e2e" \
    ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | grep -v '^\[e2e\] .* \.\.\.$'
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${SKIP_FT:-0}" != 1 ]; then
  timeout "${FT_TIMEOUT:-60}" python3 -m fusetune finetune --steps 30 --compare \
    --output "$OUT/finetune-bf16" 2>&1 | tee "$OUT/finetune-bf16.log" | tail -n 24
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  timeout "${FP16_TIMEOUT:-40}" python3 -m fusetune finetune --steps 20 --precision fp16 \
    --output "$OUT/finetune-fp16" 2>&1 | tee "$OUT/finetune-fp16.log" | tail -n 12
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit "$status"
