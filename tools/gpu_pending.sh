#!/usr/bin/env bash
# What the stop of 2026-11-26 (fifth) left GPU-untested, in one call on 2 GPUs (carry .bnb .ds
# .trl .peers, ~4 minutes), logs under $OUT (few files: the device returns ~8 per call):
#   the ZeRO-3 LoRA groups (test_distributed's and grpo's ZeRO-3 cases under NCCL), and the
#   q/k/v input check (test_lora_peft.py).
# `bash tools/gpu_pending.sh measure` (1 GPU, carry .peers, ~4 minutes): Qwen3.5-small's e2e row
#   with Liger (issue 19), Liger's wheel alone (FLA on the path makes transformers pick it, and
#   FLA 0.6.0 refuses Triton 3.6 on Hopper).
set -u
OUT=${OUT:-/tmp/fusetune-gpu-pending}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = measure ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-liger .peers/liger_kernel-*.whl
  PYTHONPATH=src:/tmp/site-liger timeout 300 python3 -m fusetune bench e2e --shapes qwen3.5-small \
    --variants hf+peft,hf+peft+liger,hf+peft+fusetune --steps 10 --max-batch off --timeout 140 \
    --out "$OUT/qwen3.5-small" 2>&1 | tee "$OUT/qwen3.5-small.log" | tail -8
  echo "done in $SECONDS s"
  exit 0
fi
OUT="$OUT/zero3" WORKERS=0 DEADLINE_S=300 bash tools/gpu_suite_part.sh \
  tests/test_distributed.py tests/test_grpo_distributed.py -k zero3 2>&1 | tail -12
OUT="$OUT/peft" DEADLINE_S=120 bash tools/gpu_suite_part.sh tests/test_lora_peft.py 2>&1 | tail -6
echo "done in $SECONDS s"
