"""megatron-core imported with its `torch.compile` decorations deferred to their first call.

megatron-core makes `torch.compile` its fuser (megatron/core/jit.py) and decorates its fused
kernels with it (bias-GeLU, bias-SwiGLU, bias-dropout-add, MoE helpers...) as their modules are
imported; `torch.compile` imports torch._dynamo and torch._inductor the moment it decorates: ~1.2
CPU-seconds in every training process, although our model config turns those fusions off
(mcore/train/model.py), so a run calls none of them. While megatron-core is first imported,
`torch.compile` is replaced by a decorator that calls the real one when the function first runs:
a function that runs is compiled as before (same options; torch.compile compiles at the first
call anyway), one that never runs costs nothing. `torch.compile` itself is restored at once.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from typing import Any, Callable, Optional

import torch


def deferred_compile(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile`'s signature; a plain function is handed to `compile_fn` (with the same
    options) at its first call instead of now. Anything else (a module) goes to it at once."""

    def compile(model: Optional[Callable] = None, **options: Any):
        if model is None:  # @torch.compile(**options)
            return lambda fn: compile(fn, **options)
        if not inspect.isfunction(model):
            return compile_fn(model, **options)
        compiled: list[Callable] = []
        lock = threading.Lock()

        @functools.wraps(model)
        def compiled_at_first_call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(compile_fn(model, **options))
            return compiled[0](*args, **kwargs)

        return compiled_at_first_call

    return compile


def import_megatron_core() -> None:
    """Import megatron.core (once per process) with its torch.compile decorations deferred."""
    if "megatron.core" in sys.modules:
        return
    real = torch.compile
    torch.compile = deferred_compile(real)
    try:
        import megatron.core  # noqa: F401  (its jit_fuser keeps the deferring decorator)
    finally:
        torch.compile = real
