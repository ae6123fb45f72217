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

.PHONY: setup serve test lint bench bench-full clean demo-model interop chaos

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

# The clients users bring (lm-eval, guidellm, aiperf, schemathesis), each from its own venv under
# .interop/, unchanged against `dcut serve`; the table of docs/interop.md (about 10 minutes once the
# venvs exist, 10 more to create them).
interop: setup
	$(BIN)/python -m tests.interop.run --out runs/interop

# Faults at random for ten minutes under load on a multi-node cluster of this machine (issue #27):
# nothing lost, nothing wrong, nothing leaked (docs/operations.md, "Faults at random").
chaos: setup
	$(BIN)/python benchmarks/chaos.py --minutes 10 --out runs/chaos

# The tables of docs/benchmarks.md and docs/simulate.md (about 75 minutes); bench-full is the
# whole sweep of issue #7 (every concurrency, every fixed-K, open loop; about an hour).
E2E_POLICIES = ar,full,fixed-2,fixed-4,fixed-8,tetris,dcut-buckets,dcut,oracle
bench: setup
	$(BIN)/python benchmarks/decision_time.py --out runs/bench
	$(BIN)/python benchmarks/ep_step.py --out runs/bench
	$(BIN)/python benchmarks/drafter_block.py
	$(BIN)/python benchmarks/call_overhead.py
	$(BIN)/python benchmarks/peer.py --rounds 3 --out runs/peer
	$(BIN)/python benchmarks/ep2_modes.py --rounds 2
	$(BIN)/python benchmarks/gate_variants.py
	$(BIN)/python benchmarks/drafter_kinds.py
	$(BIN)/python benchmarks/drafter_mix.py --rounds 3 --out runs/drafter-mix
	$(BIN)/python benchmarks/dfly_head.py --out runs/dfly
	$(BIN)/python benchmarks/trace_validate.py --rounds 3 --out runs/trace-validate
	$(BIN)/python benchmarks/defaults.py --rounds 3 --out runs/defaults
	$(BIN)/dcut trace --workload mixed --seed 23 --num-prompts 32 --out runs/train.trace
	$(BIN)/python benchmarks/trace_experiments.py --train runs/train.trace \
		--heldout runs/trace-validate/heldout.trace --out runs/trace-experiments
	$(BIN)/python benchmarks/coordinator.py --out runs/coordinator
	$(BIN)/python benchmarks/long_prompts.py --rounds 4 --out runs/long-prompts
	$(BIN)/python benchmarks/gate_time.py
	$(BIN)/dcut bench --ep 2 --concurrency 1,4,16,64 --policies $(E2E_POLICIES) --num-prompts 24 \
		--max-tokens 48 --repeats 3 --out runs/bench_e2e
	$(BIN)/python benchmarks/render_e2e.py runs/bench_e2e/results.json
	$(BIN)/dcut simulate --out runs/simulate

bench-full: setup
	$(BIN)/dcut bench --ep 2 --concurrency 1,2,4,8,16,32,64 --num-prompts 64 --max-tokens 64 \
		--policies ar,full,$(shell seq -s, -f 'fixed-%g' 1 15),tetris,dcut-buckets,dcut,oracle --out runs/bench_full
	$(BIN)/dcut bench --ep 2 --request-rate 1,2,4,8 --burstiness 1 --num-prompts 64 --max-tokens 64 \
		--policies $(E2E_POLICIES) --out runs/bench_open_loop

# Rebuild the bundled demo model from scratch (about 2 hours on 2 cores; see docs/model.md).
demo-model: setup
	$(BIN)/python -m tools.demo.tokenizer --out models/demo/tokenizer.json
	OMP_NUM_THREADS=2 $(BIN)/python -m tools.demo.train_target --steps 1800 --threads 2 --out models/demo/target
	OMP_NUM_THREADS=2 $(BIN)/python -m tools.demo.train_drafter --threads 2 --out models/demo/drafter
	OMP_NUM_THREADS=2 $(BIN)/python -m tools.demo.train_mtp --threads 2 --out models/demo/mtp
	$(BIN)/python -m tools.demo.evaluate --out runs/demo/eval.json
	for seed in 23 29 31; do $(BIN)/dcut trace --workload mixed --num-prompts 32 --seed $$seed --block 8 \
		--out runs/demo/train$$seed.trace || exit 1; done
	$(BIN)/dcut prior --traces runs/demo/train23.trace,runs/demo/train29.trace,runs/demo/train31.trace \
		--out models/demo/prior.json
	cd models/demo && sha256sum tokenizer.json tokenizer_config.json target/* drafter/* mtp/* prior.json > SHA256SUMS

clean:
	rm -rf $(VENV) .interop runs .pytest_cache .ruff_cache
