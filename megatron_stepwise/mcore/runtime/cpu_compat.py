"""Run megatron-core 0.16 on CPU (gloo) by redirecting its hard-coded CUDA uses.

megatron-core assumes a GPU in a handful of places that have nothing to do with the maths
(scalar buffers on "cuda", `current_device()`, `synchronize()`, the CUDA RNG tracker, dtype
checks by type name). With these patches the real code paths (1F1B schedules, TP layers, DDP,
the distributed optimizer) run unchanged on CPU; every patch changes only where a tensor lives
or what a device query answers, never the arithmetic. Use `cpu_compat()` as a context manager
or `CpuCompat.enable()` / `disable()`; it is inert when CUDA is available.

Each patch and the megatron-core code that needs it: docs/megatron.md, 'CPU compatibility
layer' and 'The CPU patches, one by one'.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    return isinstance(device, (torch.device, str)) and str(device).split(":")[0] == "cuda"


class _RedirectCudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            # `.cuda()` of a CPU tensor: stay on CPU (same aliasing semantics as `.to(cpu)`).
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers assert on 'torch.cuda.FloatTensor' etc.; report the CUDA name
            # of the same dtype so those checks see the dtype they are really about.
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and args:
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _splits_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    # megatron's maybe_move_tensor_to_cpu converts to numpy only what it copies off a GPU.
    return tensor.cpu().numpy() if torch.is_tensor(tensor) and as_numpy else tensor


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _cpu_get_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(new_state)


class _InertStream:
    """A CUDA stream (and event) stand-in: on CPU every operation is already ordered."""

    __init__ = wait_stream = synchronize = wait = _noop

    def record_event(self, *_args: Any) -> "_InertStream":
        return _InertStream()

    def __enter__(self) -> "_InertStream":
        return self

    def __exit__(self, *_exc: Any) -> None:
        return None


_DEFAULT_STREAM = _InertStream()


class CpuCompat:
    """Holds the patches; `enable()` applies them once, `disable()` restores the originals.

    Reference counted so nested users (a test inside a runtime) compose.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _RedirectCudaToCpu | None = None
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._depth > 0

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def enable(self) -> bool:
        """Apply the patches (no-op when CUDA is available). Returns whether they are active."""
        if torch.cuda.is_available():
            return False
        with self._lock:
            self._depth += 1
            if self._depth > 1:
                return True
            from megatron.core.tensor_parallel import random as mrandom
            from megatron.core.transformer.moe import token_dispatcher

            self._patch(torch.cuda, "current_device", lambda: _CPU)
            self._patch(torch.cuda, "synchronize", _noop)
            self._patch(torch.cuda, "empty_cache", _noop)
            self._patch(torch.cuda, "get_rng_state", _cpu_get_rng_state)
            self._patch(torch.cuda, "set_rng_state", _cpu_set_rng_state)
            self._patch(torch.cuda, "manual_seed", torch.manual_seed)
            self._patch(torch.cuda.random, "get_rng_state", _cpu_get_rng_state)
            self._patch(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
            self._patch(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
            self._patch(token_dispatcher, "maybe_move_tensor_to_cpu", _splits_to_host)
            self._patch(torch.cuda, "Stream", _InertStream)
            self._patch(torch.cuda, "current_stream", lambda *_a, **_k: _DEFAULT_STREAM)
            self._patch(torch.cuda, "stream", lambda stream=None: stream or _DEFAULT_STREAM)
            self._mode = _RedirectCudaToCpu()
            self._mode.__enter__()
            return True

    def disable(self) -> None:
        """Undo `enable()`; the last matching call restores everything."""
        if torch.cuda.is_available():
            return
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth > 0:
                return
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
            for owner, name, value in reversed(self._saved):
                setattr(owner, name, value)
            self._saved.clear()


_COMPAT = CpuCompat()


def enable_cpu_compat() -> bool:
    """Enable the process-wide CPU compatibility layer (see module docstring)."""
    return _COMPAT.enable()


def disable_cpu_compat() -> None:
    _COMPAT.disable()


def cpu_compat_active() -> bool:
    return _COMPAT.active


@contextlib.contextmanager
def cpu_compat() -> Iterator[bool]:
    """Context manager form: yields whether the patches are active (False on a GPU machine)."""
    active = _COMPAT.enable()
    try:
        yield active
    finally:
        if active:
            _COMPAT.disable()
