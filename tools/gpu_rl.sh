#!/usr/bin/env bash
# The RL head on the GPU (issue 15). Carry .trl (trl, datasets, dill, multiprocess wheels: the
# GPU image has the rest) and .peers (Liger, CCE, FLA: ../shared/tools/peer_wheels.sh).
#   bash tools/gpu_rl.sh tests   # the head, TRL, GRPO, linear CE, QLoRA, checkpointing tests compiled
#   bash tools/gpu_rl.sh bench   # bench grpo + log_probs (TRL's head beside ours), bench e2e-grpo
# Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/fusetune-gpu-rl}
mkdir -p "$OUT"
wheels=$(ls .trl/*.whl .peers/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $wheels
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    timeout 420 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_lm_head.py \
      tests/test_trl_grpo.py tests/test_trl.py tests/test_grpo.py tests/test_linear_cross_entropy.py \
      tests/test_quant4.py tests/test_checkpointing.py 2>&1 | tee "$OUT/rl-tests.log" | tail -40
    ;;
  bench)
    timeout 330 python3 -m fusetune bench grpo log_probs --providers fusetune,fusetune-frozen-weight,trl,torch,liger \
      --out "$OUT/bench" 2>&1 | tee "$OUT/rl-bench.log"
    timeout 220 python3 -m fusetune bench e2e-grpo --steps 5 --warmup 2 --out "$OUT/e2e" 2>&1 \
      | tee "$OUT/e2e-grpo.log"
    ;;
esac
