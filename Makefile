# `make demo` and `make test` are the whole quick start: each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/alpasim graph gpt3-1.3b --cluster aws-p3.16xlarge

test: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_graph_build.py

clean:
	rm -rf $(VENV) build *.egg-info
