"""megatron-stepwise: step-wise RL training of multi-turn LLM agents on Megatron.

Subpackages, top down (each imports only those below it; docs/architecture.md, Layers): `cli`
(the commands), `offline` (replay and evaluation of a run's files), `loop` (the training loop and
its two mini-batch sources), `workers` (agent workers in Ray actors), `compose` (the run's parts
built from the config), `config` (typed YAML configs), `mcore` (megatron-core integration:
`train/` with `StepwisePlugin`, `weights/`, `runtime/`) beside `rollout` (engines, fleet, agent
loop), `envs` (environments), `metrics`, `algo` (the batch pipeline, pure torch), `data`,
`viewer`, `rundir` (a run directory's files), then the base modules (`steps`, `hf`, `options`,
...) and `errors` (`UserError`). Package layout, data flow and the step-wise invariants:
docs/architecture.md.

The public API is this module's `__all__`; every other name is imported from the module that
defines it.
"""

# The public names, imported on first use (PEP 562): `import megatron_stepwise` and the command
# line's `--help` stay fast (torch is a few seconds of imports), `from megatron_stepwise import Step`
# works as before.
_EXPORTS = {
    "megatron_stepwise.algo.advantages": (
        "compute_advantages",
        "get_estimator",
        "list_estimators",
        "register_estimator",
    ),
    "megatron_stepwise.algo.losses": (
        "LossConfig",
        "LossInputs",
        "check_loss_compatibility",
        "combine_metric_partials",
        "get_policy_loss",
        "list_policy_losses",
        "policy_loss",
        "register_policy_loss",
    ),
    "megatron_stepwise.algo.reductions": ("loss_token_weights",),
    "megatron_stepwise.algo.batching": ("pad_for_data_parallel", "prompt_minibatches"),
    "megatron_stepwise.algo.planner": ("plan_microbatches",),
    "megatron_stepwise.algo.validate": ("validate_steps",),
    "megatron_stepwise.algo.merge": ("MergeStats", "merge_steps", "merge_with_advantages"),
    "megatron_stepwise.algo.rows": ("RowTable",),
    "megatron_stepwise.steps": (
        "PAD_PROMPT_PREFIX",
        "Step",
        "StepBatch",
        "StepwiseBatchError",
        "TrajectoryID",
        "make_padding_step",
    ),
    # your own Megatron loop: the plugin, and the decoder spec / config a host-built model needs
    "megatron_stepwise.mcore.train.plugin": ("StepwisePlugin",),
    "megatron_stepwise.mcore.train.model": ("layer_spec", "transformer_config"),
    # experiment configs
    "megatron_stepwise.config": ("config_from_dict", "load_config"),
    "megatron_stepwise.config.schema": ("ExperimentConfig",),
    "megatron_stepwise.config.errors": ("ConfigError",),
    # your own environment
    "megatron_stepwise.envs.base": ("EnvSpec", "Environment", "list_envs", "make_env", "register_env"),
    "megatron_stepwise.errors": ("UserError",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_stepwise' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])


__version__ = "0.1.0"

__all__ = sorted(_MODULE_OF)
