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
	mkdir -p out
	$(BIN)/alpasim graph gpt3-2.6b --cluster aws-p3.16xlarge --nodes 1
	$(BIN)/alpasim plan --model gpt3-2.6b --cluster aws-p3.16xlarge --nodes 1 --out out/demo-plan.json
	$(BIN)/alpasim simulate out/demo-plan.json --trace out/demo-trace.json --gantt out/demo-gantt.png
	@echo "simulated timeline: out/demo-trace.json (open in https://ui.perfetto.dev), out/demo-gantt.png"
	$(BIN)/alpasim compare --model gpt3-2.6b --cluster aws-p3.16xlarge --nodes 1 --methods alpa,megatron,intra-only

# The tests that measure time or start a Ray cluster (marker `serial`) run first, alone
# on an idle machine; then the rest on two workers (pytest-xdist; a module's tests stay
# on one worker, so its fixtures are built once). Both runs share one XLA compilation cache.
TEST_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
TEST_WORKERS ?= 2

test: $(STAMP)
	@cache=$$(mktemp -d -t alpasim-xla-cache-XXXXXX); \
	JAX_COMPILATION_CACHE_DIR=$$cache $(TEST_ENV) $(BIN)/python -m pytest -q -m serial; serial=$$?; \
	JAX_COMPILATION_CACHE_DIR=$$cache $(TEST_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
		--dist loadscope -m "not serial"; parallel=$$?; \
	rm -rf $$cache; test $$serial -eq 0 && test $$parallel -eq 0

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_graph_build.py
	$(BIN)/python benchmarks/bench_intra_ilp.py
	$(BIN)/python benchmarks/bench_cross_mesh.py
	$(BIN)/python benchmarks/bench_simulator.py
	$(BIN)/python benchmarks/plan_time.py

clean:
	rm -rf $(VENV) build *.egg-info
