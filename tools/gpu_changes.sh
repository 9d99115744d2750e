#!/usr/bin/env bash
# The GPU pass of this session's GPU-untested changes, within ~8 minutes on one H100. Carry .bnb.
#   1. tests/test_quant4.py compiled (the dequant kernel's byte-per-lane rewrite) and
#      tools/bench_dequant.py against bitsandbytes' CUDA dequant;
#   2. tools/gpu_gdr_split.sh (Gated DeltaNet split3 products);
#   3. the GSA tests gpu_gsa_precision.sh does not run (the rest of the moved code), if time is left.
# Logs under $OUT.
set -u
OUT=${OUT:-/tmp/fusetune-gpu-changes}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .bnb/*.whl >/dev/null 2>&1
export PYTHONPATH=src:tests:/tmp/site PYTHONUNBUFFERED=1
echo "== 1. test_quant4 + dequant bench"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 tests/test_quant4.py 2>&1 \
  | tee "$OUT/quant4-tests.txt" | tail -4
timeout 40 python3 tools/bench_dequant.py 2>&1 | tee "$OUT/dequant-bench.txt"
echo "== 2. Gated DeltaNet modes"
OUT="$OUT" bash tools/gpu_gdr_split.sh 2>&1 | tail -40
left=$((520 - SECONDS))
echo "== 3. GSA tests ($left s left)"
((left > 40)) && timeout "$left" python3 -m pytest -q -p no:cacheprovider -rfE -n 8 \
  tests/test_gsa.py tests/test_gsa_layer.py -k "not (fp16 or varlen or long_sequences)" 2>&1 \
  | tee "$OUT/gsa-tests.txt" | tail -6
echo "done in $SECONDS s"
