#!/usr/bin/env bash
# What the stop of 2026-11-26 (third) left GPU-untested, in two device calls. Logs under $OUT.
#   bash tools/gpu_pending.sh one   # 1 GPU, carry .bnb .ds .trl .peers, ~9 minutes:
#     the test files this stop changed (verbose, under a deadline), bench rms_norm (the gated
#     case) and causal_conv1d, the LoRA host-time table (tools/host_lora_overhead.py --device cuda)
#   bash tools/gpu_pending.sh two   # 2 GPUs, ~9 minutes: bench e2e --nproc 2 FSDP2 LoRA with
#     shard_lora's variants, then the multi-GPU tests (tools/gpu_distributed.sh tests)
set -u
OUT=${OUT:-/tmp/fusetune-gpu-pending}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
case "${1:-one}" in
  one)
    OUT="$OUT" DEADLINE_S=300 bash tools/gpu_suite_part.sh tests/test_rms_norm.py \
      tests/test_causal_conv1d.py \
      tests/test_lora.py tests/test_lora_peft.py tests/test_compile_routed_layers.py \
      tests/test_transformers.py -k "not bf16_autocast or glm4 or qwen3" 2>&1 | tail -30
    for op in rms_norm causal_conv1d; do
      timeout 100 python3 -m fusetune bench $op --out "$OUT/bench-$op" 2>&1 \
        | tee "$OUT/bench-$op.log" | tail -12
    done
    timeout 120 python3 tools/host_lora_overhead.py --device cuda --model --repeats 7 2>&1 \
      | tee "$OUT/host_lora.txt" | tail -20
    ;;
  three)  # 1 GPU, carry .ds .trl .peers, ~9 minutes: this session's fixes, then the compiled step
    OUT="$OUT" DEADLINE_S=230 bash tools/gpu_suite_part.sh tests/test_causal_conv1d.py \
      tests/test_compile_routed_layers.py tests/test_trl.py tests/test_trl_grpo.py \
      tests/test_bench_harness.py tests/test_transformers.py -k "qwen3_5 or trl or route or not \
      test_transformers" 2>&1 | tail -30
    timeout 300 python3 -m fusetune bench e2e --shapes llama-3.2-1b --variants \
      hf+peft,hf+peft+fusetune,hf+peft+compile,hf+peft+fusetune+compile,hf+peft+compile+fused-loss \
      --steps 10 --max-batch off --timeout 110 --out "$OUT/e2e-compiled" 2>&1 \
      | tee "$OUT/e2e-compiled.log" | tail -12
    ;;
  two)
    timeout 300 python3 -m fusetune bench e2e --nproc 2 --engine fsdp2 --lora \
      --shapes llama-3.2-1b --variants hf,fusetune,hf-shard-lora,fusetune-shard-lora \
      --timeout 140 --out "$OUT/bench-shard-lora" 2>&1 | tee "$OUT/bench-shard-lora.log" | tail -12
    OUT="$OUT" bash tools/gpu_distributed.sh tests
    ;;
esac
echo "done in $SECONDS s"
