"""Text and tensors the model, or whatever talks to the engine, sends: refused with a message
naming the field or weight, or handled, never an exception in the trainer (issue 42)."""

import json

import pytest
import torch

from megatron_stepwise.envs.sandbox import write_code
from megatron_stepwise.rollout.engines.embedded import request_fields as F
from megatron_stepwise.rollout.engines.embedded.hf_model import load_named_tensors


def test_code_with_a_lone_surrogate_is_written_as_its_escape(tmp_path):
    code = json.loads("\"print('\\ud800')\"")  # what json.loads makes of a tool call's "\ud800"
    path = write_code(str(tmp_path), code)
    assert open(path, encoding="utf-8").read() == "print('\\ud800')"


@pytest.mark.parametrize("value", [-5, "-5", 2**70, str(2**70), "9" * 5000, True, 1.5])
def test_impossible_weight_versions_are_refused_naming_the_field(value):
    with pytest.raises(F.BadRequest) as e:
        F.version(value, "/update_weight_version", "new_version")
    assert str(e.value).startswith("/update_weight_version: new_version must be") and len(str(e.value)) <= 500


@pytest.mark.parametrize("value,expected", [(0, 0), ("7", 7), (2**63 - 1, 2**63 - 1), (None, None)])
def test_possible_weight_versions_are_kept(value, expected):
    assert F.version(value, "/update_weights_from_disk") == expected


def test_integer_weights_are_refused_not_cast():
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError) as e:
        load_named_tensors(model, {"weight": torch.ones(2, 3, dtype=torch.int64)})
    assert "'weight'" in str(e.value) and "int64" in str(e.value) and "float32" in str(e.value)
    assert torch.equal(model.weight, before)
