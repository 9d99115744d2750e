#!/usr/bin/env bash
# Multi-GPU checks on a 2-GPU machine (nvidia-h200-x2 or h100-x2). Carry .ds (deepspeed 0.19.8
# built with DS_BUILD_OPS=0 + its import-time needs), .trl (trl, datasets, dill, multiprocess,
# xxhash) and .peers (Liger): `bash tools/distributed_wheels.sh` builds all three (~10 MiB).
# Logs under $OUT.
#   bash tools/gpu_distributed.sh tests   # under NCCL: FSDP2 (layouts, PEFT LoRA, tied, LoRA +
#                                         # tied, bf16 MixedPrecisionPolicy), ZeRO-3 (untied,
#                                         # LoRA + tied), bench e2e --nproc plumbing, finetune
#                                         # and grpo under torchrun, TRL's head on FSDP2 shards
#   bash tools/gpu_distributed.sh bench   # bench e2e --nproc 2 in priority order (fits 560 s):
#     (a) FSDP2 full FT Llama-3.2-1B, (b) FSDP2 LoRA Llama (profiled; also HF and fusetune with
#     each layer compiled), (c) ZeRO-3 full Llama,
#     (d) FSDP2 full / LoRA Qwen2.5-0.5B, (e) ZeRO-3 LoRA Llama; each variant (hf, liger,
#     fusetune) at 1 GPU (launches side by side) and 2 GPUs; a step starts only with 60 s
#     left, each launch under --timeout 150. Tables: $OUT/bench-*/e2e-distributed.txt.
#   bash tools/gpu_distributed.sh full    # issue 16's full fine-tuning targets alone, profiled:
#     FSDP2 full Llama-3.2-1B, hf, fusetune, Liger (its fused loss off: it fails on the sharded
#     head), fusetune and hf with each layer compiled (FULL_VARIANTS, FULL_S: up to 420 s).
#   bash tools/gpu_distributed.sh ddp-lora   # LoRA data parallel: DDP (hf, fusetune) and
#     fusetune-graph (graph_train_step, the gradients averaged in the graph), then FSDP2 with
#     shard_lora, Llama-3.2-1B (~7 minutes).
#   bash tools/gpu_distributed.sh contention  # is the eager LoRA step's 2-rank slowdown the host's?
#     tools/ddp_host_profile.py's DDP step (fusetune eager, 200 steps): world 1 alone on GPU 0,
#     two world-1 runs at once (GPU 0 and 1), one world-2 run, world 1 with OMP_NUM_THREADS=1
#     (what torchrun sets for N > 1). (The first version, 2026-11-27 fourteenth, used bench e2e runs, whose
#     timed steps may not have overlapped.)
#   bash tools/gpu_distributed.sh threads  # the 2-rank eager step's threads: the CPU topology,
#     `top -H` and `ps` (which CPU each busy thread is on) while it runs.
#   bash tools/gpu_distributed.sh pin  # the eager step at world 1 and 2, each rank's main thread
#     pinned to a core of its own (tools/ddp_host_profile.py --pin) or not, alternated twice.
#   bash tools/gpu_distributed.sh qwen-full  # FSDP2 full Qwen2.5-0.5B, hf and fusetune, profiled,
#     as is and with --keep-gathered (reshard_after_forward=False).
set -uo pipefail
OUT=${OUT:-/tmp/fusetune-gpu-distributed}
mkdir -p "$OUT"
wheels=$(ls .ds/*.whl .trl/*.whl .peers/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $wheels
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-560}

bench_step() {  # bench_step NAME CAP_S ARGS...: one `bench e2e --nproc 2` under the time left
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 60 ]; then
    echo "=== $name: not run ($left s left of $BUDGET_S)" | tee -a "$OUT/bench-skipped.log"
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "=== $name (up to $cap s, at ${SECONDS} s)"
  timeout "$cap" python3 -m fusetune bench e2e --nproc 2 --timeout 150 "$@" \
    --out "$OUT/bench-$name" 2>&1 | tee "$OUT/bench-$name.log"
}

case "${1:-tests}" in
  tests)
    nvidia-smi -L | tee "$OUT/gpus.txt"
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rxs --durations=15 tests/test_distributed.py \
      tests/test_bench_distributed.py tests/test_finetune_distributed.py \
      tests/test_grpo_distributed.py tests/test_trl_fsdp.py tests/test_compile_fsdp.py \
      tests/test_fsdp_lora.py tests/test_graphed_step.py 2>&1 \
      | tee "$OUT/distributed-tests.log" | tail -40
    ;;
  bench)
    nvidia-smi -L | tee "$OUT/gpus.txt"
    llama=(--shapes llama-3.2-1b)
    bench_step fsdp2-full-llama 200 --engine fsdp2 --full "${llama[@]}"
    bench_step fsdp2-lora-llama 260 --engine fsdp2 --lora --profile "${llama[@]}" \
      --variants hf,liger,fusetune,hf-compiled,fusetune-compiled
    bench_step zero3-full-llama 260 --engine zero3 --full "${llama[@]}"
    bench_step fsdp2-qwen 300 --engine fsdp2 --full --lora --shapes qwen2.5-0.5b
    bench_step zero3-lora-llama 260 --engine zero3 --lora "${llama[@]}"
    echo "=== tables"
    cat "$OUT"/bench-*/e2e-distributed.txt 2>/dev/null
    ;;
  ddp-lora)  # LoRA with the model whole on every rank: DDP, and fusetune's graphed step with the
    # gradients averaged inside the graph, beside FSDP2 with the adapters replicated
    nvidia-smi -L | tee "$OUT/gpus.txt"
    bench_step ddp-lora-llama 300 --engine ddp --lora --profile --shapes llama-3.2-1b \
      --variants hf,fusetune,fusetune-graph
    bench_step fsdp2-lora-llama 200 --engine fsdp2 --lora --shapes llama-3.2-1b \
      --variants hf-shard-lora,fusetune-shard-lora
    ;;
  contention)
    nvidia-smi -L | tee "$OUT/gpus.txt"
    export PYTHONPATH=src:tests
    profile=(tools/ddp_host_profile.py --no-cprofile --steps 200)
    one() {  # one GPU PORT NAME: a world-1 DDP run on GPU
      CUDA_VISIBLE_DEVICES=$1 timeout 150 torchrun --nproc_per_node 1 --master_port "$2" \
        "${profile[@]}" > "$OUT/$3.log" 2>&1
    }
    one 0 29510 alone; tail -1 "$OUT/alone.log"
    one 0 29511 pair0 & one 1 29512 pair1; wait  # (builds take as long: the steps overlap)
    tail -n 1 "$OUT/pair0.log" "$OUT/pair1.log"
    timeout 150 torchrun --nproc_per_node 2 "${profile[@]}" > "$OUT/world2.log" 2>&1
    tail -1 "$OUT/world2.log"
    OMP_NUM_THREADS=1 one 0 29513 alone-omp1; tail -1 "$OUT/alone-omp1.log"
    ;;
  threads)
    export PYTHONPATH=src:tests
    profile=(tools/ddp_host_profile.py --no-cprofile)
    lscpu | tee "$OUT/lscpu.txt" | grep -i "thread\|core\|socket\|model name\|mhz"
    cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | sort -u | tr '\n' ' ' \
      | tee "$OUT/siblings.txt"; echo
    timeout 150 torchrun --nproc_per_node 2 "${profile[@]}" --steps 300 > "$OUT/threads-run.log" 2>&1 &
    sleep 60
    top -H -b -n 1 -w 200 | head -45 > "$OUT/top-threads.txt"
    for i in 1 2 3; do  # which CPU (psr) each busy thread is on, three samples
      ps -eLo pid,tid,psr,pcpu,comm --sort=-pcpu | head -12 | tee -a "$OUT/ps-threads.txt"
      grep MHz /proc/cpuinfo | sort | uniq -c | sort -rn | head -3 | tee -a "$OUT/ps-threads.txt"
      sleep 3
    done
    wait
    tail -2 "$OUT/threads-run.log"
    ;;
  pin)  # the eager step at world 1 and 2, each rank's main thread pinned to a core or not,
    # alternated twice (host noise is ~10 % between runs)
    export PYTHONPATH=src:tests
    for round in 1 2; do
      for n in 1 2; do
        for pin in "" --pin; do
          printf "round %s world %s %-8s" "$round" "$n" "${pin:-unpinned}" | tee -a "$OUT/pin.txt"
          timeout 100 torchrun --nproc_per_node "$n" tools/ddp_host_profile.py --no-cprofile \
            --steps 100 $pin > "$OUT/pin-$round-$n$pin.log" 2>&1
          tail -n 1 "$OUT/pin-$round-$n$pin.log" | tee -a "$OUT/pin.txt"
        done
      done
    done
    ;;
  qwen-full)  # issue 16's 76 % scaling: FSDP2 full Qwen2.5-0.5B as is and kept gathered
    nvidia-smi -L | tee "$OUT/gpus.txt"
    bench_step fsdp2-full-qwen 200 --engine fsdp2 --full --profile --shapes qwen2.5-0.5b \
      --variants hf,fusetune
    bench_step fsdp2-full-qwen-kept 200 --engine fsdp2 --full --profile --keep-gathered \
      --shapes qwen2.5-0.5b --variants hf,fusetune
    ;;
  full)
    nvidia-smi -L | tee "$OUT/gpus.txt"
    bench_step fsdp2-full-llama "${FULL_S:-420}" --engine fsdp2 --full --profile \
      --shapes llama-3.2-1b --variants "${FULL_VARIANTS:-hf,fusetune,liger,fusetune-compiled,hf-compiled}"
    ;;
esac
