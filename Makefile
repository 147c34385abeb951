# `make demo` and `make test` are the whole quick start: each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip's user agent runs `rustc --version` (ensurepip in `venv` too); where rustc is a
# rustup proxy and there is no rustup home (a fresh home directory), the proxy makes
# ~/.rustup. Such a proxy has no toolchain to run anyway, so it is pointed into the
# venv and the home stays untouched.
NO_HOME := $(if $(RUSTUP_HOME)$(wildcard $(HOME)/.rustup),,RUSTUP_HOME=$(CURDIR)/$(VENV)/.rustup)
PIP := $(NO_HOME) $(BIN)/python -m pip

.PHONY: demo test test-fast setup clean bench

setup: $(STAMP)

# pip byte-compiles what it installs, but not an editable install's own sources; where
# PYTHONDONTWRITEBYTECODE is set (this machine, many CIs) nothing ever writes them, and
# every process (a test worker, a Ray actor, a command) compiles alpasim from source:
# 0.2-0.4 s of each one's 2 s import here. An edited module is recompiled as usual.
# The packages are installed by uv (itself a wheel, fetched by pip): it resolves, fetches
# and unpacks in parallel and byte-compiles on every core, 31 s against pip's 61 s for the
# same packages on the 2-core machine; its cache lives in the venv, never in the home.
# uv does not read pip's settings, so where pip is pointed at an index of its own
# (PIP_INDEX_URL, or index-url in pip's configuration: a mirror, maybe the only index
# reachable) pip installs everything, as it does where uv cannot be had or fails.
UV := UV_CACHE_DIR=$(CURDIR)/$(VENV)/.uv-cache UV_PYTHON_DOWNLOADS=never $(BIN)/uv
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(NO_HOME) $(PYTHON) -m venv $(VENV)
	if [ -z "$${PIP_INDEX_URL}$$($(PIP) config get global.index-url 2>/dev/null)" ] && \
	   $(PIP) install --quiet uv && \
	   $(UV) pip install --quiet --python $(BIN)/python --compile-bytecode -e '.[test]'; then :; else \
	   $(PIP) install --quiet --upgrade pip && $(PIP) install --quiet -e '.[test]'; fi
	$(BIN)/python -m compileall -q alpasim
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p out
	$(BIN)/alpasim graph gpt3-2.6b --cluster aws-p3.16xlarge --nodes 1
	$(BIN)/alpasim plan --model gpt3-2.6b --cluster aws-p3.16xlarge --nodes 1 --out out/demo-plan.json
	$(BIN)/alpasim simulate out/demo-plan.json --trace out/demo-trace.json --gantt out/demo-gantt.png
	@echo "simulated timeline: out/demo-trace.json (open in https://ui.perfetto.dev), out/demo-gantt.png"
	$(BIN)/alpasim compare --model gpt3-2.6b --cluster aws-p3.16xlarge --nodes 1 --methods alpa,megatron,intra-only

# The tests that measure time (marker `serial`) run first, alone on an idle machine;
# then the rest on two workers (pytest-xdist; a module's tests stay on one worker, so its
# fixtures are built once, and the tests that start a Ray cluster, marker `ray`, all go
# to one worker, one after the other: tests/conftest.py's scheduler). Both runs share
# one session root (tests/conftest.py: the stage cache, the XLA compilation cache, HOME
# and TMPDIR), made empty here and removed after, even when interrupted, so every run is
# a fresh machine's and touches nothing of the user's; tests/conftest.py also sets XLA's
# flags (8 virtual CPU devices).
# The parallel lane compiles at LLVM's optimisation level 0, with XLA:CPU's legacy
# fusion emitters (LLVM IR written directly, not through MLIR's pass pipelines): its
# tests' programs are tiny, so compiling them is most of their cost, and the two
# together take a third of the users' time (a 3-stage Wide-ResNet plan's programs:
# 3.8 s of compiling, against 7.4 s at O0 alone and 11.6 s at the users' level).
# Neither changes the sharding or the collectives the tests check: O0 changes only
# machine code; the legacy emitters fuse a little differently (a small GPT stage's
# backward: 84 fusions, not 97; its temporaries 80 bytes apart), and the lane's
# numerics hold under them (they exposed one fault of ours, since fixed:
# `_lowering._max_pool_grad`). Nothing there is timed. What users compile is checked
# too: the serial lane compiles at their level, and two `alpasim run` numerics tests
# of the parallel lane (a GPT, a Wide-ResNet: tests/backends/test_run_cli.py) run with
# XLA's defaults. An XLA that no longer knows the emitter flag (it aborts on unknown
# flags) runs the lane without it.
TEST_WORKERS ?= 2
FAST_XLA := fast=--xla_backend_optimization_level=0; \
	if XLA_FLAGS="$$fast --xla_cpu_use_fusion_emitters=false" JAX_PLATFORMS=cpu \
	   $(BIN)/python -c 'import jax; jax.devices()' >/dev/null 2>&1; then \
	fast="$$fast --xla_cpu_use_fusion_emitters=false"; fi; \
	echo "make: the parallel lane compiles with XLA_FLAGS=$$fast"
# The tests run on jemalloc, the allocator Ray ships for its own processes (its wheel's
# ray/core/libjemalloc.so): XLA's compiler (MLIR, LLVM) allocates and frees millions of
# small objects, and glibc's malloc and free were 10 % of the parallel lane's CPU time
# (perf). Preloaded, the lane took 242 s (472 busy CPU-s) against 252 s on the 2-core
# machine. Nothing a test checks reads the allocator (XLA's memory figures come from
# its buffer assignment); the suite runs as it did where that file is missing, and, as
# Ray does, a preload the caller set (a sanitizer's runtime, another allocator) is left
# alone. `alpasim` itself runs on what it is given: docs/running.md shows how to give
# it jemalloc. (Looked up by the shell when a recipe runs: make's own file lookups may
# predate the venv.)
JEMALLOC := if [ -z "$${LD_PRELOAD-}" ]; then \
	for je in $(CURDIR)/$(VENV)/lib/python3*/site-packages/ray/core/libjemalloc.so; do \
	if [ -f "$$je" ]; then export LD_PRELOAD="$$je"; break; fi; done; fi
PYTEST := $(BIN)/python -m pytest -q

# pytest keeps each test module's assert-rewritten code as a pyc beside it, unless
# bytecode writing is off (PYTHONDONTWRITEBYTECODE: this machine, many CIs); then every
# pytest process rewrites all of them again, 3-4 s of each one's collection here. So the
# serial lane may write bytecode (tests/**/__pycache__, removed after the run), and the
# parallel lane's workers read it. Its commands and Ray workers may then also write the
# pyc of a source edited since setup (alpasim/**/__pycache__, as Python does by default).
test: $(STAMP)
	@$(JEMALLOC); $(FAST_XLA); root=$$(mktemp -d -t alpasim-test-XXXXXX); \
	trap 'rm -rf "$$root"; find tests -name __pycache__ -type d -prune -exec rm -rf {} +' EXIT; \
	ALPASIM_TEST_ROOT=$$root PYTHONDONTWRITEBYTECODE= $(PYTEST) -m serial; serial=$$?; \
	ALPASIM_TEST_ROOT=$$root XLA_FLAGS="$$fast" $(PYTEST) -n $(TEST_WORKERS) --dist loadscope -m "not serial"; \
		parallel=$$?; \
	test $$serial -eq 0 && test $$parallel -eq 0

# The edit loop: everything but the tests marked `slow` (long JAX compiles, long plans),
# `ray` (Ray clusters) or `serial` (timings), on two workers; under three minutes.
test-fast: $(STAMP)
	@$(JEMALLOC); $(FAST_XLA); root=$$(mktemp -d -t alpasim-test-XXXXXX); trap 'rm -rf "$$root"' EXIT; \
	ALPASIM_TEST_ROOT=$$root XLA_FLAGS="$$fast" $(PYTEST) -n $(TEST_WORKERS) --dist loadscope -m "not serial and not ray and not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_graph_build.py
	$(BIN)/python benchmarks/bench_intra_ilp.py
	$(BIN)/python benchmarks/bench_cross_mesh.py
	$(BIN)/python benchmarks/bench_simulator.py
	$(BIN)/python benchmarks/plan_time.py
	$(BIN)/python benchmarks/bench_validate.py

clean:
	rm -rf $(VENV) build *.egg-info
