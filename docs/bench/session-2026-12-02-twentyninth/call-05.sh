# the Qwen3.5 / Qwen3-Next model paths on the GPU with this session's kernels (key-block walks,
# bwd_chunk trims): the transformers integration, compiled routed layers, causal conv and the
# gated RMSNorm, -k qwen3_5 or qwen3_next
set -u
PYTHONPATH=src:tests timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 \
  tests/test_transformers.py tests/test_compile_routed_layers.py tests/test_causal_conv1d.py \
  tests/test_rms_norm.py -k "qwen3_5 or qwen3_next" 2>&1 | tee $OUT/qwen-gpu-tests.log | tail -5
echo "done in $SECONDS s"
