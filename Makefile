# The two commands: `make run` (the main job) and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast bench

setup:
	@bash tools/setup_env.sh

run: setup
	$(VENV)/bin/megatron-stepwise train configs/tiny_cpu.yaml

# Two pytest workers, one test file each at a time (a file's launches and fixtures stay together):
# a test spends much of its time starting processes and waiting on them, which a second file fills.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20 tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not distributed and not slow"

bench: setup
	$(PY) tools/bench.py
