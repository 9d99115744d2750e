#!/usr/bin/env bash
# Part of the test suite on the GPU, verbose (one line per test, so a cut-off run still names
# every result), under a hard deadline: pytest runs in the background writing to a file, and is
# killed with its xdist workers at the deadline (a worker stuck in CUDA kept `timeout | tee` open
# for the whole call once). Usage: DEADLINE_S=280 bash tools/gpu_suite_part.sh tests/test_x.py ...
set -u
OUT=${OUT:-/tmp/fusetune-gpu-suite}
mkdir -p "$OUT"
bash tools/install_carried.sh .bnb .ds .trl .peers >"$OUT/pip.txt" 2>&1
export PYTHONPATH=${SRC:-src}:tests:/tmp/site PYTHONUNBUFFERED=1  # SRC: another source tree
log="$OUT/suite-part.txt"
setsid python3 -m pytest -v -n "${WORKERS:-12}" -p no:cacheprovider -rfE -o faulthandler_timeout=150 \
  "$@" >"$log" 2>&1 &
pid=$!
deadline=$((SECONDS + ${DEADLINE_S:-280}))
while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 2; done
if kill -0 "$pid" 2>/dev/null; then
  kill -9 -- -"$pid" 2>/dev/null
  echo "=== deadline: killed at $SECONDS s; collected but without a result:" | tee -a "$log"
  timeout 60 python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null \
    | grep "::" | sort >"$OUT/collected.txt"
  grep -oE "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) tests/[^ ]+" "$log" | awk '{print $2}' \
    | sort >"$OUT/finished.txt"
  comm -23 "$OUT/collected.txt" "$OUT/finished.txt" | tee "$OUT/unfinished.txt" | head -60
fi
grep -oE "^\[gw[0-9]+\] \[ *[0-9]+%\] [A-Z]+" "$log" | awk '{print $NF}' | sort | uniq -c
grep -E "^\[gw[0-9]+\] .*(FAILED|ERROR)" "$log" | head -40
grep -E "^(FAILED|ERROR) " "$log" | tail -40
echo "done in $SECONDS s"
