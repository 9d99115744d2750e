# 2026-11-28 nineteenth, call 4 (H100, carry .gdr_trees; checkout: gdr-wy-doubling): GDR source
# trees side by side, the GDR tests on the combined tree, launch rows, a per-kernel profile.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/gpu.txt"
row() {  # row TREE BATCH SEQ_LEN: fwd+bwd of one source tree's kernels
  PYTHONPATH=$1:tests:tools timeout 60 python3 tools/gdr_launch_sweep.py --batch "$2" \
    --seq-len "$3" --only "launcher's settings" 2>&1 | sed "s|launcher's settings|$1|" \
    | tee -a "$OUT/gdr-trees.log"
}
for shape in "4 4096" "1 32768"; do
  set -- $shape
  for tree in .gdr_trees/*/src src; do row "$tree" "$1" "$2"; done
done
# the GDR tests on the tree with both kernel changes (wy doubling + dq in bwd_pairs)
PYTHONPATH=.gdr_trees/tmp-wy-dq/src:tests:tools timeout 230 python3 -m pytest -q \
  -p no:cacheprovider -n 12 tests/test_gated_delta_rule.py 2>&1 | tail -12 | tee "$OUT/gdr-tests.log"
for shape in "4 4096" "1 32768"; do
  set -- $shape
  PYTHONPATH=src:tests:tools timeout 150 python3 tools/gdr_launch_sweep.py --batch "$1" \
    --seq-len "$2" --only "launcher's settings" --only "bwd_pairs 4 warps" --only "bwd BVA 64" \
    --only "bwd 2 stages" --only "wy 2 stages" --only "output one block, 8 warps" 2>&1 \
    | tee -a "$OUT/gdr-sweep.log"
done
for shape in "4 4096" "1 32768"; do
  set -- $shape
  PYTHONPATH=src:tests:tools timeout 60 python3 tools/gdr_kernel_profile.py --batch "$1" \
    --seq-len "$2" 2>&1 | grep -v Warn | tee -a "$OUT/gdr-profile.log"
done
echo "done in $SECONDS s"
