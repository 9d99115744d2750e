#!/usr/bin/env bash
# What the stop of 2026-11-26 (fourth) left GPU-untested, in one call on 2 GPUs (the first test
# needs them), carry .ds .trl .peers, ~6 minutes; logs under $OUT:
#   the grpo --fsdp adapter save (checkpoint_wrapper's module paths), the fake-kernel opcheck of
#   every custom op, and the MoE tests (moe_backward's dx dtype and its fake's empty gradients)
set -u
OUT=${OUT:-/tmp/fusetune-gpu-pending}
mkdir -p "$OUT"
OUT="$OUT" WORKERS=0 DEADLINE_S=150 bash tools/gpu_suite_part.sh tests/test_grpo_distributed.py \
  -k fsdp_two_gpus 2>&1 | tail -5
cp "$OUT/suite-part.txt" "$OUT/grpo-fsdp.txt"
OUT="$OUT" DEADLINE_S=240 bash tools/gpu_suite_part.sh tests/test_fake_kernels.py \
  tests/test_moe.py 2>&1 | tail -30
echo "done in $SECONDS s"
