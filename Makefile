# Both targets set up from nothing: a .venv with exactly the versions in requirements.lock
# (every dependency, direct and transitive, with hashes; torch is the local CPU wheel
# 2.13.0+cpu) and the package itself, editable. The stamp re-runs the install when the lock
# or pyproject.toml changes. `make lock` re-resolves the lock from pyproject.toml; to move
# one library: `make lock LOCK_ARGS="--upgrade-package httpx"`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements.lock
LOCK_ARGS ?=

.PHONY: run plan test bench lint format clean lock kernels

$(STAMP): $(LOCK) pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $(STAMP)

# Needs only pip-compile, not an install of the old lock (which may not satisfy a changed
# pyproject.toml). The project itself is dropped from the lock: dev's "gpucloud[ml]" names
# it, and it is installed editable above.
lock:
	test -x $(BIN)/pip-compile || { test -x $(BIN)/python || $(PY) -m venv $(VENV); \
		$(BIN)/pip install -q pip-tools; }
	$(BIN)/pip-compile -q --extra dev --extra ml --generate-hashes --strip-extras \
		--allow-unsafe --no-emit-index-url --no-emit-find-links $(LOCK_ARGS) \
		-o $(LOCK) pyproject.toml
	sed -i -e '/^# WARNING: pip install will require/,/^    # via gpucloud (pyproject.toml)$$/d' $(LOCK)

# The control plane on this machine. Without accelerators it declares 4 CPU slots; on a GPU
# machine run `make run UP_ARGS=` to use the detected devices.
UP_ARGS ?= --virtual-gpus 4
run: $(STAMP)
	$(BIN)/gpucloud up $(UP_ARGS)

# A capacity plan for a sample model (what `make run` printed before the control plane).
plan: $(STAMP)
	$(BIN)/gpucloud plan train --model llama-3-8b --gpu H100-SXM --gpus 8 --zero 3 \
		--precision bf16 --micro-batch 1 --seq-len 8192 --recompute full --tokens 1e10

# The cpu backend's C++ kernels (gpucloud.serve.cpu_kernels), built once before the tests:
# otherwise every pytest worker meets the build while collecting, and waits on it. Once
# built, this only loads the cached build. Without a compiler the reference ops serve.
kernels: $(STAMP)
	MAX_JOBS=2 $(BIN)/python -m gpucloud.serve.cpu_kernels || echo "cpu kernels not built"

# Test files run in parallel on TEST_WORKERS processes (a file's tests stay on one worker).
TEST_WORKERS ?= 2
test: $(STAMP) kernels
	$(BIN)/ruff check gpucloud tests benchmarks
	$(BIN)/ruff format --check gpucloud tests benchmarks
	sh tests/install_system_packages.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --durations=15

bench: $(STAMP)
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

format: $(STAMP)
	$(BIN)/ruff format gpucloud tests benchmarks
	$(BIN)/ruff check --fix gpucloud tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
