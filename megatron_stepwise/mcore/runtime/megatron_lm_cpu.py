"""Run Megatron-LM's own training loop (`megatron.training.pretrain`) on CPU and gloo.

For tests and trials on machines without a GPU; on a GPU machine `enable_megatron_lm_cpu()` does
nothing. On top of `cpu_compat`, it stubs `triton`, lets `initialize_megatron` run without CUDA,
skips the helper builds and answers the device queries. Only start-up checks and device queries
change; the loop, schedules and reductions run as written. Megatron-LM's source is not installed
by this package: put its directory on `sys.path` after site-packages.

Each patch and why: docs/megatron.md, "Megatron-LM's `pretrain` on CPU: the patches".
"""

from __future__ import annotations

import functools
import sys
import types

import torch

from megatron_stepwise.mcore.runtime.cpu_compat import enable_cpu_compat


def _stub_triton() -> None:
    if "triton" in sys.modules:
        return
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.language = language
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    triton.autotune = lambda *_a, **_k: lambda f: f
    triton.Config = lambda *_a, **_k: None
    language.constexpr = int
    sys.modules["triton"], sys.modules["triton.language"] = triton, language


def enable_megatron_lm_cpu() -> bool:
    """Apply the patches above (once per process). Returns whether they are active."""
    if torch.cuda.is_available():
        return False
    enable_cpu_compat()
    _stub_triton()
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *_a, **_k: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *_a, **_k: 0)

    from megatron.core.datasets import utils as dataset_utils
    from megatron.legacy import fused_kernels
    from megatron.training import arguments, initialize, training

    dataset_utils.compile_helpers = lambda: None
    fused_kernels.load = lambda *_a, **_k: None
    arguments.get_device_arch_version = lambda: 9
    if not isinstance(training.initialize_megatron, functools.partial):
        training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    return True
