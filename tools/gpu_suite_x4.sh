#!/usr/bin/env bash
# The whole suite in one call on a 4-GPU machine (nvidia-h100-x4 / h200-x4), carry .bnb .ds .trl
# .peers: the test files split over GPUs 1 and 2 (-n 12 each), the Gated DeltaNet file (the
# longest) on GPU 3, and the 2-GPU grpo --fsdp test on GPUs 0 and 1; each part under
# DEADLINE_S (530). The other multi-GPU files skip here (one GPU visible to each part): run
# them with tools/gpu_distributed.sh. Logs: $OUT/<part>/suite-part.txt (one file a part: the
# device returns about 8 files a call), each part's summary printed at the end.
set -u
OUT=${OUT:-/tmp/fusetune-suite-x4}
export DEADLINE_S=${DEADLINE_S:-530} PARTS=3
bash tools/install_carried.sh .bnb .ds .trl .peers
files=$(ls tests/test_*.py | grep -v test_gated_delta_rule.py)
part_a=$(echo "$files" | awk 'NR % 2 == 1')
part_b=$(echo "$files" | awk 'NR % 2 == 0')
run() {  # run NAME GPUS ARGS...
  local name=$1 gpus=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$gpus OUT="$OUT/$name" bash tools/gpu_suite_part.sh "$@" >"/tmp/$name.log" 2>&1
}
mkdir -p "$OUT"
# shellcheck disable=SC2086
run a 1 $part_a &
# shellcheck disable=SC2086
run b 2 $part_b &
run gdn 3 tests/test_gated_delta_rule.py &
WORKERS=0 run grpo-fsdp 0,1 tests/test_grpo_distributed.py -k fsdp_two_gpus &
wait
for name in a b gdn grpo-fsdp; do echo "=== $name"; tail -40 "/tmp/$name.log"; done
echo "done in $SECONDS s"
