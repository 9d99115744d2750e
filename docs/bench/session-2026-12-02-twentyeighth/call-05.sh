# branch gdr-walk-k64b: per kernel, the launcher's walks against the k64 walks at 4 warps with
# 64-wide zero-padded value tiles (k64) and unpadded 32-wide ones (k64 narrow), B1 then B4
set -u
for shape in "1 32768 120" "4 4096 90"; do
  set -- $shape
  PYTHONPATH=src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py --batch $1 \
    --seq-len $2 --profile --only "launcher's settings" --only "walk k64, 4 warps" \
    --only "walk k64 narrow, 4 warps" 2>&1 | tee -a $OUT/walk-profile-b$1.log
done
echo "done in $SECONDS s"
