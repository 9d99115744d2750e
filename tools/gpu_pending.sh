#!/usr/bin/env bash
# What the stop of 2026-11-26 (sixth) left unmeasured, logs under $OUT (few files: the device
# returns ~8 per call):
#   bash tools/gpu_pending.sh          2 GPUs, carry .ds .peers (~6 minutes): ZeRO-3 LoRA at 1
#     and 2 GPUs with the fused q/k/v and MLP groups (issue 16's last scaling cell; on x4 the
#     same script adds 4 GPUs).
#   bash tools/gpu_pending.sh qlora    1 GPU, carry .unsloth .bnb (~8 minutes): the QLoRA 1B step
#     with Unsloth in one run, fusetune compiled included (its peak after the dequantisation
#     call tag: 9.37 GiB in a separate call; issue 22 wants the same run). Unsloth saves the
#     shape's random weights on its first run (over 70 s on a cold machine).
set -u
OUT=${OUT:-/tmp/fusetune-gpu-pending}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = qlora ]; then
  # shellcheck source=tools/unsloth_env.sh
  source tools/unsloth_env.sh
  for run in "hf 90" "fusetune 90" "unsloth 200" "fusetune 150 --compile"; do
    # shellcheck disable=SC2086
    set -- $run
    variant=$1 limit=$2
    shift 2
    echo "== llama-3.2-1b b4 $variant $*" >>"$OUT/qlora.log"
    timeout "$limit" python3 tools/bench_qlora.py --shape llama-3.2-1b --batch 4 \
      --variant "$variant" --steps 12 "$@" 2>&1 | tee -a "$OUT/qlora.log" | grep RESULT
  done
  echo "done in $SECONDS s"
  exit 0
fi
OUT="$OUT/scaling" BUDGET_S=560 bash tools/gpu_scaling.sh zero3-lora 2>&1 | tail -12
echo "done in $SECONDS s"
