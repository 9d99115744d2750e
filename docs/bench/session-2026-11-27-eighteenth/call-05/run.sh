set -u
export PYTHONUNBUFFERED=1
for shape in "4 4096" "1 32768"; do
  set -- $shape
  for tree in .main_src/src .alt_src/src src; do
    PYTHONPATH=$tree:tests:tools timeout 70 python3 tools/gdr_launch_sweep.py --batch "$1" --seq-len "$2" \
      --only "launcher's settings" 2>&1 | sed "s|launcher's settings|$tree|" | tee -a "$OUT/bwd-sweep.log"
  done
done
PYTHONPATH=src:tests:tools timeout 200 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_gated_delta_rule.py 2>&1 | tail -3 | tee "$OUT/gdr-tests.log"
echo "done in $SECONDS s"
