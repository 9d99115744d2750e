# main with the kept T: GPU time per kernel at B1 beside FLA, then the bench with every peer
set -u
bash tools/install_carried.sh .peers >/dev/null 2>&1
PYTHONPATH=src:tests:tools:/tmp/site timeout 170 python3 -u tools/gdr_kernel_profile.py \
  --batch 1 --seq-len 32768 2>&1 | tee $OUT/profile-b1-t32768.log
bash tools/gpu_pending.sh gdr-bench
