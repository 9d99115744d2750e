#!/usr/bin/env bash
# Part of the test suite on the GPU, verbose (one line per test, so a cut-off run still names
# every result), under a hard deadline: pytest runs in the background writing to a file, and is
# killed with its xdist workers at the deadline (a worker stuck in CUDA kept `timeout | tee` open
# for the whole call once). Usage: DEADLINE_S=280 bash tools/gpu_suite_part.sh tests/test_x.py ...
set -u
OUT=${OUT:-/tmp/fusetune-gpu-suite}
mkdir -p "$OUT"
scratch=$(mktemp -d)  # lists and pip's output: $OUT keeps one file (the device returns few)
bash tools/install_carried.sh .bnb .ds .trl .peers >"$scratch/pip.txt" 2>&1
export PYTHONPATH=${SRC:-src}:tests:/tmp/site PYTHONUNBUFFERED=1  # SRC: another source tree
# CPU threads per worker: the float64 references run on the CPU, and torch's default (every
# core in each of 12+ workers, PARTS parts side by side) oversubscribed the 64-core 4-GPU host
# until MoE and Gated DeltaNet cases ran past the deadline.
workers=${WORKERS:-12}
threads=$(($(nproc) / ((workers > 0 ? workers : 1) * ${PARTS:-1})))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
export LC_ALL=C  # one sort order for the collected and finished lists
log="$OUT/suite-part.txt"
setsid python3 -m pytest -v -n "$workers" -p no:cacheprovider -rfE -o faulthandler_timeout=150 \
  "$@" >"$log" 2>&1 &
pid=$!
deadline=$((SECONDS + ${DEADLINE_S:-280}))
while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 2; done
if kill -0 "$pid" 2>/dev/null; then
  kill -9 -- -"$pid" 2>/dev/null
  echo "=== deadline: killed at $SECONDS s; collected but without a result:" | tee -a "$log"
  timeout 60 python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null \
    | grep "::" | sort >"$scratch/collected.txt"
  # node ids hold spaces (parametrize ids): everything after the outcome, less the trailing blank
  sed -nE 's/.*(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests\/.*[^ ]) *$/\2/p' "$log" \
    | sort >"$scratch/finished.txt"
  comm -23 "$scratch/collected.txt" "$scratch/finished.txt" >"$scratch/unfinished.txt"
  cat "$scratch/unfinished.txt" >>"$log"
  head -100 "$scratch/unfinished.txt"
  echo "($(wc -l <"$scratch/unfinished.txt") without a result, listed at the end of $log)"
fi
grep -oE "^\[gw[0-9]+\] \[ *[0-9]+%\] [A-Z]+" "$log" | awk '{print $NF}' | sort | uniq -c
grep -E "^\[gw[0-9]+\] .*(FAILED|ERROR)" "$log" | head -40
grep -E "^(FAILED|ERROR) " "$log" | tail -40
echo "done in $SECONDS s"
