# The two commands: `make run` (the main job) and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast lint bench

setup:
	@bash tools/setup_env.sh

run: setup
	$(VENV)/bin/megatron-stepwise train configs/tiny_cpu.yaml

# Three pytest workers on 2 cores, one test file each at a time (a file's launches and fixtures stay
# together): some tests wait on timeouts with the CPU idle (two-node faults, a late fleet start),
# which a third file fills. Files start longest first (tests/conftest.py, LONGEST_FIRST).
TEST_WORKERS ?= 3

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 tests

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
