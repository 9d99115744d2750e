#!/usr/bin/env bash
# Installs the carried wheel folders named (.bnb .ds .trl .peers ...) into /tmp/site on the GPU
# machine, each folder once per machine (a marker per folder), so that scripts run side by side
# or one after another on a warm machine do not reinstall over each other.
# Usage: bash tools/install_carried.sh .ds .trl .peers   (then PYTHONPATH=...:/tmp/site)
set -u
for folder in "$@"; do
  marker="/tmp/site/.carried-${folder#.}"
  wheels=$(ls "$folder"/*.whl 2>/dev/null)
  [ -z "$wheels" ] || [ -e "$marker" ] && continue
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $wheels && touch "$marker"
done
