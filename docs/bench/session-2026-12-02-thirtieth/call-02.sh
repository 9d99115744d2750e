# The whole suite on one H200 (not run on a GPU since the twenty-second session), compiled where
# the tests compile, carry .bnb .ds .trl .peers. The multi-GPU cases skip on one GPU.
set -u
OUT=$OUT/suite DEADLINE_S=540 WORKERS=15 bash tools/gpu_suite_part.sh tests/
tail -n 25 $OUT/suite/suite-part.txt
echo "done in $SECONDS s"
