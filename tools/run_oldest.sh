#!/usr/bin/env bash
# `make test-oldest`: the oldest torch the course supports, in .venv-oldest.
# The unit and script tests run there as in `make test`; then every chapter is
# executed there and its verdicts compared with the stored ones (nbval would
# compare every printed line, and a few differ by design between versions:
# deprecation warnings, for one). tests/verdict_parity.toml names each
# verdict that differs, and why.
set -u
cd "$(dirname "$0")/.."
start=$SECONDS
status=0
echo "==> unit and script tests under $(.venv-oldest/bin/python -c 'import torch; print("torch", torch.__version__)')"
.venv-oldest/bin/pytest tests -m "not slow" -n 2 --dist loadfile -q -p no:cacheprovider || status=1
echo "==> every chapter under the oldest torch, verdicts compared"
.venv/bin/python tools/verdict_parity.py --python .venv-oldest/bin/python \
  --table _build/verdict_parity_oldest.md || status=1
echo "Oldest-torch pass: $((SECONDS - start)) s"
exit $status
