# Two entry points, each doing its own set-up on a machine with nothing but Python:
#   make train   the main job: batchpilot train on the bundled digits data
#   make test    the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; a bare `torch` requirement would pull the multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: venv train test bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,cli]'
	touch $@

venv: $(BIN)/.installed

train: venv
	$(BIN)/batchpilot train $(ARGS)

test: venv
	$(BIN)/python -m pytest -q $(ARGS)

bench: venv
	$(BIN)/pip install -q -e '.[dev,cli,bench]'
	$(BIN)/python benchmarks/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
