"""megatron-stepwise: step-wise RL training of multi-turn LLM agents on Megatron.

Subpackages: `algo` (the batch pipeline, pure torch), `rollout` (engines, fleet, agent loop),
`megatron` (megatron-core integration and `StepwisePlugin`), `config` (typed YAML configs),
`envs` (environments), `hf` (HF model configs, hub lookups, tokenizers), `loop` (the training
loop and its two mini-batch sources, built by `loop/components.py`). Package layout, layers, data
flow and the step-wise invariants: docs/architecture.md.
"""

from megatron_stepwise.algo.advantages import (
    compute_advantages,
    get_estimator,
    list_estimators,
    register_estimator,
)
from megatron_stepwise.algo.losses import (
    LossConfig,
    LossInputs,
    check_loss_compatibility,
    combine_metric_partials,
    get_policy_loss,
    list_policy_losses,
    loss_token_weights,
    policy_loss,
    register_policy_loss,
)
from megatron_stepwise.algo.batching import (
    pad_for_data_parallel,
    plan_microbatches,
    prompt_minibatches,
    validate_steps,
)
from megatron_stepwise.algo.merge import MergeStats, merge_steps, merge_with_advantages
from megatron_stepwise.types import (
    PAD_PROMPT_PREFIX,
    Step,
    StepBatch,
    StepwiseBatchError,
    TrajectoryID,
    make_padding_step,
)

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
