# The two commands: `make run` (the main job) and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast bench

setup:
	@bash tools/setup_env.sh

run: setup
	$(VENV)/bin/megatron-stepwise train configs/tiny_cpu.yaml

test: setup
	$(PY) -m pytest -q --durations=20 tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not distributed and not slow"

bench: setup
	$(PY) tools/bench.py
