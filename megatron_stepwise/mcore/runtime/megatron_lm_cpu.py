"""Run Megatron-LM's own training loop (`megatron.training.pretrain`) on CPU and gloo.

For tests and trials on machines without a GPU; on a GPU machine `enable_megatron_lm_cpu()` does
nothing. On top of `cpu_compat` (megatron-core's hard-coded CUDA uses), Megatron-LM's training
package needs:

| patch                                              | why                                                   |
|----------------------------------------------------|-------------------------------------------------------|
| a stub `triton` module                             | imported at start-up through megatron-core's          |
|                                                    | batch-invariant kernels, never called on this path    |
| `initialize_megatron(allow_no_cuda=True)`          | it asserts CUDA unless told otherwise                 |
| `compile_helpers`, `fused_kernels.load` no-ops     | they run `make` / `nvcc` for the GPU dataset helpers  |
| `get_device_arch_version()` answers 9              | argument checks ask for the GPU architecture          |
| `torch.cuda.memory_*` queries answer 0             | memory reports in the training log                    |
| `torch.cuda.device_count()` answers 1, `set_device`| model-parallel groups and seeds are set up only when  |
|   is a no-op                                       | a device is counted                                   |

Only start-up checks and device queries change; the loop, schedules and reductions run as written.
Megatron-LM's source is not installed by this package: put its directory on `sys.path` after
site-packages (`megatron.core` keeps coming from the megatron-core wheel).
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
    triton.autotune = lambda *_a, **_k: (lambda f: f)
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
