"""Stop a diverging run before its weights reach the engines.

After each optimizer step the trainer checks the step's loss and gradient norm: a NaN or inf
there means the policy's weights are (or are about to be) non-finite, and pushing them would
only make every engine fail its next request. The metrics are identical on every rank, so every
rank raises the same error at the same step and the run ends with one line naming the first
non-finite metric. A gradient norm of NaN with clipping off is Megatron's "not computed"
(`optim.clip_grad=0`), and a step the optimizer skipped (fp16 loss scaling) changed no weight:
neither counts.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_stepwise.errors import UserError


class RunDiverged(UserError, RuntimeError):
    """A training step produced a non-finite loss or gradient norm."""


def _watched(name: str) -> bool:
    return name == "grad_norm" or name == "loss" or name.endswith("_loss")


def check_finite(metrics: dict[str, Any], *, iteration: int, clip_grad: float) -> None:
    """Raise `RunDiverged` naming the first non-finite watched metric of one optimizer step."""
    if not metrics.get("update_successful", 1.0):
        return
    for name in sorted(metrics, key=lambda k: (k != "loss", k != "grad_norm", k)):
        value = metrics[name]
        if not _watched(name) or not isinstance(value, (int, float)) or math.isfinite(value):
            continue
        if name == "grad_norm" and math.isnan(value) and clip_grad <= 0:
            continue
        raise RunDiverged(
            f"the run diverged: train/{name} is {value} at iteration {iteration}; "
            "stopped before pushing these weights (lower optim.lr, or resume from the last checkpoint)"
        )
