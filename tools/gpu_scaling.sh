#!/usr/bin/env bash
# Issue 17's scaling run on the largest lent machine (nvidia-h100-x4 / h200-x4 / -x8): `bench
# e2e --nproc` at 1, 2, 4 (and 8 where there are 8 GPUs) for an 8B-class Llama, batch 2 x 2048
# per GPU, median of 5 steps after 2. Carry .ds and .peers. Steps in priority order, each
# started only with 90 s left of BUDGET_S (570), so one call keeps what fits:
#   (a) FSDP2 LoRA (r=16 on every linear layer, full depth): HF + PEFT, + Liger, + fusetune;
#   (b) FSDP2 full fine-tuning of the first 8 layers (--layers 8; the fp32 state of all 32,
#       128 GB, fits no single GPU to scale from): HF, + fusetune;
#   (c) ZeRO-3 LoRA: HF + PEFT, + fusetune;   (d) ZeRO-3 full, 8 layers: HF, + fusetune.
# Steps by name, in the order given: bash tools/gpu_scaling.sh zero3-lora fsdp2-lora
# Tables (tok/s/GPU, peak GiB/GPU, step min/med/max, fused calls against steps, scaling
# against 1 GPU): $OUT/<step>/e2e-distributed.txt, written as rows finish.
set -uo pipefail
OUT=${OUT:-/tmp/fusetune-scaling}
BUDGET_S=${BUDGET_S:-570}
mkdir -p "$OUT"
bash tools/install_carried.sh .ds .peers
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
sizes=2
for n in 4 8; do [ "$n" -le "$gpus" ] && sizes="$sizes,$n"; done
echo "=== 1,$sizes GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

step() {  # step NAME ARGS...: one `bench e2e --nproc` under the time left
  local name=$1 left=$((BUDGET_S - SECONDS))
  shift
  if [ "$left" -lt 90 ]; then echo "=== $name: not run ($left s left)" | tee -a "$OUT/skipped.log"; return; fi
  echo "=== $name (up to $left s, at $SECONDS s)"
  timeout "$left" python3 -m fusetune bench e2e --nproc "$sizes" --shapes llama-3.1-8b \
    --steps 5 --warmup 2 --timeout 170 --out "$OUT/$name" "$@" 2>&1 | tee "$OUT/$name.log"
}
declare -A ARGS=(
  [fsdp2-lora]="--engine fsdp2 --lora --variants hf,liger,fusetune"
  [fsdp2-full]="--engine fsdp2 --full --layers 8 --variants hf,fusetune"
  [zero3-lora]="--engine zero3 --lora --variants hf,fusetune"
  [zero3-full]="--engine zero3 --full --layers 8 --variants hf,fusetune"
)
for name in "${@:-fsdp2-lora fsdp2-full zero3-lora zero3-full}"; do
  # shellcheck disable=SC2086
  for one in $name; do step "$one" ${ARGS[$one]:?"unknown step $one (of ${!ARGS[*]})"}; done
done
echo "done in $SECONDS s"
