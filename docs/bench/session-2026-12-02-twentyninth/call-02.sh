# (1) calibration again (call 1's log did not come back): main with mm_state's bf16 products
# untransposed (.gdr_trees/untr), the fault probe at B4 T4096 and B2 T700, 3 repeats.
# (2) only if (1) faulted (the H200 shows the H100's fault class): branch gdr-walk-k64-default
# (.gdr_trees/k64) through the probe at all three shapes, 3 repeats, and its GDR GPU tests.
# (3) bwd_chunk_kernel's cubin from Triton's cache (for SASS line info offline).
set -u
mkdir -p $OUT/logs
PYTHONPATH=.gdr_trees/untr/src:tests:tools timeout 170 python3 -u tools/gdr_fault_probe.py \
  matrix --repeats 3 --shapes b4t4096 b2t700 > $OUT/logs/probe-untransposed.log 2>&1
tail -3 $OUT/logs/probe-untransposed.log
echo "probe done at $SECONDS s"
cubin=$(ls -t ~/.triton/cache/*/bwd_chunk_kernel.cubin 2>/dev/null | head -1)
[ -n "$cubin" ] && cp "$cubin" $OUT/logs/bwd_chunk_kernel.cubin
if grep -q "^--- .* [1-9][0-9]* faulted or wrong" $OUT/logs/probe-untransposed.log; then
  PYTHONPATH=.gdr_trees/k64/src:tests:tools timeout 200 python3 -u tools/gdr_fault_probe.py \
    matrix --repeats 3 > $OUT/logs/probe-k64.log 2>&1
  tail -3 $OUT/logs/probe-k64.log
  echo "k64 probe done at $SECONDS s"
  cd .gdr_trees/k64 && PYTHONPATH=src:tests:tools timeout 200 python3 -m pytest -q \
    -p no:cacheprovider -n 12 tests/test_gated_delta_rule.py tests/test_fake_kernels.py \
    > $OUT/logs/k64-gdr-tests.log 2>&1; tail -3 $OUT/logs/k64-gdr-tests.log
fi
echo "done in $SECONDS s"
