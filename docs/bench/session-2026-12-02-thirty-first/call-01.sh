# Branch gdr-norms-for-pairs (the thirtieth's patches under branches/norms-for-pairs/, applied on
# a872db3) against main (a872db3), per kernel at both shapes, alternated twice; then the branch's
# GDR GPU tests (its tree holds main's 2149d4b fold too, not yet GPU-run). carry .gdr_trees.
set -u
mkdir -p $OUT/logs
for round in 1 2; do
  for shape in "4 4096 60" "1 32768 80"; do
    set -- $shape
    for tree in main norms-for-pairs; do
      PYTHONPATH=.gdr_trees/$tree/src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py \
        --batch $1 --seq-len $2 --profile --only "launcher's settings" 2>&1 \
        | grep -v "Warning\|warn" | sed "s|launcher's settings|$tree|" | tee -a $OUT/logs/ab-b$1.log
    done
  done
done
echo "A/B done at $SECONDS s"
(cd .gdr_trees/norms-for-pairs && PYTHONPATH=src:tests:../../tools timeout 230 python3 -m pytest \
  -q -p no:cacheprovider -n 12 tests/test_gated_delta_rule.py tests/test_fake_kernels.py \
  > $OUT/logs/pairs-gdr-tests.log 2>&1); tail -n 3 $OUT/logs/pairs-gdr-tests.log
echo "done in $SECONDS s"
