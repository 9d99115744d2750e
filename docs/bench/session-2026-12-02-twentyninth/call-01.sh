# (1) calibration: does the H200 show the 2026-11-27 H100 fault? main with mm_state's bf16
# products untransposed (.gdr_trees/untr), the fault probe at B4 T4096 and B2 T700, 3 repeats.
# (2) Nsight Compute's source view of bwd_chunk_kernel at B4 T4096 (main): stalls per SASS line.
# (3) branch gdr-walk-k64-default (.gdr_trees/k64): key-block walks (default) against the
# transposed walks, per kernel, both shapes.
set -u
PYTHONPATH=.gdr_trees/untr/src:tests:tools timeout 170 python3 -u tools/gdr_fault_probe.py \
  matrix --repeats 3 --shapes b4t4096 b2t700 2>&1 | tee $OUT/probe-untransposed.log
echo "probe done at $SECONDS s"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $ncu"; $ncu --version | tail -1
step="import torch, fusetune
from gdr_modes_bench import DIM, HEADS, make_run
from fusetune.bench.cases_gated_delta_rule import _inputs
leaves = _inputs(4, 4096, HEADS, DIM, torch.bfloat16, torch.device('cuda'))
grad = torch.randn(4, 4096, HEADS, DIM, device='cuda', dtype=torch.bfloat16)
run, _ = make_run(lambda: fusetune.gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0], leaves, grad)
for _ in range(3):
    run()
torch.cuda.synchronize()"
PYTHONPATH=src:tests:tools timeout 150 $ncu --kernel-name bwd_chunk_kernel --launch-skip 2 \
  --launch-count 1 --section SourceCounters --section WarpStateStats --section LaunchStats \
  --import-source yes -o $OUT/bwd_chunk python3 -c "$step" 2>&1 | tail -5 | tee $OUT/ncu.log
timeout 60 $ncu --import $OUT/bwd_chunk.ncu-rep --page source --csv --print-source sass \
  > $OUT/bwd_chunk_sass.csv 2> $OUT/ncu-sass.err; echo "sass csv rc $?"
timeout 60 $ncu --import $OUT/bwd_chunk.ncu-rep --page source --csv --print-source cuda \
  > $OUT/bwd_chunk_src.csv 2> $OUT/ncu-src.err; echo "src csv rc $?"
timeout 30 $ncu --import $OUT/bwd_chunk.ncu-rep --page details > $OUT/bwd_chunk_details.txt 2>&1
wc -c $OUT/*.csv; echo "ncu done at $SECONDS s"
for shape in "4 4096 70" "1 32768 100"; do
  set -- $shape
  PYTHONPATH=.gdr_trees/k64/src:tests:tools timeout $3 python3 -u .gdr_trees/k64/tools/gdr_launch_sweep.py \
    --batch $1 --seq-len $2 --profile --only "launcher's settings" --only "walks transposed" \
    2>&1 | tee -a $OUT/k64-b$1.log
done
echo "done in $SECONDS s"
