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

# pip compiles each installed module to bytecode one file at a time (44 of its 85 s here);
# compileall does it on every core afterwards. Some files are written for newer Pythons
# (torch's py312_intrinsics.py) and fail to compile, as they do, silently, under pip: its exit
# status says nothing about the install.
define make_venv
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile $(TORCH)
	echo '$(TORCH)' > $(PIN)
endef
COMPILE_VENV = $(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true

$(BIN)/.installed: pyproject.toml
	$(make_venv)
	$(BIN)/pip install -q --no-compile -c $(PIN) -e '.[dev,cli]'
	$(COMPILE_VENV)
	touch $@

# the tests also cover batchpilot.integrations (Lightning, Hugging Face, Accelerate). One install of
# every extra they need, not the train set-up and then the integrations: each pip run resolves the
# whole set again and builds the editable wheel again (in a fresh build environment)
$(BIN)/.integrations: pyproject.toml
	$(make_venv)
	$(BIN)/pip install -q --no-compile -c $(PIN) -e '.[dev,cli,integrations]'
	$(COMPILE_VENV)
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
# The suite starts many Python processes (torchrun ranks, fresh-process checks), each
# importing batchpilot and the test helpers: compile them once, where PYTHONDONTWRITEBYTECODE
# would have each process compile them again (0.2 s each)
COMPILE_SOURCES = $(BIN)/python -m compileall -qq -j 0 src tests examples benchmarks

test: $(BIN)/.integrations
	$(COMPILE_SOURCES)
	$(BIN)/python -m pytest -q $(XDIST) -m "not bench" $(ARGS)

test-bench: $(BIN)/.integrations
	$(BIN)/python -m pytest -q $(XDIST) -m bench tests/test_benchmarks.py $(ARGS)

bench: venv
	$(BIN)/pip install -q -c $(PIN) -e '.[dev,cli,bench]'
	$(BIN)/python benchmarks/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
