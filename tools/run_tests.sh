#!/usr/bin/env bash
# The test command behind `make test` (and CI): unit and script tests, nbval
# over every notebook, then the book build with warnings as errors. It prints
# how long each part took.
set -u
cd "$(dirname "$0")/.."
BIN=.venv/bin
status=0
start=$SECONDS

step() {
  local name=$1 t=$SECONDS
  shift
  echo "==> $name"
  "$@" || status=1
  echo "<== $name: $((SECONDS - t)) s"
}

# Heavy multi-process tests (marked slow) run in `make test-slow`; CI runs both.
# The unit and script tests run two at a time (pytest-xdist), a file at a time
# per worker, so that a module's costly fixture starts its processes once. The
# notebooks run alone afterwards, because their verdicts time code on an idle
# machine.
step "unit and script tests (pytest, 2 at a time)" \
  $BIN/pytest tests -m "not slow" -n 2 --dist loadfile --durations=10
step "notebooks (nbval, one at a time)" \
  $BIN/pytest notebooks --nbval --nbval-current-env \
  --nbval-sanitize-with tests/nbval_sanitize.cfg --durations=10
step "book build (-W -n --keep-going)" \
  $BIN/jupyter-book build . -W -n --keep-going

# The built book in headless Chromium (tools/browser_check.py). Without Chromium
# say so in one line; CI (CI=1) installs it, and there its absence is a failure.
if $BIN/python -c "import sys; sys.path.insert(0, 'tools'); import browser_check as b; sys.exit(not b.chromium_paths())"; then
  step "browser check (headless Chromium)" $BIN/python tools/browser_check.py --no-screenshots
elif [ -n "${CI:-}" ]; then
  echo "CI: Chromium and chromedriver are missing, so the browser check cannot run"
  status=1
else
  $BIN/python -c "import sys; sys.path.insert(0, 'tools'); import browser_check as b; print(b.INSTALL_HINT)"
fi
echo "Total test time: $((SECONDS - start)) s"
exit $status
