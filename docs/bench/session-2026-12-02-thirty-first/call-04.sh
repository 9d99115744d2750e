# The key-block walks at 3 stages (call 3's row "states / dstates 3 stages": B1 GPU sum 8.39 ->
# 7.39 ms), as the launcher now takes them (.gdr_trees/walk3: both where the walks' programs
# leave SMs idle, dstates alone elsewhere on Hopper): (1) bench, fusetune alone; (2) the fault
# probe (call 3's 1-stage row faulted, an illegal address); (3) its GDR GPU tests; (4) bench
# beside FLA in what time is left (FLA autotunes on a fresh machine: call 3's first two rounds
# ran past 100 s that way). A per-kernel A/B against main was cut: refused starts left 561
# device-seconds. carry .gdr_trees .peers.
set -u
mkdir -p $OUT/logs
bash tools/install_carried.sh .peers >/dev/null 2>&1
bench() {
  PYTHONPATH=.gdr_trees/walk3/src:/tmp/site timeout $2 python3 -m fusetune bench gated_delta_rule \
    --providers $1 --out /tmp/gdr-$1 2>&1 | grep -v "\.\.\.$" | tee -a $OUT/logs/bench.log
}
bench fusetune 60
echo "bench done at $SECONDS s"
PYTHONPATH=.gdr_trees/walk3/src:tests:tools timeout 130 python3 -u tools/gdr_fault_probe.py \
  matrix --repeats 2 > $OUT/logs/probe.log 2>&1
tail -n 4 $OUT/logs/probe.log
echo "probe done at $SECONDS s"
PYTHONPATH=.gdr_trees/walk3/src:tests:tools timeout 190 python3 -m pytest -q -p no:cacheprovider \
  -n 12 tests/test_gated_delta_rule.py tests/test_fake_kernels.py > $OUT/logs/gdr-tests.log 2>&1
tail -n 2 $OUT/logs/gdr-tests.log
echo "tests done at $SECONDS s"
bench fusetune,fla $((430 - SECONDS))
echo "done in $SECONDS s"
