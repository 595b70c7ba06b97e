"""Typed experiment configs: YAML files with `defaults:` inheritance and `a.b.c=value` overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.iterations=3"])
    cfg.parallel.tensor, cfg.rollout.sampling.temperature, cfg.to_yaml()

`load_config` returns a validated `ExperimentConfig` (schema.py) or raises `ConfigError`
(errors.py), whose `problems` name every offending key at once. Each name is imported from the
module that defines it; this one defines the loading functions.

- schema.py    one typed dataclass per YAML section; every key with a default and help
- fields.py    declaring keys (`option`, `section`) and building typed dataclasses from dicts
- loader.py    `defaults:` inheritance, `a.b.c=value` overrides, provenance of keys
- validate.py  semantic checks (layouts, combinations, the machine), one problem per finding,
               run in order by concern: model_checks.py (model, parallel layout, checkpoint),
               rollout_checks.py (engines, async, colocation), training_checks.py (mini-batches,
               estimator and loss, optimizer), env_checks.py (environment, dataset),
               run_checks.py (name, output directories, sizes); checker.py collects the problems
- probes.py    what validation needs to know about the machine (extras, model configs, registries)
- errors.py    `ConfigProblem` / `ConfigError`: every problem names its dotted key
- docs.py      the key reference generated from the schema (docs/config.md)
- commands.py  `megatron-stepwise validate` and `megatron-stepwise config {docs,show}`
"""

from __future__ import annotations

import copy
import os
from typing import Iterable

from megatron_stepwise.config.errors import ConfigError, ConfigProblem
from megatron_stepwise.config.fields import build
from megatron_stepwise.config.loader import ComposeError, apply_overrides, compose
from megatron_stepwise.config.probes import Probes
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.config.validate import validate


def load_config(
    path: str | os.PathLike,
    overrides: Iterable[str] = (),
    *,
    world_size: int | None = None,
    probes: Probes | None = None,
) -> ExperimentConfig:
    """Read, merge, override, type-check and validate an experiment YAML file.

    `world_size` defaults to $WORLD_SIZE (set by torchrun), else launch.nnodes x launch.nproc_per_node.
    """
    try:
        data, origins = compose(path)
    except ComposeError as e:
        raise ConfigError(e.problems, source=str(path)) from None
    return _finish(data, origins, overrides, world_size, probes, source=str(path))


def config_from_dict(
    data: dict, overrides: Iterable[str] = (), *, world_size: int | None = None, probes: Probes | None = None
) -> ExperimentConfig:
    """Like `load_config` for an already-parsed mapping (no `defaults:` resolution)."""
    data = copy.deepcopy(data)
    if "defaults" in data:
        raise ConfigError([ConfigProblem("defaults", "only YAML files can have defaults; use load_config")])
    return _finish(data, {}, overrides, world_size, probes, source=None)


def _env_world_size() -> int | None:
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() else None


def effective_world_size(cfg: ExperimentConfig, world_size: int | None = None) -> int:
    """The world size a config is checked against: given, else $WORLD_SIZE (torchrun), else its launch layout."""
    return world_size or _env_world_size() or cfg.launch.world_size()


def _finish(
    data: dict,
    origins: dict[str, str],
    overrides: Iterable[str],
    world_size: int | None,
    probes: Probes | None,
    source: str | None,
) -> ExperimentConfig:
    problems: list[ConfigProblem] = []
    apply_overrides(data, overrides, origins, problems, schema=ExperimentConfig)
    bad_keys: set[str] = {p.key for p in problems}
    cfg = build(ExperimentConfig, data, problems, origins=origins, bad_keys=bad_keys)
    ws_source = None
    if world_size is not None:
        ws_source = "given world size"
    elif _env_world_size() is not None:
        world_size, ws_source = _env_world_size(), "$WORLD_SIZE"
    problems += validate(
        cfg, world_size=world_size, world_size_source=ws_source, bad_keys=bad_keys, origins=origins, probes=probes
    )
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


__all__ = ["config_from_dict", "effective_world_size", "load_config"]
