# Sourced by the GPU scripts that run Unsloth (gpu_unsloth.sh, gpu_e2e_shapes.sh), with OUT set:
# installs the carried .unsloth / .bnb wheels the machine lacks (tools/carried_wheels.py) under
# /tmp/site and sets the environment.
wheels=$(python3 tools/carried_wheels.py .unsloth .bnb 2>"$OUT/install.log")
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $wheels 2>&1 | tee -a "$OUT/install.log"
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# No network on the GPU machine: Unsloth's usage statistics (a Hub download at load), the Hub,
# telemetry off; Unsloth's generated modules under /tmp instead of ./unsloth_compiled_cache.
export UNSLOTH_DISABLE_STATISTICS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1 UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache
