# Two entry points, each doing its own set-up on a machine with nothing but Python:
#   make train   the main job: batchpilot train on the bundled digits data
#   make test    the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; a bare `torch` requirement would pull the multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# Every later install is constrained to that torch: lightning, transformers and accelerate accept
# it, and must not replace it with another (CUDA) build.
PIN    := $(VENV)/torch-constraint.txt

.PHONY: venv train test test-bench bench clean

# Python caches the bytecode of every module a process imports, in this venv and in the sources,
# for the next process: PYTHONDONTWRITEBYTECODE (set on this machine) would have each of the
# suite's many processes (torchrun ranks, fresh-process checks) compile them again. pip's own
# compile of every installed file, one at a time, took 44 of its 85 s here; most are never imported.
unexport PYTHONDONTWRITEBYTECODE

define make_venv
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile $(TORCH)
	echo '$(TORCH)' > $(PIN)
endef

$(BIN)/.installed: pyproject.toml
	$(make_venv)
	$(BIN)/pip install -q --no-compile -c $(PIN) -e '.[dev,cli]'
	touch $@

# the tests also cover batchpilot.integrations (Lightning, Hugging Face, Accelerate). One install of
# every extra they need, not the train set-up and then the integrations: each pip run resolves the
# whole set again and builds the editable wheel again (in a fresh build environment)
$(BIN)/.integrations: pyproject.toml
	$(make_venv)
	$(BIN)/pip install -q --no-compile -c $(PIN) -e '.[dev,cli,integrations]'
	touch $(BIN)/.installed $@

venv: $(BIN)/.installed

train: venv
	$(BIN)/batchpilot train $(ARGS)

# pytest-xdist, one worker per core. --dist loadfile keeps each test file on one worker, so a
# module-scoped fixture (one torchrun launch for a file's tests) runs once. JOBS=0: one process.
JOBS ?= auto
XDIST = -n $(JOBS) --dist loadfile
# the benchmarks' own smoke runs (marker bench, minutes in all) run behind their own target; the
# peers benchmark's quick runs stay in make test as the smoke run CI keeps
test: $(BIN)/.integrations
	$(BIN)/python -m pytest -q $(XDIST) -m "not bench" $(ARGS)

test-bench: $(BIN)/.integrations
	$(BIN)/python -m pytest -q $(XDIST) -m bench tests/test_benchmarks.py $(ARGS)

bench: venv
	$(BIN)/pip install -q -c $(PIN) -e '.[dev,cli,bench]'
	$(BIN)/python benchmarks/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
