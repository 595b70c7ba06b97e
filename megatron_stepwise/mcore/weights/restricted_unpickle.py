"""Checkpoints are data: the pickled parts of a checkpoint are read without running code in them.

A torch_dist checkpoint has three kinds of pickle: `.metadata` (torch.distributed.checkpoint's
index, which torch itself reads with plain `pickle.load`), `common.pt` and the byte items inside
the `.distcp` files (RNG states, `_extra_state`, optimizer bookkeeping; both `torch.save` format).
A pickle names the classes it builds, and building one may call anything importable
(`os.system`), so a checkpoint from elsewhere could run code on every rank. Here `.metadata` goes
through an unpickler that resolves only the classes a checkpoint index holds, and the torch.save
parts through `torch.load(weights_only=True)` (tensors, dtypes, builtin containers) plus the numpy
types of an RNG state. Anything else is refused with an `UnsafeCheckpointError` naming the file and
the class (docs/weights.md, 'What a checkpoint from elsewhere can do').

No code runs, but an index could still harm the process that reads it, so it is also data with
bounds: the file is read only if it is a regular file under `MAX_INDEX_BYTES`; the one allowed
type that allocates from a number, `bytearray(N)`, is built only from bytes (which the file holds);
and BUILD (the opcode that sets an object's state) applies only to an instance of an index class
with a state of the kind that class writes, never to a class (which would change that class for
the whole process: `pathlib.PosixPath`'s methods, say). The pure-Python unpickler makes that last
check possible and reads a real index as fast as the C one (its cost is building the objects).

No Megatron here: the megatron-core strategies that use these readers are in `safe_dist_load.py`.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import IO, Any, Optional, Union

import numpy as np
import torch

from megatron_stepwise.mcore.weights.checkpoint_errors import UnsafeCheckpointError
from megatron_stepwise.rundir.file_reads import UnsafeFileError, read_regular

_DCP = "torch.distributed.checkpoint"
# What torch.distributed.checkpoint's `Metadata` is made of (torch 2.6 - 2.13), by module.
_INDEX_CLASSES = {
    f"{_DCP}.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    f"{_DCP}.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"},
    f"{_DCP}.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a name -> torch.layout lookup
    "builtins": {"set", "frozenset", "bytearray", "slice", "complex"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id as torch's own writer records it
}
# An RNG state saved by numpy (np.random.get_state()): an array of uint32 and its dtype.
_NUMPY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
try:  # numpy 2 pickles arrays through numpy._core, numpy 1 through numpy.core
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - numpy 1
    from numpy.core.multiarray import _reconstruct
_NUMPY_GLOBALS.append(_reconstruct)

ALLOWED_SUMMARY = (
    "a checkpoint loads only tensors, dtypes, builtin containers, numpy RNG arrays and "
    "torch.distributed.checkpoint's metadata classes"
)


def _refusal(source: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint file {source} asks to load {what}, which a checkpoint never holds: refused "
        f"({ALLOWED_SUMMARY}; docs/weights.md). Do not load this checkpoint: it may have been tampered with"
    )


def _is_torch_constant(module: str, name: str) -> bool:
    value = getattr(torch, name, None) if module == "torch" else None
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


# A checkpoint index names every tensor chunk of every rank: ~200 bytes per chunk, so a few MiB for
# a 70B model; 1 GiB is far above any real one and keeps a hostile one from filling the memory.
MAX_INDEX_BYTES = 1 << 30


def _bytearray_of_bytes(*args: Any) -> bytearray:
    """`bytearray` as an index may build it: from bytes (a pickle of protocol 3 or 4 writes it so),
    never from a number, which would allocate that many bytes from a few in the file."""
    if not args or not isinstance(args[0], (bytes, bytearray)):
        what = type(args[0]).__name__ if args else "no argument"
        raise UnpicklingRefused(f"builtins.bytearray of {what} (it allocates without bound)")
    return bytearray(*args)


class UnpicklingRefused(Exception):
    """Raised inside the unpickler; `load_index` turns it into an UnsafeCheckpointError."""


def _is_index_class(cls: type) -> bool:
    return cls.__module__.startswith(_DCP + ".") and cls.__name__ in _INDEX_CLASSES.get(cls.__module__, ())


def _build_problem(inst: Any, state: Any) -> Optional[str]:
    """Why BUILD may not set `state` on `inst`, or None: only an instance of an index class (a
    dataclass) takes a dict of attribute names, or the tuple its own `__setstate__` reads."""
    if isinstance(inst, type):
        return f"a state set onto the class {inst.__module__}.{inst.__qualname__} (it would change that class)"
    if not _is_index_class(type(inst)):
        return f"a state set onto a {type(inst).__module__}.{type(inst).__qualname__}"
    own_setstate = "__setstate__" in vars(type(inst))
    if own_setstate and isinstance(state, tuple):
        return None
    if isinstance(state, dict) and all(type(k) is str for k in state):
        return None
    return f"a state of type {type(state).__name__} for {type(inst).__name__}"


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that builds only the classes of a torch.distributed.checkpoint index, sets state
    only on their instances, and builds no bytearray from a number."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes], source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name == "bytearray":
            return _bytearray_of_bytes
        if name in _INDEX_CLASSES.get(module, ()) or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise _refusal(self.source, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _refusal(self.source, f"a persistent object ({type(pid).__name__})")

    def load_build(self) -> None:
        problem = _build_problem(self.stack[-2], self.stack[-1]) if len(self.stack) >= 2 else "a state onto nothing"
        if problem is not None:
            raise UnpicklingRefused(problem)
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def load_index(path: Union[str, os.PathLike]) -> Any:
    """A `.metadata` file (torch.distributed.checkpoint's `Metadata`), read without running code,
    only if it is a regular file under MAX_INDEX_BYTES."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        data = read_regular(path, MAX_INDEX_BYTES)
    except UnsafeFileError as e:
        raise UnsafeCheckpointError(
            f"checkpoint index {e}. Do not load this checkpoint: it may have been tampered with"
        ) from None
    try:
        index = RestrictedUnpickler(io.BytesIO(data), str(path)).load()
    except UnsafeCheckpointError:
        raise
    except UnpicklingRefused as e:
        raise _refusal(str(path), str(e)) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
        raise pickle.UnpicklingError(f"{path} is not a checkpoint index: {type(e).__name__}: {e}") from None
    if not isinstance(index, Metadata):
        raise pickle.UnpicklingError(f"{path} is not a checkpoint index: it holds a {type(index).__name__}")
    return index


def _unsafe_globals(f: IO[bytes]) -> list[str]:
    try:
        f.seek(0)
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception:  # noqa: BLE001 - only naming the class; the refusal stands either way
        return []


def load_torch_pickle(f: Union[str, os.PathLike, IO[bytes]], source: str) -> Any:
    """A `torch.save` part of a checkpoint (`common.pt`, a byte item of a `.distcp` file) loaded on
    the CPU with `weights_only=True`; `source` names it in the refusal."""
    with torch.serialization.safe_globals(_NUMPY_GLOBALS):
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if isinstance(f, (str, os.PathLike)):
                with open(f, "rb") as handle:
                    unsafe = _unsafe_globals(handle)
            else:
                unsafe = _unsafe_globals(f)
            if unsafe:
                raise _refusal(source, ", ".join(unsafe)) from None
            reason = next((line for line in str(e).splitlines() if "WeightsUnpickler error" in line), str(e))
            raise _refusal(source, f"something else than data ({reason.strip()[:200]})") from None
