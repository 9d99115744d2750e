# main (.main_src) against branch gdr-keep-t (the forward's T kept for the backward; the pair
# gradients packed in one tile), alternated twice at each shape; then the GDR GPU tests
set -u
for shape in "1 32768 50" "4 4096 40"; do
  set -- $shape
  for round in 1 2; do
    for tree in .main_src/src src; do
      PYTHONPATH=$tree:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py --batch $1 \
        --seq-len $2 --only "launcher's settings" 2>&1 | sed "s|launcher's settings|$tree|" \
        | tee -a $OUT/trees-b$1.log
    done
  done
done
PYTHONPATH=src:tests:tools timeout 240 python3 -m pytest -q -p no:cacheprovider -n 12 \
  tests/test_gated_delta_rule.py tests/test_fake_kernels.py 2>&1 | tee $OUT/gdr-tests.log | tail -15
echo "done in $SECONDS s"
