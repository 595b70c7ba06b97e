"""megatron-stepwise: step-wise RL training of multi-turn LLM agents on Megatron.

Subpackages: `algo` (the batch pipeline, pure torch), `rollout` (engines, fleet, agent loop),
`megatron` (megatron-core integration and `StepwisePlugin`), `config` (typed YAML configs),
`envs` (environments), `hf` (HF model configs, hub lookups, tokenizers), `loop` (the training
loop and its two mini-batch sources), `workers` (agent workers in Ray actors), `compose` (the
run's parts built from the config), `offline` (replay). Package layout, layers, data
flow and the step-wise invariants: docs/architecture.md.
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
        "loss_token_weights",
        "policy_loss",
        "register_policy_loss",
    ),
    "megatron_stepwise.algo.batching": (
        "pad_for_data_parallel",
        "plan_microbatches",
        "prompt_minibatches",
        "validate_steps",
    ),
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

__all__ = [
    "LossConfig",
    "LossInputs",
    "check_loss_compatibility",
    "combine_metric_partials",
    "get_policy_loss",
    "list_policy_losses",
    "loss_token_weights",
    "policy_loss",
    "register_policy_loss",
    "compute_advantages",
    "get_estimator",
    "list_estimators",
    "register_estimator",
    "MergeStats",
    "PAD_PROMPT_PREFIX",
    "RowTable",
    "Step",
    "StepBatch",
    "StepwiseBatchError",
    "TrajectoryID",
    "make_padding_step",
    "merge_steps",
    "merge_with_advantages",
    "pad_for_data_parallel",
    "plan_microbatches",
    "prompt_minibatches",
    "validate_steps",
]
