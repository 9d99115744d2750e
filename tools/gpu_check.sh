#!/usr/bin/env bash
# The GPU pass: the test suite compiled on CUDA, then the benchmark. Writes logs under $OUT
# (or ./gpu_out). Peers' wheels in .peers/ are installed to a scratch dir if present.
# Usage: bash tools/gpu_check.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/peers
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
# Under a deadline, one line per result (tools/gpu_suite_part.sh: a pytest piped through
# `timeout | tee` once held a device call to its limit and printed no test name).
OUT="$OUT" DEADLINE_S=${DEADLINE_S:-540} bash tools/gpu_suite_part.sh "$@" 2>&1 \
  | tee "$OUT/pytest.log" | tail -n 40
status=0
grep -qE "^(FAILED|ERROR) |deadline: killed" "$OUT/suite-part.txt" && status=1
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m fusetune bench ${BENCH_OPS:-} --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" \
    | grep -v '^\[bench\]'
fi
exit "$status"
