# bench gated_delta_rule with every peer in one run (main with norms-for-pairs merged; bwd_chunk at
# 3 stages), then fusetune against FLA alone twice more for the run-to-run spread. carry .peers.
set -u
bash tools/gpu_pending.sh gdr-bench
for round in 2 3; do
  PYTHONPATH=src:/tmp/site timeout 100 python3 -m fusetune bench gated_delta_rule \
    --providers fusetune,fla --out "$OUT/gdr-$round" 2>&1 | tee "$OUT/gdr-bench-$round.log"
done
echo "all done in $SECONDS s"
