"""The data path's types each carry a worked example in their docstring (docs/architecture.md,
"The data path, type by type"): the examples run, so they say what the code does."""

import doctest
import importlib

import pytest

MODULES = [
    "megatron_stepwise.steps",  # Step, StepBatch (from_steps, from_groups)
    "megatron_stepwise.step_structure",  # StepStructure
    "megatron_stepwise.algo.groups",  # RolloutGroup, GroupSummary
    "megatron_stepwise.algo.merge",  # merge_trajectories
    "megatron_stepwise.workers.worker_rows",  # HeldGroup, TokenVersions
    "megatron_stepwise.algo.losses",  # LossInputs
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
