# Both targets set up from nothing: a .venv with torch==2.13.0 (the local CPU wheel) and the
# package with its dev extras. The stamp file re-runs the install when pyproject.toml changes.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run plan test bench lint format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The control plane on this machine. Without accelerators it declares 4 CPU slots; on a GPU
# machine run `make run UP_ARGS=` to use the detected devices.
UP_ARGS ?= --virtual-gpus 4
run: $(STAMP)
	$(BIN)/gpucloud up $(UP_ARGS)

# A capacity plan for a sample model (what `make run` printed before the control plane).
plan: $(STAMP)
	$(BIN)/gpucloud plan train --model llama-3-8b --gpu H100-SXM --gpus 8 --zero 3 \
		--precision bf16 --micro-batch 1 --seq-len 8192 --recompute full --tokens 1e10

test: $(STAMP)
	$(BIN)/ruff check gpucloud tests benchmarks
	$(BIN)/ruff format --check gpucloud tests benchmarks
	sh tests/control/install_postgres.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest

bench: $(STAMP)
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

format: $(STAMP)
	$(BIN)/ruff format gpucloud tests benchmarks
	$(BIN)/ruff check --fix gpucloud tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
