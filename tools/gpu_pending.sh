#!/usr/bin/env bash
# What the stops of 2026-11-26 (seventh, eighth) left unmeasured, logs under $OUT (few files:
# the device returns ~8 per call). Run each as the first call on a fresh machine (a machine held
# for long gets a jittery host; QLoRA 1B rows read 25-40 % slow on two such machines):
#   bash tools/gpu_pending.sh           1 GPU, carry .unsloth .bnb (~8 minutes): issue 22's
#     rows. First the QLoRA 8B b2 step with fusetune's offloaded checkpointing (its memory
#     target: Unsloth offloads and peaked 7.03 GiB, fusetune's in-GPU checkpoints 7.55; the
#     offloaded row was cut by the budget twice), then the 1B b4 step for hf, fusetune, unsloth
#     and fusetune compiled in one run (NO_COMPILE=1: not the compiled row). First of all the
#     host cost of a Triton launch and its parts (tools/bench_launch.py, ~30 s).
#   bash tools/gpu_pending.sh replay    1 GPU, carry .unsloth .bnb (~7 minutes): the 4-bit tests
#     (the replayed dequantisation's first GPU run), dense() replayed vs plainly launched, then
#     the QLoRA 1B b4 step: fusetune, HF, Unsloth, fusetune with plain launches, fusetune
#     (NO_TESTS=1: the steps alone, for a fresh machine; RUNS=... to choose).
#   bash tools/gpu_pending.sh graph     1 GPU, carry .bnb (~5 minutes): the Llama-3.2-1B b4 LoRA and
#     QLoRA steps eager and as one CUDA graph of the whole step (tools/graph_step.py): how much
#     of each step is host time, before building a graphed step into fusetune.
#   bash tools/gpu_pending.sh graphed   1 GPU, carry .unsloth .bnb (~8 minutes): the QLoRA 1B b4 step
#     eager and through fusetune.graph_train_step beside HF and Unsloth, then its tests.
#   bash tools/gpu_pending.sh qlora-rest 1 GPU, carry .bnb .peers (~7 minutes): issue 22's last rows,
#     Liger-Kernel on HF + PEFT + bnb and fusetune graphed (1B b4, one run), then the 8B shape's
#     largest batch (fusetune, offloaded checkpointing).
#     (2026-11-27 thirteenth: the 8B search died without a word past batch 4, each try's layer
#     inputs in pinned host memory: the offloaded mode's largest batch is the host's to say.)
#   bash tools/gpu_pending.sh 8b-largest 1 GPU, carry .bnb (~5 minutes): the 8B shape's largest
#     batch with in-GPU checkpoints (each try printed as it ends).
#   bash tools/gpu_pending.sh 8b        1 GPU, carry .unsloth .bnb (~7 minutes): the QLoRA 8B b2
#     step with checkpointing in one run: Unsloth (its offloaded mode), fusetune offloaded,
#     fusetune in-GPU (OFFLOAD_ONLY=1: not the in-GPU row).
#   bash tools/gpu_pending.sh long      1 GPU, carry .unsloth .bnb .peers (63 MiB; ~9 minutes a
#     shape): the in-place LoRA add's Inductor test, then issue 18 item 3, the longest sequence
#     at batch 1 (tools/long_context.py; HF + PEFT, Liger, fusetune, fusetune with offloaded
#     checkpoints, Unsloth), Llama-3.2-1B then the 8B shape (SHAPES=..., VARIANTS=... to choose).
#   bash tools/gpu_pending.sh long-at   1 GPU, carry .unsloth .bnb (~4-9 minutes): issue 18's
#     "longer than Unsloth", one shape (SHAPE=, default llama-8b), each variant (VARIANTS=,
#     default unsloth) from LENGTH (default 262144) up to LIMIT (default LENGTH) with the
#     bisection kept above KNOWN_FIT (default 229376), so an out-of-memory first step ends the
#     run ("OOM N") instead of bisecting down. FIT / OOM lines print as they happen.
#     2026-11-28 (21st), 8B: fusetune offloaded 262144 (174.9 s, 57.6 GiB); Unsloth 229376
#     (168.9 s, 74.0 GiB), OOM at 262144. Llama-3.2-1B is still time-bound (fusetune 256k at
#     52.6 s, Unsloth 128k at 16.4 s, 2026-11-27): SHAPE=llama-3.2-1b LENGTH=262144 LIMIT=524288
#     KNOWN_FIT=131072, one call a variant (a 512k step is ~4 minutes).
#     CAP=N caps every variant's allocator at N GiB (tools/long_context.py --memory-cap-gib;
#     .peers carried too for Liger): Llama-3.2-1B by memory on a GPU where its uncapped search
#     is bound by the step's time. 2026-11-28 (24th), H200, CAP=24 SHAPE=llama-3.2-1b
#     LENGTH=131072 STEP=8192 LIMIT=1048576 KNOWN_FIT=0 VARIANT_S=300: Unsloth 131072, fusetune
#     147456, fusetune offloaded 212992. STEP (default 32768) and VARIANT_S (default 540 s a
#     variant) to choose.
#   bash tools/gpu_pending.sh gdr       1 GPU, no carry (~4 minutes): FIRST JOB. The GDR GPU tests
#     (bf16 W and bf16 products in states / dstates, branch gdr-bf16w, have not run on a GPU),
#     then the launch sweep at both bench shapes: its "fp32 W, tf32 (before)" row
#     (FUSETUNE_GDR_W=fp32) is the code before them, "bf16 W products only" (=w) the middle way.
#   bash tools/gpu_pending.sh gdr-probe 1 GPU, no carry (~3 minutes): tools/gdr_fault_probe.py
#     matrix (levels w / auto, DISABLE_MMA_V3=1 and 4-warp states / dstates, at B4 T4096,
#     B1 T32768 and B2 T700 with strong decays, 5 repeats each in its own process, against level
#     0; compute-sanitizer on the first faulting case). 2026-11-27 sixteenth: found the faults'
#     work-around (the transposed bf16 products); rerun after any change to states / dstates.
#   bash tools/gpu_pending.sh gdr-bench 1 GPU, carry .peers (~4 minutes): `bench gated_delta_rule`
#     with FLA in the same run (issue 20's memory target: at or below FLA's).
#   bash tools/gpu_pending.sh gdr-profile 1 GPU, carry .peers (~3 minutes a shape; SHAPE="4 4096"
#     for the other, default "1 32768"): GPU time per kernel, fusetune beside FLA
#     (tools/gdr_kernel_profile.py), then the sweep's launcher / 1-stage / 3-stage / 4-warp /
#     side-stream rows for states / dstates; main's kernels first when .main_src is carried
#     (`mkdir .main_src && git archive main src | tar -x -C .main_src`, .main_src/ in
#     .git/info/exclude). 2026-11-27 eighteenth: docs/bench/session-2026-11-27-eighteenth/.
#   bash tools/gpu_pending.sh gdr-ncu   1 GPU, no carry (~4 minutes, if the image has Nsight
#     Compute; else one line says so): stall reasons, occupancy and speed of light of
#     bwd_chunk, bwd_pairs, wy and output at B4 T4096 (issue 20: each is 1.5-3x its FLA
#     counterpart, and the torch profile cannot say why). SHAPE="1 32768" for the other shape,
#     KERNELS="..." to choose; a forward and a backward launch of the kernels a step launches
#     twice (wy, inverse, states), one launch of the others.
#   bash tools/gpu_pending.sh gdr-accuracy 1 GPU, carry .peers (~2 minutes): tools/gdr_accuracy.py,
#     bf16 o and gradients against float64 (B2 T2048 H4 D128) for each FUSETUNE_GDR_W /
#     FUSETUNE_GDR_DOT setting the checkout has and for FLA (issue 20: FLA's speed against its bf16 buffers; its backward
#     under Triton 3.6 is the one its own guard refuses).
#   bash tools/gpu_pending.sh gdr-exp   1 GPU, no carry (under 560 s, every step bounded; first
#     call on a fresh machine: the kernels compile cold): the opt-in modes FUSETUNE_GDR_DOT=bf16
#     (FLA's precision) and FUSETUNE_GDR_W=d (bf16 D); 2026-11-28 (21st) call 4 ran (1) and the
#     file's -k bf16 cases (42 passed): 4.31 -> 4.00 / 4.08 ms at B4, 9.27 -> 8.63 / 8.21 at B1.
#     (2) and (3) are still to run. (1) The sweep rows launcher's settings / bf16 products /
#     bf16 products, bf16 D at B4 T4096 then B1 T32768 (median of 3; the modes' speed against
#     FLA's 4.11 / 6.39 ms). (2) The GDR GPU tests under the default (the file's own bf16-products cases set the modes: T1000
#     D128 mild and strong decays, with and without W=d, and the CPU ones compiled). (3)
#     tools/gdr_accuracy.py (B2 T2048 H4 D128 against float64, each W / DOT setting, a row as it
#     ends; no FLA row without .peers). (4) With 60 s or more left, the file's bf16 cases again
#     with FUSETUNE_GDR_DOT=bf16 forced on them (the test_matrix bf16 column among them).
#   gdr-ksplit: removed 2026-11-28 (twenty-second): measured on an H200, no win
#     (docs/bench/session-2026-11-28-twentysecond/call-01).
#   bash tools/gpu_pending.sh gdr-branch 1 GPU, no carry (~5 minutes): a GDR branch's first call:
#     the GDR GPU tests and the fault probe.
#   bash tools/gpu_pending.sh gdr-wy    1 GPU, carry .main_src .peers (~9 minutes): the blocked
#     inverse (2026-12-01): a tree before and this one timed at both shapes, per kernel beside FLA
#     at B4, wy's 2-stage row at both, the GDR GPU tests, the fault probe at both shapes.
#   bash tools/gpu_pending.sh gdr-trees 1 GPU, carry .gdr_trees (~3 minutes): fwd+bwd at both bench
#     shapes for each source tree under .gdr_trees/NAME/src and the checkout's, one call. After
#     2026-11-28 nineteenth: check out gdr-next (gdr-bwd-rowsums + gdr-bwd-launch), then
#     `rm -rf .gdr_trees; for b in main gdr-bwd-launch gdr-bwd-rowsums; do mkdir -p
#     .gdr_trees/$b && git archive $b src | tar -x -C .gdr_trees/$b; done` (.gdr_trees/ in
#     .git/info/exclude). Then `gdr-branch` on the winner before it merges: neither branch has
#     run a GPU test.
#   (moe: measured in the ninth session, docs/bench/session-2026-11-27-ninth/.)
#   bash tools/gpu_pending.sh moe-tma   1 GPU, no carry (under 560 s on a cold H100, each step
#     bounded): issue 21's FUSETUNE_MOE_TMA (1: expert weights and sorted activation rows
#     through TMA; 2: x and dout copied into sorted order too; 2 the default on Hopper+ since
#     2026-11-28 twenty-second: docs/bench/session-2026-11-28-twentysecond/call-02). (1)
#     tests/test_moe.py with 1 forced, then its reference / gpt-oss / large-shape cases with 2;
#     (2) tools/tune_moe.py --tma: Qwen3-30B-A3B then gpt-oss-20b, LoRA r16 and frozen, fwd and
#     fwd+bwd under 0 / 1 / 2 alternated twice, then the CUDA time per kernel of each (LoRA).
#     H200: Qwen LoRA 5.64 / 5.43 / 5.23 ms under 0 / 1 / 2, gpt-oss 11.40 / 9.95 / 9.54.
#   bash tools/gpu_pending.sh compiled  1 GPU, no carry (~6 minutes): the in-place LoRA add
#     under Inductor (its test, then the Llama-3.2-1B step eager and compiled, median of 20,
#     with --profile: the compiled step had 173 device-to-device copies, 3.1 ms, before it);
#     FSDP2=1 adds the compiled step under FSDP2 at 1 GPU (issue 16; ~4 more minutes: a call
#     of its own if the first part ran long).
set -u
OUT=${OUT:-/tmp/fusetune-gpu-pending}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = long ]; then
  # shellcheck source=tools/unsloth_env.sh
  source tools/unsloth_env.sh  # (.unsloth and .bnb when carried: the unsloth variant)
  bash tools/install_carried.sh .peers >/dev/null 2>&1
  export PYTHONPATH=src:tools:tests:/tmp/site
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k inductor 2>&1 \
    | tail -3 | tee "$OUT/compiled.log"
  for shape in ${SHAPES:-llama-3.2-1b llama-8b}; do
    timeout 400 python3 tools/long_context.py --shapes "$shape" --timeout ${VARIANT_S:-100} --limit 262144 \
      --max-step-s ${MAX_STEP_S:-20} \
      --variants ${VARIANTS:-hf+peft hf+peft+liger hf+peft+fusetune hf+peft+fusetune+offload unsloth} \
      2>&1 | tee -a "$OUT/long_context.log"
  done
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = long-at ]; then
  # shellcheck source=tools/unsloth_env.sh
  source tools/unsloth_env.sh
  bash tools/install_carried.sh .peers >/dev/null 2>&1  # (Liger, where carried)
  export PYTHONPATH=src:tools:tests:/tmp/site
  length=${LENGTH:-262144}
  limit_s=${VARIANT_S:-540}
  for variant in ${VARIANTS:-unsloth}; do
    timeout "$limit_s" python3 tools/long_context.py --shapes "${SHAPE:-llama-8b}" \
      --variants "$variant" --start "$length" --step "${STEP:-32768}" --limit "${LIMIT:-$length}" \
      --known-fit "${KNOWN_FIT:-229376}" --memory-cap-gib "${CAP:-0}" --max-step-s 400 \
      --timeout $((limit_s - 20)) 2>&1 | tee -a "$OUT/long_context.log" \
      | grep "FIT\|OOM\|{\|error\|timed"
  done
  echo "done in $SECONDS s"
  exit 0
fi
gdr_tests() {  # the GDR GPU tests, compiled
  PYTHONPATH=src:tests:tools timeout 220 python3 -m pytest -q -p no:cacheprovider -n 12 \
    tests/test_gated_delta_rule.py 2>&1 | tail -4 | tee "$OUT/gdr-tests.log"
}
gdr_probe() {  # gdr_probe TIMEOUT_S ARGS...: tools/gdr_fault_probe.py matrix, each case apart
  local limit=$1
  shift
  PYTHONPATH=src:tests:tools timeout "$limit" python3 tools/gdr_fault_probe.py matrix "$@" \
    2>&1 | tee "$OUT/gdr-fault-probe.log"
}
if [ "${1:-}" = gdr ]; then  # the GPU tests, then launch variants at both shapes
  export PYTHONPATH=src:tests:tools
  gdr_tests
  for shape in "4 4096" "1 32768"; do
    set -- $shape
    timeout 150 python3 tools/gdr_launch_sweep.py --repeats 3 --batch "$1" --seq-len "$2" 2>&1 \
      | tee -a "$OUT/gdr-sweep.log"
  done
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = gdr-accuracy ]; then  # bf16 errors against float64, fusetune's levels and FLA's
  bash tools/install_carried.sh .peers >/dev/null 2>&1
  export PYTHONPATH=src:tools:/tmp/site
  timeout 300 python3 tools/gdr_accuracy.py 2>&1 | tee "$OUT/gdr-accuracy.log"
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = gdr-exp ]; then  # the opt-in bf16 products / bf16 D: speed, tests, accuracy
  export PYTHONPATH=src:tests:tools
  rows=(--only "launcher's settings" --only "bf16 products" --only "bf16 products, bf16 D")
  # (B4 compiles the three settings' kernels cold; B1 finds them in Triton's cache)
  timeout 170 python3 tools/gdr_launch_sweep.py --repeats 3 --batch 4 --seq-len 4096 \
    "${rows[@]}" 2>&1 | tee -a "$OUT/gdr-exp-sweep.log"
  timeout 75 python3 tools/gdr_launch_sweep.py --repeats 3 --batch 1 --seq-len 32768 \
    "${rows[@]}" 2>&1 | tee -a "$OUT/gdr-exp-sweep.log"
  echo "sweep done at $SECONDS s" | tee -a "$OUT/gdr-exp-sweep.log"
  # (-v: each test's result as it ends, so that a run cut by its bound still says which passed)
  timeout 215 python3 -m pytest -v -p no:cacheprovider -n 14 tests/test_gated_delta_rule.py \
    2>&1 | tee "$OUT/gdr-exp-tests.log" | tail -4
  echo "tests done at $SECONDS s" | tee -a "$OUT/gdr-exp-tests.log"
  timeout 85 python3 tools/gdr_accuracy.py 2>&1 | tee "$OUT/gdr-exp-accuracy.log"
  left=$((555 - SECONDS))  # (the bounds above sum to 545 s)
  if [ "$left" -ge 60 ]; then  # the file's bf16 cases with the bf16 products forced
    FUSETUNE_GDR_DOT=bf16 timeout "$left" python3 -m pytest -v -p no:cacheprovider -n 14 \
      tests/test_gated_delta_rule.py -k bf16 2>&1 | tee "$OUT/gdr-exp-tests-forced.log" | tail -4
  fi
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = gdr-probe ]; then  # the bf16 W faults: every level x candidate fix
  gdr_probe 420 --repeats 5
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = gdr-branch ]; then  # a GDR branch's first call: its kernels' tests and probe
  gdr_tests
  gdr_probe 200 --repeats 3 --shapes b4t4096 b1t32768
  echo "done in $SECONDS s"
  exit 0
fi
gdr_tree_row() {  # gdr_tree_row TREE BATCH SEQ_LEN LOG: fwd+bwd of one source tree's kernels
  PYTHONPATH=$1:tests:tools timeout 60 python3 tools/gdr_launch_sweep.py --batch "$2" \
    --seq-len "$3" --only "launcher's settings" 2>&1 \
    | sed "s|launcher's settings|$1|" | tee -a "$4"
}
if [ "${1:-}" = gdr-trees ]; then  # GDR source trees timed side by side (carry .gdr_trees)
  for shape in "4 4096" "1 32768"; do
    set -- $shape
    for tree in .gdr_trees/*/src src; do
      gdr_tree_row "$tree" "$1" "$2" "$OUT/gdr-trees.log"
    done
  done
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = gdr-wy ]; then  # the blocked inverse: old and new trees timed, tests, probe
  bash tools/install_carried.sh .peers >/dev/null 2>&1  # (FLA, where carried)
  export PYTHONPATH=src:tests:tools:/tmp/site
  for shape in "4 4096" "1 32768"; do  # (carry .main_src: git archive of the tree before)
    set -- $shape
    gdr_tree_row .main_src/src "$1" "$2" "$OUT/gdr-trees.log"
    gdr_tree_row src "$1" "$2" "$OUT/gdr-trees.log"
  done
  if [ -d /tmp/site/fla ]; then  # per kernel beside FLA, B4
    timeout 150 python3 tools/gdr_kernel_profile.py --batch 4 --seq-len 4096 2>&1 \
      | tee "$OUT/gdr-profile-b4-t4096.log"
  fi
  for shape in "4 4096" "1 32768"; do
    set -- $shape
    timeout 60 python3 tools/gdr_launch_sweep.py --repeats 3 --batch "$1" --seq-len "$2" \
      --only "launcher's settings" --only "wy 2 stages" 2>&1 | tee -a "$OUT/gdr-sweep.log"
  done
  gdr_tests
  gdr_probe 100 --repeats 2 --shapes b4t4096 b1t32768
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = gdr-profile ]; then  # where FLA's step time goes and ours, at one shape
  bash tools/install_carried.sh .peers >/dev/null 2>&1
  export PYTHONPATH=src:tests:tools:/tmp/site
  set -- ${SHAPE:-1 32768}
  if [ -d .main_src/src ]; then  # main's kernels in the same call (carry .main_src: git archive)
    gdr_tree_row .main_src/src "$1" "$2" "$OUT/gdr-main-b$1-t$2.log"
  fi
  # (240 s: at B1 T32768 on a fresh machine FLA autotuned past 150 s, 2026-11-27 eighteenth
  # call 2, and its half of the profile was lost)
  timeout 240 python3 tools/gdr_kernel_profile.py --batch "$1" --seq-len "$2" 2>&1 \
    | tee "$OUT/gdr-profile-b$1-t$2.log"
  rows=("launcher's settings" "states / dstates 1 stage" "states / dstates 3 stages"
        "states 4 warps" "dstates 4 warps" "backward states apart" "backward states beside")
  only=()
  for row in "${rows[@]}"; do only+=(--only "$row"); done
  timeout 240 python3 tools/gdr_launch_sweep.py --batch "$1" --seq-len "$2" "${only[@]}" 2>&1 \
    | tee "$OUT/gdr-sweep-b$1-t$2.log"
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = gdr-ncu ]; then  # why the per-chunk kernels are slow: Nsight Compute's stalls
  export PYTHONPATH=src:tests:tools
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu \
    2>/dev/null | head -1)
  if [ -z "$ncu" ]; then echo "no ncu in this image" | tee "$OUT/gdr-ncu.log"; exit 0; fi
  set -- ${SHAPE:-4 4096}  # (batch, sequence length)
  step="import torch, fusetune
from gdr_modes_bench import DIM, HEADS, make_run
from fusetune.bench.cases_gated_delta_rule import _inputs
leaves = _inputs($1, $2, HEADS, DIM, torch.bfloat16, torch.device('cuda'))
grad = torch.randn($1, $2, HEADS, DIM, device='cuda', dtype=torch.bfloat16)
run, _ = make_run(lambda: fusetune.gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0],
                  leaves, grad)
for _ in range(3):
    run()
torch.cuda.synchronize()"
  # (--launch-skip 2 --launch-count 2 of the step's 3 runs: a kernel launched twice a run,
  # wy, inverse, states, shows the second run's forward and backward launch; the others
  # their third run's one)
  for kernel in ${KERNELS:-bwd_chunk_kernel bwd_pairs_kernel wy_kernel output_kernel}; do
    timeout "${KERNEL_S:-150}" "$ncu" --kernel-name "$kernel" --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      python3 -c "$step" 2>&1 | tee -a "$OUT/gdr-ncu-b$1-t$2.log"
  done
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = gdr-bench ]; then  # beside FLA (carry .peers)
  bash tools/install_carried.sh .peers >/dev/null 2>&1
  export PYTHONPATH=src:/tmp/site
  timeout 300 python3 -m fusetune bench gated_delta_rule --out "$OUT/gdr" 2>&1 \
    | tee "$OUT/gdr-bench.log"
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = moe ]; then  # the gate/up kernel's single accumulator (n128 products)
  bash tools/install_carried.sh .peers >/dev/null 2>&1
  export PYTHONPATH=src:tests:/tmp/site
  timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_moe.py 2>&1 \
    | tail -4 | tee "$OUT/moe-tests.log"
  timeout 330 python3 -m fusetune bench moe --out "$OUT/moe" 2>&1 | tee "$OUT/moe.log"
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = moe-tma ]; then
  export PYTHONPATH=src:tests:tools
  FUSETUNE_MOE_TMA=1 timeout 180 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_moe.py \
    2>&1 | tail -8 | tee "$OUT/moe-tma-tests.log"
  FUSETUNE_MOE_TMA=2 timeout 90 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_moe.py \
    -k "matches_reference or gpt_oss_layout or large_shapes" 2>&1 | tail -6 \
    | tee -a "$OUT/moe-tma-tests.log"
  timeout $((555 - SECONDS)) python3 tools/tune_moe.py --tma --shapes qwen3_moe,gpt_oss 2>&1 \
    | tee "$OUT/moe-tma-bench.log"
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = compiled ]; then
  export PYTHONPATH=src:tests
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k inductor 2>&1 \
    | tail -3 | tee "$OUT/compiled.log"
  timeout 330 python3 -m fusetune bench e2e --shapes llama-3.2-1b --steps 20 --max-batch off \
    --variants hf+peft+fusetune,hf+peft+fusetune+compile --profile --out "$OUT/e2e" 2>&1 \
    | tee -a "$OUT/compiled.log"
  [ -n "${FSDP2:-}" ] && timeout 300 python3 -m fusetune bench e2e --nproc 1 --engine fsdp2 \
    --lora --shapes llama-3.2-1b --timeout 140 --out "$OUT/fsdp2-compiled" \
    --variants hf-compiled,fusetune-shard-lora,fusetune-shard-lora-compiled 2>&1 \
    | tee "$OUT/fsdp2-compiled.log" | tail -8  # (issue 16: compiled 53.1k vs eager 65.5k)
  echo "done in $SECONDS s"
  exit 0
fi
# shellcheck source=tools/unsloth_env.sh
source tools/unsloth_env.sh
qlora() { # shape batch variant limit [flags]
  local shape=$1 batch=$2 variant=$3 limit=$4
  shift 4
  echo "== $shape b$batch $variant $*" >>"$OUT/qlora.log"
  timeout "$limit" python3 tools/bench_qlora.py --shape "$shape" --batch "$batch" \
    --variant "$variant" --steps 12 "$@" 2>&1 | tee -a "$OUT/qlora.log" | grep RESULT
}
if [ "${1:-}" = replay ]; then  # issue 22: the replayed dequantisation (carry .unsloth .bnb)
  [ -n "${NO_TESTS:-}" ] || PYTHONPATH=$PYTHONPATH:tests timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 \
    tests/test_quant4.py 2>&1 | tail -4 | tee "$OUT/replay-tests.log"
  [ -n "${NO_TESTS:-}" ] || timeout 60 python3 tools/bench_dequant.py 2>&1 | tee "$OUT/dequant.log"
  for run in ${RUNS:-fusetune hf unsloth fusetune:--plain-launches fusetune}; do
    # shellcheck disable=SC2086
    qlora llama-3.2-1b 4 "${run%%:*}" $([ "$run" = unsloth ] && echo 170 || echo 75) --steps 20 \
      $([ "$run" = "${run#*:}" ] || echo "${run#*:}")
  done
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = graphed ]; then  # issue 22: fusetune.graph_train_step beside the peers, then its tests
  for run in ${RUNS:-fusetune fusetune:--graph hf unsloth}; do
    # shellcheck disable=SC2086
    qlora llama-3.2-1b 4 "${run%%:*}" $([ "$run" = unsloth ] && echo 170 || echo 75) --steps 20 \
      $([ "$run" = "${run#*:}" ] || echo "${run#*:}")
  done
  PYTHONPATH=$PYTHONPATH:tests timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/test_graphed_step.py 2>&1 | tail -15 | tee "$OUT/graphed-tests.log"
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = qlora-rest ]; then  # issue 22's last rows: Liger on top, the 8B largest batch
  bash tools/install_carried.sh .peers >/dev/null 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  qlora llama-3.2-1b 4 liger 90 --steps 20
  qlora llama-3.2-1b 4 fusetune 75 --steps 20 --graph
  qlora llama-8b 2 fusetune 240 --gradient-checkpointing offload --largest-batch
  grep LARGEST "$OUT/qlora.log" | tail -1
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = 8b-largest ]; then  # issue 22: the 8B shape's largest batch, in-GPU checkpoints
  qlora llama-8b 2 fusetune ${LIMIT_S:-300} --gradient-checkpointing --largest-batch
  grep -e "^try" -e "^estimate" -e LARGEST "$OUT/qlora.log"
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = graph ]; then  # issues 18 and 22: the whole LoRA step as one CUDA graph
  for flags in "" "--qlora"; do
    # shellcheck disable=SC2086
    PYTHONPATH=$PYTHONPATH:tools timeout 240 python3 tools/graph_step.py $flags 2>&1 \
      | grep -v Warning | tee -a "$OUT/graph-step.log"
  done
  echo "done in $SECONDS s"
  exit 0
fi
if [ "${1:-}" = 8b ]; then  # issue 22's 8B rows in one run: Unsloth, fusetune offloaded, in-GPU
  qlora llama-8b 2 unsloth 200 --gradient-checkpointing
  qlora llama-8b 2 fusetune 150 --gradient-checkpointing offload
  [ -n "${OFFLOAD_ONLY:-}" ] || qlora llama-8b 2 fusetune 150 --gradient-checkpointing
  echo "done in $SECONDS s"
  exit 0
fi
PYTHONPATH=$PYTHONPATH:tests timeout 90 python3 tools/bench_launch.py 2>&1 | tee "$OUT/launch.log"
qlora llama-8b 2 fusetune 150 --gradient-checkpointing offload
qlora llama-3.2-1b 4 hf 70
qlora llama-3.2-1b 4 fusetune 70
qlora llama-3.2-1b 4 unsloth 150
[ -n "${NO_COMPILE:-}" ] || qlora llama-3.2-1b 4 fusetune 120 --compile
echo "done in $SECONDS s"
