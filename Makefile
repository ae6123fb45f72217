# Two commands for users: `make serve` and `make test`. Both create .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU wheel that lies on this kind of machine; installing it first keeps pip from resolving
# `torch` to a multi-GB CUDA build (see docs/dependencies.md).
TORCH := torch==2.13.0
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: setup serve test lint bench clean demo-model

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing into $(VENV) (log: $(VENV)/install.log) ..."
	@$(PIP) install -q --progress-bar off $(TORCH) > $(VENV)/install.log 2>&1 || { tail -n 30 $(VENV)/install.log; exit 1; }
	@$(PIP) install -q --progress-bar off -e '.[test]' >> $(VENV)/install.log 2>&1 || { tail -n 30 $(VENV)/install.log; exit 1; }
	@touch $@
	@echo "Installed."

serve: setup
	$(BIN)/dcut serve

lint: setup
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python benchmarks/decision_time.py --out runs/bench
	$(BIN)/python benchmarks/ep_step.py --out runs/bench

# Rebuild the bundled demo model from scratch (about 2 hours on 2 cores; see docs/model.md).
demo-model: setup
	$(BIN)/python -m actors.demo.tokenizer --out models/demo/tokenizer.json
	OMP_NUM_THREADS=2 $(BIN)/python -m actors.demo.train_target --steps 1800 --threads 2 --out models/demo/target
	OMP_NUM_THREADS=2 $(BIN)/python -m actors.demo.train_drafter --threads 2 --out models/demo/drafter
	$(BIN)/python -m actors.demo.evaluate --out runs/demo/eval.json
	cd models/demo && sha256sum tokenizer.json target/* drafter/* > SHA256SUMS

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
