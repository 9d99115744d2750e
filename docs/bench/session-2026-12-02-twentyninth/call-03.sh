# bwd_chunk / wy epilogue trims (.gdr_trees/trim) against main (.gdr_trees/main, with the
# key-block walks): per kernel at both shapes, alternated twice; the GDR GPU tests on the
# trims; then Nsight Compute's source view of the trims' bwd_chunk at B4 with its cubin (a
# fresh Triton cache, so that the cubin is the one profiled).
set -u
mkdir -p $OUT/logs
for round in 1 2; do
  for shape in "4 4096 60" "1 32768 80"; do
    set -- $shape
    for tree in main trim; do
      PYTHONPATH=.gdr_trees/$tree/src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py \
        --batch $1 --seq-len $2 $([ $round = 1 ] && echo --profile) --only "launcher's settings" \
        2>&1 | grep -v "Warning\|warn" | sed "s|launcher's settings|$tree|" | tee -a $OUT/logs/ab-b$1.log
    done
  done
done
echo "A/B done at $SECONDS s"
cd .gdr_trees/trim && PYTHONPATH=src:../../tests:../../tools timeout 200 python3 -m pytest -q \
  -p no:cacheprovider -n 12 ../../tests/test_gated_delta_rule.py ../../tests/test_fake_kernels.py \
  > $OUT/logs/trim-gdr-tests.log 2>&1; tail -3 $OUT/logs/trim-gdr-tests.log; cd ../..
echo "tests done at $SECONDS s"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
export TRITON_CACHE_DIR=/tmp/ncu-cache
step="import torch, fusetune
from gdr_modes_bench import DIM, HEADS, make_run
from fusetune.bench.cases_gated_delta_rule import _inputs
leaves = _inputs(4, 4096, HEADS, DIM, torch.bfloat16, torch.device('cuda'))
grad = torch.randn(4, 4096, HEADS, DIM, device='cuda', dtype=torch.bfloat16)
run, _ = make_run(lambda: fusetune.gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0], leaves, grad)
for _ in range(3):
    run()
torch.cuda.synchronize()"
PYTHONPATH=.gdr_trees/trim/src:tests:tools timeout 150 $ncu --kernel-name bwd_chunk_kernel \
  --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats \
  -o $OUT/logs/bwd_chunk_trim python3 -c "$step" > $OUT/logs/ncu.log 2>&1
timeout 60 $ncu --import $OUT/logs/bwd_chunk_trim.ncu-rep --page source --csv --print-source sass \
  > $OUT/logs/bwd_chunk_trim_sass.csv 2>> $OUT/logs/ncu.log
cp $(ls /tmp/ncu-cache/*/bwd_chunk_kernel.cubin | head -1) $OUT/logs/ 2>> $OUT/logs/ncu.log
rm -f $OUT/logs/bwd_chunk_trim.ncu-rep
ls -la $OUT/logs; echo "done in $SECONDS s"
