#!/usr/bin/env bash
# The whole suite in one call on a 2- or 4-GPU machine (nvidia-h100-x2 / h200-x2 / -x4), carry
# .bnb .ds .trl .peers. The test files split in two halves (-n 12 each), the Gated DeltaNet file
# (the longest) apart: on 4 GPUs the halves take GPUs 1 and 2, Gated DeltaNet GPU 3 and the
# 2-GPU grpo --fsdp test GPUs 0 and 1; on 2 GPUs the halves take one GPU each, Gated DeltaNet
# and the MoE file (the next longest) joining the odd half. Each part runs under DEADLINE_S
# (530). The other multi-GPU files skip here (one GPU visible to each part): run them with
# tools/gpu_distributed.sh. Logs: $OUT/<part>/suite-part.txt (one file a part: the device
# returns about 8 files a call), each part's summary printed at the end.
set -u
OUT=${OUT:-/tmp/fusetune-suite-split}
gpus=$(nvidia-smi -L | wc -l)
export DEADLINE_S=${DEADLINE_S:-530} PARTS=$((gpus >= 4 ? 3 : 2))
bash tools/install_carried.sh .bnb .ds .trl .peers
apart=tests/test_gated_delta_rule.py
[ "$gpus" -ge 4 ] || apart="$apart tests/test_moe.py"
files=$(ls tests/test_*.py | grep -v -F "$(echo "$apart" | tr ' ' '\n')")
part_a=$(echo "$files" | awk 'NR % 2 == 1')
part_b=$(echo "$files" | awk 'NR % 2 == 0')
run() {  # run NAME GPUS ARGS...
  local name=$1 gpus=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$gpus OUT="$OUT/$name" bash tools/gpu_suite_part.sh "$@" >"/tmp/$name.log" 2>&1
}
mkdir -p "$OUT"
if [ "$gpus" -ge 4 ]; then
  names="a b gdn grpo-fsdp"
  # shellcheck disable=SC2086
  run a 1 $part_a &
  # shellcheck disable=SC2086
  run b 2 $part_b &
  run gdn 3 $apart &
  WORKERS=0 run grpo-fsdp 0,1 tests/test_grpo_distributed.py -k fsdp_two_gpus &
else
  names="a b"
  # shellcheck disable=SC2086
  run a 0 $part_a $apart &
  # shellcheck disable=SC2086
  run b 1 $part_b &
fi
wait
for name in $names; do echo "=== $name"; tail -40 "/tmp/$name.log"; done
echo "done in $SECONDS s"
