"""Semantic checks of a typed config: layouts, combinations, the machine. One problem per finding.

`validate` runs the checks of each concern in a fixed order (model_checks, rollout_checks,
training_checks, env_checks, served_checks, run_checks); the sections' own `problems()` are asked here.
"""

from __future__ import annotations

from megatron_stepwise.config.checker import Checker
from megatron_stepwise.config.env_checks import check_env
from megatron_stepwise.config.errors import ConfigProblem
from megatron_stepwise.config.fields import config_fields, is_config_class
from megatron_stepwise.config.model_checks import check_model, check_parallel
from megatron_stepwise.config.probes import Probes
from megatron_stepwise.config.rollout_checks import check_async, check_colocate, check_rollout
from megatron_stepwise.config.run_checks import check_outputs, check_sizes
from megatron_stepwise.config.schema import ExperimentConfig
from megatron_stepwise.config.served_checks import check_served
from megatron_stepwise.config.training_checks import check_algo, check_data, check_loss_combinations, check_optim
from megatron_stepwise.options import is_registry


def validate(
    cfg: ExperimentConfig,
    *,
    world_size: int | None = None,
    world_size_source: str | None = None,
    bad_keys: set[str] | None = None,
    origins: dict[str, str] | None = None,
    probes: Probes | None = None,
) -> list[ConfigProblem]:
    """Every semantic problem of `cfg` (empty when it can run)."""
    check = Checker(bad_keys or set(), origins or {})
    probes = probes or Probes()
    _check_imports(cfg, check, probes)  # first: imported modules fill the registries checked below
    _check_declared(cfg, check)
    check_parallel(cfg, check, probes, world_size, world_size_source)
    check_model(cfg, check, probes)
    check_rollout(cfg, check, probes)
    check_data(cfg, check)
    check_algo(cfg, check)
    check_loss_combinations(cfg, check)
    check_async(cfg, check)
    check_colocate(cfg, check)
    check_optim(cfg, check)
    check_env(cfg, check, probes)
    check_served(cfg, check, probes)
    check_outputs(cfg, check, probes)
    check_sizes(cfg, check)
    return check.problems


def _check_imports(cfg: ExperimentConfig, check: Checker, probes: Probes) -> None:
    for name in cfg.trainer.imports:
        error = probes.import_module(name)
        if error:
            check.fail("trainer.imports", f"cannot import {name!r}: {error}")


def _check_declared(obj, check: Checker, prefix: str = "") -> None:
    """What sections find wrong with themselves (`problems()`, e.g. `algo.loss`).

    Building the config already checked every key's bounds and fixed choices (a bad value was
    reported and reset to its default); left are choices from registries (filled by
    trainer.imports, imported just before) and combinations of keys of one section.
    """
    fields = config_fields(type(obj))
    for name, f, tp in fields:
        if is_config_class(tp):
            _check_declared(getattr(obj, f.name), check, f"{prefix}{name}.")
    if not callable(getattr(obj, "problems", None)):
        return
    metas = {name: f.metadata for name, f, _ in fields}
    for key, why in obj.problems():
        if is_registry(metas.get(key, {})):
            why += " (custom ones are registered by a module listed in trainer.imports)"
        check.fail(prefix + key, why)
