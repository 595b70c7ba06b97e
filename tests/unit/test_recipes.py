"""Every shipped config validates as written, and what would make a recipe die at iteration 0
(more prompts per iteration than its dataset holds) is a validation error instead."""

from __future__ import annotations

from pathlib import Path

import pytest
from config_fakes import FakeProbes

from megatron_stepwise.config import load_config
from megatron_stepwise.config.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(
    p for p in [*REPO.glob("configs/*.yaml"), *REPO.glob("configs/recipes/*.yaml")] if not p.name.startswith("_")
)  # _*.yaml are fragments merged by `defaults:`


def _probes():
    # The GPU cluster the recipes are for: sglang installed, the models in the HF cache.
    return FakeProbes(modules=("sglang", "transformer_engine"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_validates_as_written(path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(str(path), probes=_probes())
    assert cfg.data.prompts_per_iteration <= 50 or "tiny" in path.name  # shipped sets: 50 prompts


@pytest.mark.parametrize("path", [p for p in CONFIGS if "recipes" in str(p)], ids=lambda p: p.name)
def test_a_recipe_asking_for_more_prompts_than_its_dataset_fails_validation(path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        load_config(str(path), ["data.prompts_per_iteration=64", "data.prompts_per_minibatch=16"], probes=_probes())
    assert e.value.keys == ["data.prompts_per_iteration"], str(e.value)
    assert "has 50" in str(e.value) and "shipped" in str(e.value)
