#!/usr/bin/env bash
# Make the carry folder for Unsloth on the GPU machine (Python 3.12, manylinux x86_64, no
# registry there): unsloth 2026.10.9 without its web UI and CLI (studio/, unsloth_cli/: 82 MB
# unpacked, never imported by training), unsloth_zoo, and what `import unsloth` +
# FastLanguageModel.from_pretrained + get_peft_model import that the GPU image may lack
# (tools/carried_wheels.py installs only those it lacks). Left out, optional at import (read
# from the code): xformers (SDPA then), vllm, diffusers, torchvision, torchao, cut_cross_entropy
# (off for torch >= 2.8 in unsloth_zoo), tyro, sentencepiece, msgspec, hf_transfer.
# trl <= 1.15 and datasets < 5 are unsloth's metadata bounds.
# Usage (CPU machine, project root): bash tools/unsloth_wheels.sh [.unsloth]
# Also needs .bnb for 4-bit: mkdir -p .bnb && pip download --no-deps bitsandbytes==0.50.2 -d .bnb
set -euo pipefail
dest=${1:-.unsloth}
mkdir -p "$dest"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp" unsloth==2026.10.9
python3 -m pip download -q --no-deps "${platform[@]}" -d "$dest" unsloth_zoo==2026.10.9 \
  trl==1.15.0 datasets==4.3.0 "dill<0.4.1" "multiprocess<0.70.17" accelerate
python3 -m pip download -q "${platform[@]}" -d "$dest" pydantic rich requests pillow psutil
python3 - "$tmp"/unsloth-2026.10.9-py3-none-any.whl "$dest"/unsloth-2026.10.9-py3-none-any.whl <<'PY'
import sys, zipfile
drop = ("studio/", "unsloth_cli/")
with zipfile.ZipFile(sys.argv[1]) as zin, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        name = info.filename
        if name.startswith(drop) or name.endswith("entry_points.txt"):  # scripts name unsloth_cli
            continue
        data = zin.read(name)
        if name.endswith(".dist-info/RECORD"):
            keep = [l for l in data.decode().splitlines() if not l.startswith(drop) and "entry_points" not in l]
            data = ("\n".join(keep) + "\n").encode()
        zout.writestr(info, data)
PY
rm -rf "$tmp"
ls -la "$dest"
du -sh "$dest"
