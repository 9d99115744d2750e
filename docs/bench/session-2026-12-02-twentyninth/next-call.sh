# Prepared for the next session's first GPU call (not run): main against the two branches of
# this session, per kernel at both shapes, alternated; then each branch's GDR GPU tests.
# Before the call, on the CPU machine (the trees travel with carry .gdr_trees):
#   for b in norms-from-wy backward-parts; do
#     git worktree add -q /tmp/$b HEAD && (cd /tmp/$b && git am -q \
#       docs/bench/session-2026-12-02-twentyninth/branches/$b/*.patch)
#     mkdir -p .gdr_trees/$b && cp -r /tmp/$b/src /tmp/$b/tests .gdr_trees/$b/
#   done
#   mkdir -p .gdr_trees/main && git archive HEAD src | tar -x -C .gdr_trees/main
# Two calls: `bash next-call.sh ab` (~5 min) then `bash next-call.sh tests` (~7 min).
set -u
mkdir -p $OUT/logs
if [ "${1:-ab}" = ab ]; then
for round in 1 2; do
  for shape in "4 4096 60" "1 32768 80"; do
    set -- $shape
    for tree in main norms-from-wy backward-parts; do
      PYTHONPATH=.gdr_trees/$tree/src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py \
        --batch $1 --seq-len $2 $([ $round = 1 ] && echo --profile) --only "launcher's settings" \
        2>&1 | grep -v "Warning\|warn" | sed "s|launcher's settings|$tree|" | tee -a $OUT/logs/ab-b$1.log
    done
  done
done
PYTHONPATH=src:tests:tools timeout 60 python3 -u tools/gdr_launch_sweep.py --batch 4 --seq-len 4096 \
  --only "launcher's settings" --only "bwd_chunk 3 stages" --only "bwd_chunk 4 stages" \
  2>&1 | tee -a $OUT/logs/stages.log
else
for tree in norms-from-wy backward-parts; do
  (cd .gdr_trees/$tree && PYTHONPATH=src:tests:../../tools timeout 200 python3 -m pytest -q \
    -p no:cacheprovider -n 12 tests/test_gated_delta_rule.py tests/test_fake_kernels.py \
    > $OUT/logs/tests-$tree.log 2>&1; tail -2 $OUT/logs/tests-$tree.log)
done
fi
echo "done in $SECONDS s"
