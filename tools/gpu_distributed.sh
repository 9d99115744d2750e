#!/usr/bin/env bash
# Multi-GPU checks on a 2-GPU machine (nvidia-h200-x2). Carry .ds (deepspeed 0.19.8 built with
# DS_BUILD_OPS=0 + hjson, pydantic, pydantic-core, annotated-types, typing-inspection), .trl
# (trl, datasets, dill, multiprocess) and .peers (Liger). Logs under $OUT.
#   bash tools/gpu_distributed.sh tests   # under NCCL: FSDP2 (layouts, PEFT LoRA, tied, bf16
#                                         # MixedPrecisionPolicy), ZeRO-3, grpo under torchrun
#                                         # (DDP and --fsdp), TRL's head on FSDP2 shards
#   bash tools/gpu_distributed.sh bench   # FSDP2 full fine-tuning at 1 and 2 GPUs, 3 variants
set -uo pipefail
OUT=${OUT:-/tmp/fusetune-gpu-distributed}
mkdir -p "$OUT"
wheels=$(ls .ds/*.whl .trl/*.whl .peers/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $wheels
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py \
      tests/test_grpo_distributed.py tests/test_trl_fsdp.py 2>&1 \
      | tee "$OUT/distributed-tests.log" | tail -30
    ;;
  bench)
    for variant in hf liger fusetune; do
      for n in 1 2; do
        timeout 150 torchrun --nproc_per_node $n tools/bench_fsdp2.py --variant $variant 2>&1 \
          | tee -a "$OUT/fsdp2-bench.log" | grep -E "RESULT|Error|error" | tail -2
      done
    done
    ;;
esac
