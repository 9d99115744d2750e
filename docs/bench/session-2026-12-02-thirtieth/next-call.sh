# Prepared for the next session's first GPU call (not run; ~6 minutes, carry .peers):
# (1) the launch rows not yet timed on the key-block walks and bwd_chunk's 3 stages, per kernel
# at both shapes; (2) bench gated_delta_rule beside FLA with bwd_chunk at 3 stages (this
# session's bench, call 3, predates it).
set -u
mkdir -p $OUT/logs
for shape in "4 4096 100" "1 32768 130"; do
  set -- $shape
  PYTHONPATH=src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py --batch $1 \
    --seq-len $2 --profile --only "launcher's settings" --only "bwd_pairs 3 stages" \
    --only "states / dstates 3 stages" --only "states / dstates 1 stage" \
    --only "key-block walks, 8 warps" 2>&1 | grep -v "Warning\|warn" | tee -a $OUT/logs/rows.log
done
echo "rows done at $SECONDS s"
bash tools/gpu_pending.sh gdr-bench
echo "done in $SECONDS s"
