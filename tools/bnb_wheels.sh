#!/usr/bin/env bash
# Make the .bnb carry folder: bitsandbytes 0.50.2 (Python 3.12, x86_64) for the GPU machine,
# without the CUDA 11.8 / 12.x, ROCm and XPU libraries (43 MB -> ~7 MB: the GPU image runs
# CUDA 13, so only libbitsandbytes_cuda130 / cuda132 / cpu are kept; RECORD trimmed to match).
# The carry limit is 64 MiB for the tree and every carried folder together.
# Usage (CPU machine, project root): bash tools/bnb_wheels.sh [.bnb]
set -euo pipefail
dest=${1:-.bnb}
mkdir -p "$dest"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$tmp" bitsandbytes==0.50.2
python3 - "$tmp"/bitsandbytes-*.whl "$dest" <<'PY'
import os, re, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
keep_lib = re.compile(r"libbitsandbytes_(cpu|cuda130|cuda132)\.so$")
def dropped(name):
    return name.endswith(".so") and "libbitsandbytes_" in name and not keep_lib.search(name)
out = os.path.join(dest, os.path.basename(src))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if dropped(info.filename):
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            rows = [r for r in data.decode().splitlines() if not dropped(r.split(",")[0])]
            data = ("\n".join(rows) + "\n").encode()
        zout.writestr(info, data)
PY
rm -rf "$tmp"
du -sh "$dest"
