#!/usr/bin/env bash
# Build the carry folders for tools/gpu_distributed.sh (the GPU machine has no registry and none
# of these installed). Run on the CPU machine from the project root, with torch in $PYTHON's
# environment (DeepSpeed's setup.py imports it):
#   bash tools/distributed_wheels.sh      # writes .ds/ .peers/ .trl/ (git-ignored, ~25 MiB)
# .ds:    DeepSpeed 0.19.8 as a pure-Python wheel (DS_BUILD_OPS=0: no CUDA op is built; the
#         tests and the bench use "torch_adam": true) and its import-time needs for Python 3.12.
# .peers: Liger-Kernel and the other peers (../shared/tools/peer_wheels.sh).
# .trl:   TRL and the datasets pieces the GPU image lacks (pyarrow, pandas are there).
set -euo pipefail
PYTHON=${PYTHON:-/work/venv/bin/python}
get() {  # get DEST ARGS...: Python 3.12 x86_64 wheels, binary only
  local dest=$1
  shift
  "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$@"
}
mkdir -p .ds .trl
rm -f .ds/deepspeed-*.whl
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .ds
# pydantic with its resolved pieces (pydantic-core is pinned by pydantic), the rest on its own
get .ds pydantic
get .ds --no-deps hjson msgpack ninja py-cpuinfo psutil einops
get .trl --no-deps trl==1.16.0 datasets==4.3.0 dill==0.4.0 multiprocess==0.70.16 xxhash
bash ../shared/tools/peer_wheels.sh .peers
du -sh .ds .peers .trl
du -shc .ds .peers .trl | tail -1
