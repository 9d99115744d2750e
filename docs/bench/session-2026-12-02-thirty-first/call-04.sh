# The key-block walks at 3 stages (call 3's row "states / dstates 3 stages": B1 GPU sum 8.39 ->
# 7.39 ms), as the launcher now takes them (.gdr_trees/walk3: both where the walks' programs
# leave SMs idle, dstates alone elsewhere on Hopper): (1) bench beside FLA; (2) the fault probe
# (call 3's 1-stage row faulted, an illegal address); (3) its GDR GPU tests. (A per-kernel A/B
# against main was cut: a refused start left 561 device-seconds.) carry .gdr_trees .peers.
set -u
mkdir -p $OUT/logs
bash tools/install_carried.sh .peers >/dev/null 2>&1
PYTHONPATH=.gdr_trees/walk3/src:/tmp/site timeout 100 python3 -m fusetune bench gated_delta_rule \
  --providers fla,fusetune --out /tmp/gdr 2>&1 | grep -v "\.\.\.$" | tee $OUT/logs/bench.log
echo "bench done at $SECONDS s"
PYTHONPATH=.gdr_trees/walk3/src:tests:tools timeout 130 python3 -u tools/gdr_fault_probe.py \
  matrix --repeats 2 > $OUT/logs/probe.log 2>&1
tail -n 4 $OUT/logs/probe.log
echo "probe done at $SECONDS s"
PYTHONPATH=.gdr_trees/walk3/src:tests:tools timeout 190 python3 -m pytest -q -p no:cacheprovider \
  -n 12 tests/test_gated_delta_rule.py tests/test_fake_kernels.py > $OUT/logs/gdr-tests.log 2>&1
tail -n 2 $OUT/logs/gdr-tests.log
echo "tests done at $SECONDS s"
echo "done in $SECONDS s"
