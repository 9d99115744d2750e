#!/usr/bin/env bash
# GPU checks of fusetune.apply (issue 8, part A): the same pytest files as on the CPU, on CUDA,
# where they train 30 steps of 4 x 64 tokens per family (fp32, bf16 autocast, PEFT LoRA) and
# add Trainer bf16=True / fp16=True and Inductor. Three stages, each under its own timeout, so a
# slow first compile on a fresh machine cannot eat the others:
#   1. tests/test_transformers.py except the compile test   (TF_TIMEOUT, 300 s)
#   2. tests/test_transformers_trainer.py                    (TF_TRAINER_TIMEOUT, 150 s)
#   3. the torch.compile(fullgraph=True) test, Inductor      (TF_COMPILE_TIMEOUT, 150 s)
# Logs under $OUT (or ./gpu_out): transformers-*.log, a table in transformers-summary.txt.
# Usage: bash tools/gpu_transformers.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/transformers-env.txt"

PYTEST=(python3 -m pytest -q -p no:cacheprovider --tb=short -rfE --durations=12)
status=0
summary=()
stage() {  # stage NAME TIMEOUT PYTEST-ARGS...
  local name=$1 limit=$2 start rc line
  shift 2
  start=$(date +%s)
  timeout "$limit" "${PYTEST[@]}" "$@" > "$OUT/transformers-$name.log" 2>&1
  rc=$?
  line=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|^(=+ )?no tests ran' "$OUT/transformers-$name.log" \
    | tail -n 1 | tr -d '=')
  [ "$rc" = 124 ] && line="TIMED OUT after ${limit} s; ${line:-no result line}"
  summary+=("$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$(($(date +%s) - start))" "$line")")
  [ "$rc" = 0 ] || status=1
  tail -n 30 "$OUT/transformers-$name.log"
}
# (-n 8: one process took 270 s for 81 of its 113 tests on an H100, 2026-11-27 seventeenth;
# 8 workers, 79 s for all)
stage models "${TF_TIMEOUT:-300}" -n 8 tests/test_transformers.py -k "not torch_compile"
stage trainer "${TF_TRAINER_TIMEOUT:-150}" tests/test_transformers_trainer.py
stage compile "${TF_COMPILE_TIMEOUT:-150}" tests/test_transformers.py -k torch_compile

printf '%s\n' "stage    status  time  result" "${summary[@]}" | tee "$OUT/transformers-summary.txt"
exit "$status"
