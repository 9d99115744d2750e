# branch gdr-walk-k64b (gdr-walk-k64 on main with the kept T): per kernel, the launcher's walks
# against FLA-shaped walks at 4 warps, B1 then B4
set -u
for shape in "1 32768 130" "4 4096 100"; do
  set -- $shape
  PYTHONPATH=src:tests:tools timeout $3 python3 -u tools/gdr_launch_sweep.py --batch $1 \
    --seq-len $2 --profile --only "launcher's settings" --only "walk k64, 4 warps" 2>&1 \
    | tee -a $OUT/walk-profile-b$1.log
done
echo "done in $SECONDS s"
