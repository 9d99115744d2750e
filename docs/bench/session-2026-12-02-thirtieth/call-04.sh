# bwd_chunk at 3 and 4 stages against the launcher's 2 (rows prepared last session, not yet run:
# the value loop waits on its loads, 8 % of its stall samples), both shapes, GPU time per kernel;
# then the GDR GPU tests on a tree with bwd_chunk at 3 stages (.gdr_trees/stages3, carried).
set -u
mkdir -p $OUT/logs
for shape in "4 4096 80" "1 32768 100"; do
  set -- $shape
  PYTHONPATH=src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py --batch $1 \
    --seq-len $2 --profile --only "launcher's settings" --only "bwd_chunk 3 stages" \
    --only "bwd_chunk 4 stages" 2>&1 | grep -v "Warning\|warn" | tee -a $OUT/logs/stages.log
done
echo "sweep done at $SECONDS s"
(cd .gdr_trees/stages3 && PYTHONPATH=src:tests:../../tools timeout 190 python3 -m pytest -q \
  -p no:cacheprovider -n 12 tests/test_gated_delta_rule.py tests/test_fake_kernels.py \
  > $OUT/logs/stages3-gdr-tests.log 2>&1); tail -n 2 $OUT/logs/stages3-gdr-tests.log
echo "done in $SECONDS s"
