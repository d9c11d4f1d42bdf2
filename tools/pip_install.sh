#!/usr/bin/env bash
# pip install with retries: tools/pip_install.sh VENV PIP-ARGS...
# A broken download is resumed 20 times and the whole install tried 3 times,
# 30 s apart: CI has seen PyPI cut a 17 MB wheel off six times in a row. Without
# the local wheels, torch comes from PyPI with its CUDA libraries (several GB):
# --no-cache-dir keeps pip from holding a second copy of them on disk.
set -euo pipefail
venv=$1
shift
resume=()  # the pip a new venv starts with (23.x) has no --resume-retries
"$venv/bin/pip" install --help | grep -- --resume-retries > /dev/null && resume=(--resume-retries 20)
for attempt in 1 2 3; do
  "$venv/bin/pip" install --quiet --no-cache-dir "${resume[@]}" "$@" && exit 0
  echo "pip install failed (attempt $attempt of 3); free disk: $(df -h --output=avail . | tail -1)"
  [ "$attempt" = 3 ] && exit 1
  sleep 30
done
