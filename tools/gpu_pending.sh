#!/usr/bin/env bash
# What the stop of 2026-11-26 (fourth) left GPU-untested, in one call on 2 GPUs (the first test
# needs them), carry .ds .trl .peers, ~6 minutes; logs under $OUT:
#   the grpo --fsdp adapter save (checkpoint_wrapper's module paths), the fake-kernel opcheck of
#   every custom op, and the MoE tests (moe_backward's dx dtype and its fake's empty gradients).
# `bash tools/gpu_pending.sh measure` (1 GPU, no carry, ~9 minutes): the measurements this stop
#   had no device time for: bench causal_conv1d (the gradient layout fixed), the compiled step
#   under FSDP2 with shard_lora (issue 16's compiled gap), and Qwen3.5-small's e2e row (19).
set -u
OUT=${OUT:-/tmp/fusetune-gpu-pending}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if [ "${1:-}" = measure ]; then
  timeout 100 python3 -m fusetune bench causal_conv1d --out "$OUT/bench-conv" 2>&1 \
    | tee "$OUT/bench-conv.log" | tail -6
  timeout 300 python3 -m fusetune bench e2e --nproc 1 --engine fsdp2 --lora \
    --shapes llama-3.2-1b --variants hf-compiled,fusetune-shard-lora,fusetune-shard-lora-compiled \
    --timeout 140 --out "$OUT/fsdp2-compiled" 2>&1 | tee "$OUT/fsdp2-compiled.log" | tail -8
  timeout 150 python3 -m fusetune bench e2e --shapes qwen3.5-small \
    --variants hf+peft,hf+peft+fusetune --steps 10 --max-batch off --timeout 140 \
    --out "$OUT/qwen3.5-small" 2>&1 | tee "$OUT/qwen3.5-small.log" | tail -6
  echo "done in $SECONDS s"
  exit 0
fi
OUT="$OUT" WORKERS=0 DEADLINE_S=150 bash tools/gpu_suite_part.sh tests/test_grpo_distributed.py \
  -k fsdp_two_gpus 2>&1 | tail -5
cp "$OUT/suite-part.txt" "$OUT/grpo-fsdp.txt"
OUT="$OUT" DEADLINE_S=240 bash tools/gpu_suite_part.sh tests/test_fake_kernels.py \
  tests/test_moe.py 2>&1 | tail -30
echo "done in $SECONDS s"
