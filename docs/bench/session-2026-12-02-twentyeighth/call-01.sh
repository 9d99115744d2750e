# main (.main_src) against branch gdr-combo (gdr-walk-k64 + gdr-fwd-priority): sweep rows at B1
# then B4, main's row again at the end of each shape for this machine's drift
set -u
M="PYTHONPATH=.main_src/src:tests:tools"
C="PYTHONPATH=src:tests:tools"
for shape in "1 32768 90 200 50" "4 4096 60 150 40"; do
  set -- $shape
  tag="b$1"
  env $M timeout $3 python3 -u tools/gdr_launch_sweep.py --batch $1 --seq-len $2 --only "launcher's settings" 2>&1 | tee -a $OUT/main-$tag.log
  env $C timeout $4 python3 -u tools/gdr_launch_sweep.py --batch $1 --seq-len $2 \
    --only "launcher's settings" --only "walk k64" --only "walk k64 BV 64" \
    --only "walk k64, 4 warps" --only "walk k64 BV 64, 4 warps" \
    --only "forward in 4 parts" --only "forward in 8 parts" 2>&1 | tee -a $OUT/combo-$tag.log
  env $M timeout $5 python3 -u tools/gdr_launch_sweep.py --batch $1 --seq-len $2 --only "launcher's settings" 2>&1 | tee -a $OUT/main-$tag.log
done
