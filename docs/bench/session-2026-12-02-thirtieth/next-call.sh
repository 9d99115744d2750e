# Prepared for the next session's GPU calls (not run), carry .peers (bench) / .gdr_trees (pairs):
#   bash next-call.sh rows   (~3 min) launch rows not yet timed on the key-block walks, bwd_pairs
#                            at 3 stages; per kernel at both shapes
#   bash next-call.sh pairs  (~5 min) branch gdr-norms-for-pairs (patches under branches/
#                            norms-for-pairs/) against main per kernel, then its GDR GPU tests;
#                            build .gdr_trees/{main,norms-for-pairs} first: for the branch,
#                            `git worktree add /tmp/p HEAD && (cd /tmp/p && git am .../*.patch)`,
#                            then copy its src and tests; for main, `git archive HEAD src`
#   bash next-call.sh bench  (~4 min) bench gated_delta_rule beside FLA (bwd_chunk at 3 stages:
#                            the thirtieth's bench, call 3, predates it)
set -u
mkdir -p $OUT/logs
case "${1:-rows}" in
rows)
  for shape in "4 4096 100" "1 32768 130"; do
    set -- $shape
    PYTHONPATH=src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py --batch $1 \
      --seq-len $2 --profile --only "launcher's settings" --only "bwd_pairs 3 stages" \
      --only "states / dstates 3 stages" --only "states / dstates 1 stage" \
      --only "key-block walks, 8 warps" 2>&1 | grep -v "Warning\|warn" | tee -a $OUT/logs/rows.log
  done ;;
pairs)
  for round in 1 2; do
    for shape in "4 4096 60" "1 32768 80"; do
      set -- $shape
      for tree in main norms-for-pairs; do
        PYTHONPATH=.gdr_trees/$tree/src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py \
          --batch $1 --seq-len $2 --profile --only "launcher's settings" 2>&1 \
          | grep -v "Warning\|warn" | sed "s|launcher's settings|$tree|" | tee -a $OUT/logs/ab.log
      done
    done
  done
  (cd .gdr_trees/norms-for-pairs && PYTHONPATH=src:tests:../../tools timeout 200 python3 -m pytest \
    -q -p no:cacheprovider -n 12 tests/test_gated_delta_rule.py tests/test_fake_kernels.py \
    > $OUT/logs/pairs-gdr-tests.log 2>&1); tail -n 2 $OUT/logs/pairs-gdr-tests.log ;;
bench)
  bash tools/gpu_pending.sh gdr-bench ;;
esac
echo "done in $SECONDS s"
