# (1) fusetune against FLA alone, three more runs in alternating order, for the run-to-run spread
# (call 2's extra rounds named "fla", which its labelled row did not match; fixed in 170d5e9);
# then the bf16 opt-in (FUSETUNE_GDR_DOT=bf16 FUSETUNE_GDR_W=d) beside FLA, last measured in the
# twenty-third session; (2) the sweep rows not yet timed on the key-block walks, bwd_pairs at 3 stages, per kernel at
# both shapes (the thirtieth's next-call.sh `rows`). carry .peers.
set -u
mkdir -p $OUT/logs
bash tools/install_carried.sh .peers >/dev/null 2>&1
for order in fusetune,fla fla,fusetune fusetune,fla; do
  PYTHONPATH=src:/tmp/site timeout 100 python3 -m fusetune bench gated_delta_rule \
    --providers $order --out /tmp/gdr-$order 2>&1 | grep -v "\.\.\.$" | tee -a $OUT/logs/rounds.log
done
FUSETUNE_GDR_DOT=bf16 FUSETUNE_GDR_W=d PYTHONPATH=src:/tmp/site timeout 100 python3 -m fusetune \
  bench gated_delta_rule --providers fusetune,fla --out /tmp/gdr-optin 2>&1 | grep -v "\.\.\.$" \
  | sed "s/fusetune /fusetune-bf16-optin /" | tee -a $OUT/logs/rounds.log
echo "rounds done at $SECONDS s"
for shape in "4 4096 100" "1 32768 130"; do
  set -- $shape
  PYTHONPATH=src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py --batch $1 \
    --seq-len $2 --profile --only "launcher's settings" --only "bwd_pairs 3 stages" \
    --only "states / dstates 3 stages" --only "states / dstates 1 stage" \
    --only "key-block walks, 8 warps" 2>&1 | grep -v "Warning\|warn" | tee -a $OUT/logs/rows.log
done
echo "done in $SECONDS s"
