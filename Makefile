# The two commands: `make run` (the main job) and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast lint bench

setup:
	@bash tools/setup_env.sh

run: setup
	$(VENV)/bin/megatron-stepwise train configs/tiny_cpu.yaml

# Two pytest workers, one test file each at a time (a file's launches and fixtures stay together):
# a test spends much of its time starting processes and waiting on them, which a second file fills.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20 tests

# Before every commit: tests/unit without the tests that start processes (about a minute on 2 cores);
# STEPWISE_NO_LAUNCH=1 fails any other test there that starts one (tests/conftest.py).
test-fast: setup
	STEPWISE_NO_LAUNCH=1 $(PY) -m pytest -q tests/unit -m "not distributed and not slow and not launches" --durations=15

# Formatting and import order are the tool's (ruff, configured in pyproject.toml): `make format` applies them.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) tools/bench/suite.py
