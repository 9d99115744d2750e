#!/usr/bin/env bash
# What the first 4-GPU suite run of 2026-11-26 (fifth) left without a result, in one call on 2
# GPUs (carry .bnb .ds .trl .peers, ~5 minutes), logs under $OUT:
#   the grpo --fsdp test (failed there; its traceback printed here), then side by side the MoE
#   and Gated DeltaNet cases that CPU oversubscription pushed past that run's deadline.
# `bash tools/gpu_pending.sh measure` (1 GPU, no carry, ~9 minutes): bench causal_conv1d (the
#   gradient layout fixed), the compiled step under FSDP2 with shard_lora (issue 16's compiled
#   gap), and Qwen3.5-small's e2e row (19).
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
OUT="$OUT/grpo" WORKERS=0 DEADLINE_S=150 bash tools/gpu_suite_part.sh \
  tests/test_grpo_distributed.py -k fsdp_two_gpus --tb=long >/dev/null 2>&1
sed -n '/= FAILURES =/,$p' "$OUT/grpo/suite-part.txt" | tail -70
tail -3 "$OUT/grpo/suite-part.txt"
CUDA_VISIBLE_DEVICES=0 OUT="$OUT/gdn" PARTS=2 DEADLINE_S=330 bash tools/gpu_suite_part.sh \
  tests/test_gated_delta_rule.py -k "gpu or route" >"$OUT/gdn.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 OUT="$OUT/moe" PARTS=2 DEADLINE_S=330 bash tools/gpu_suite_part.sh \
  tests/test_moe.py -k "large_shapes or route_trains" >"$OUT/moe.log" 2>&1 &
wait
tail -n 25 "$OUT/gdn.log" "$OUT/moe.log"
echo "done in $SECONDS s"
