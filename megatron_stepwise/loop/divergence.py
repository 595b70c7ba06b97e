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
from typing import Any, Optional

from megatron_stepwise.errors import UserError


class RunDiverged(UserError, RuntimeError):
    """A training step produced a non-finite loss or gradient norm."""


def _watched(name: str) -> bool:
    return name == "grad_norm" or name == "loss" or name.endswith("_loss")


def check_finite(
    metrics: dict[str, Any], *, iteration: int, clip_grad: float, resumed_from: Optional[int] = None
) -> None:
    """Raise `RunDiverged` naming the first non-finite watched metric of one optimizer step.
    `resumed_from`: the iteration this run resumed at (None: it did not), which changes the advice."""
    if not metrics.get("update_successful", 1.0):
        return
    for name in sorted(metrics, key=lambda k: (k != "loss", k != "grad_norm", k)):
        value = metrics[name]
        if not _watched(name) or not isinstance(value, (int, float)) or math.isfinite(value):
            continue
        if name == "grad_norm" and math.isnan(value) and clip_grad <= 0:
            continue
        raise RunDiverged(
            f"the run diverged: train/{name} is {value} at iteration {iteration}; {_advice(iteration, resumed_from)}"
        )


def _advice(iteration: int, resumed_from: Optional[int]) -> str:
    if resumed_from is not None and iteration == resumed_from:
        # its first step after loading: the checkpoint itself is the likely cause, and resuming
        # from it again would diverge again
        return (
            f"stopped before pushing these weights. It is the first step after resuming from the checkpoint "
            f"of iteration {resumed_from}, whose weights or optimizer state are likely non-finite: resume from "
            "an earlier checkpoint (checkpoint.resume=PATH), or from its weights alone "
            "(checkpoint.load_optimizer=false), or lower optim.lr"
        )
    return "stopped before pushing these weights (lower optim.lr, or resume from the last checkpoint)"
