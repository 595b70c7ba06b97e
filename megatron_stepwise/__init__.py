"""megatron-stepwise: step-wise RL training of multi-turn LLM agents on Megatron."""

from megatron_stepwise.algo.advantages import (
    compute_advantages,
    get_estimator,
    list_estimators,
    register_estimator,
)
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
    "compute_advantages",
    "get_estimator",
    "list_estimators",
    "register_estimator",
    "PAD_PROMPT_PREFIX",
    "Step",
    "StepBatch",
    "StepwiseBatchError",
    "TrajectoryID",
    "make_padding_step",
]
