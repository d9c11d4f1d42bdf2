#!/usr/bin/env bash
# The test command behind `make test` (and CI): the linter, unit and script
# tests, nbval over every notebook, the book build with warnings as errors and
# its browser check. It prints how long each part took.
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

# The book build and the browser check (headless Chromium, tools/browser_check.py).
# Without Chromium say so in one line; CI (CI=1) installs it, and there its
# absence is a failure.
book() {
  step "book build (-W -n --keep-going)" $BIN/jupyter-book build . -W -n --keep-going
  if $BIN/python -c "import sys; sys.path.insert(0, 'tools'); import browser_check as b; sys.exit(not b.chromium_paths())"; then
    step "browser check (headless Chromium)" $BIN/python tools/browser_check.py --no-screenshots
  elif [ -n "${CI:-}" ]; then
    echo "CI: Chromium and chromedriver are missing, so the browser check cannot run"
    status=1
  else
    $BIN/python -c "import sys; sys.path.insert(0, 'tools'); import browser_check as b; print(b.INSTALL_HINT)"
  fi
  return $status
}

# The book needs nothing the tests make, and the unit tests, which wait for the
# processes they start, keep 1.3 of the 2 cores busy on average (measured):
# build and check the book beside them, its output printed once they are done. Heavy multi-process tests
# (marked slow) run in `make test-slow`; CI runs both. The unit and script
# tests run two at a time (pytest-xdist), a file at a time per worker, so that
# a module's costly fixture starts its processes once.
lint() { $BIN/ruff check --quiet . && $BIN/ruff format --check --quiet .; }
step "lint (ruff check: pyproject.toml's rules; ruff format --check, notebooks too)" lint
book_log=$(mktemp)
set -m  # the book's job in a process group of its own, to stop on an interrupt
book > "$book_log" 2>&1 &
book_pid=$!
set +m
stop_book() { kill -- -"$book_pid" 2>/dev/null; rm -f "$book_log"; exit "$1"; }
trap 'stop_book 130' INT
trap 'stop_book 143' TERM
step "unit and script tests (pytest, 2 at a time; the book built beside them)" \
  $BIN/pytest tests -m "not slow" -n 2 --dist loadfile --durations=10
wait $book_pid || status=1
trap - INT TERM
cat "$book_log"
rm -f "$book_log"
# The notebooks run alone, last, because their verdicts time code on an idle
# machine.
step "notebooks (nbval, one at a time)" \
  $BIN/pytest notebooks --nbval --nbval-current-env \
  --nbval-sanitize-with tests/nbval_sanitize.cfg --durations=10
echo "Total test time: $((SECONDS - start)) s"
exit $status
