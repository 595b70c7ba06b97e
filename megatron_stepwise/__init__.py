"""megatron-stepwise: step-wise RL training of multi-turn LLM agents on Megatron."""

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
    "PAD_PROMPT_PREFIX",
    "Step",
    "StepBatch",
    "StepwiseBatchError",
    "TrajectoryID",
    "make_padding_step",
]
