"""Checks that an engine holds the weights the trainer sent: used by both sides of a weight sync.

The trainer takes, from every HF-named tensor it sends, the values at `SAMPLE_SIZE` positions
drawn from a generator seeded by (tensor name, weight version), so each version looks at other
positions; small tensors (norms, biases) are taken whole. After the update the engine draws the
same positions from its own copy and compares exactly (`compare_samples`), in its own dtype:
the sent values cast to it are what its load stored. `verify: full` compares a sha256 of every
whole tensor instead (`tensor_digest`), and `manifest` lists such digests on demand.

How the check runs in each sync mode and what it costs: docs/weights.md, 'Every sync verified'.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch

VERIFY_MODES = ("sampled", "full", "off")
SAMPLE_SIZE = 256


@dataclass
class TensorCheck:
    """What the trainer sent of one tensor: its shape and dtype, and either the sampled values
    (`values`, mode "sampled") or the sha256 of all its bytes (`digest`, mode "full")."""

    shape: tuple[int, ...]
    dtype: str
    values: Optional[torch.Tensor] = None
    digest: Optional[str] = None


class Checks(dict):
    """{tensor name: TensorCheck} of one push. Pickled as one blob of all sampled values: Ray
    sends the record to every engine, and (un)pickling hundreds of small tensors costs ~10 us
    each, a blob nothing."""

    def __reduce__(self):
        names, meta, blobs = [], [], []
        for name, c in self.items():
            names.append(name)
            raw = b"" if c.values is None else c.values.contiguous().view(torch.uint8).numpy().tobytes()
            meta.append((c.shape, c.dtype, c.digest, len(raw), c.values is not None))
            blobs.append(raw + b"\0" * (-len(raw) % 8))  # each view starts aligned for any dtype
        return (_unpack_checks, (names, meta, b"".join(blobs)))


def _unpack_checks(names: list, meta: list, blob: bytes) -> Checks:
    out, offset = Checks(), 0
    buffer = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else None
    for name, (shape, dtype, digest, length, has_values) in zip(names, meta):
        values = buffer[offset : offset + length].view(getattr(torch, dtype)) if has_values else None
        out[name] = TensorCheck(shape, dtype, values, digest)
        offset += length + (-length % 8)
    return out


def sample_positions(name: str, version: int, numel: int, k: int = SAMPLE_SIZE) -> torch.Tensor:
    """Flat positions checked in tensor `name` at weight `version`: all of them when `numel <= k`,
    else `k` drawn by a generator both sides seed alike (crc32 of name and version)."""
    if numel <= k:
        return torch.arange(numel)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}@{int(version)}".encode()))
    return torch.randint(numel, (k,), generator=generator)


def take(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The elements at flat `positions`, without copying the tensor (it may be a strided view)."""
    if tensor.is_contiguous():  # a view of its storage: 10x cheaper than unravelling
        return tensor.detach().reshape(-1)[positions].cpu()
    return tensor.detach()[torch.unravel_index(positions, tensor.shape)].cpu()


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's values in its own dtype (bytes in row-major order)."""
    t = tensor.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_of(name: str, tensor: torch.Tensor, version: int, mode: str) -> TensorCheck:
    """The trainer's record of one sent tensor (mode "sampled" or "full")."""
    check = TensorCheck(tuple(tensor.shape), dtype_name(tensor.dtype))
    if mode == "full":
        check.digest = tensor_digest(tensor)
    else:
        check.values = take(tensor, sample_positions(name, version, tensor.numel()))  # a fresh tensor
    return check


def compare(name: str, held: torch.Tensor, sent: TensorCheck, version: int) -> Optional[str]:
    """Why the engine's tensor `held` is not what the trainer sent (None when it is)."""
    if tuple(held.shape) != tuple(sent.shape):
        return f"shape {tuple(held.shape)}, the trainer sent {tuple(sent.shape)}"
    if sent.digest is not None:
        wire = getattr(torch, sent.dtype)
        if held.dtype != wire and held.dtype.itemsize < wire.itemsize:
            return f"cannot be compared in full: the engine holds {dtype_name(held.dtype)}, narrower than {sent.dtype}"
        got = tensor_digest(held.to(wire))
        return None if got == sent.digest else f"sha256 {got[:12]}..., the trainer's {sent.digest[:12]}..."
    positions = sample_positions(name, version, held.numel())
    ours = take(held, positions)
    theirs = sent.values.to(held.dtype)  # what the engine's load stored from what was sent
    if len(theirs) != len(ours):
        return f"{len(ours)} sampled values, the trainer sent {len(theirs)}"
    if torch.equal(ours, theirs):
        return None
    differ = (ours != theirs).nonzero().flatten()
    if len(differ) == 0:
        return None
    i = int(differ[0])
    return (
        f"{len(differ)} of {len(ours)} sampled values differ (first at flat index {int(positions[i])}: "
        f"engine {float(ours[i]):.6g}, trainer {float(theirs[i]):.6g})"
    )


def compare_all(held: Mapping[str, Optional[torch.Tensor]], sent: Mapping[str, TensorCheck], version: int) -> dict:
    """{tensor name: why it differs} over every sent tensor; `held[name]` None = the engine has none."""
    problems = {}
    for name, check in sent.items():
        tensor = held.get(name)
        why = "not a weight of the engine's model" if tensor is None else compare(name, tensor, check, version)
        if why is not None:
            problems[name] = why
    return problems


def manifest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """{name: {shape, dtype, sha256}} of every tensor, in name order (a full check on demand)."""
    return {
        name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "sha256": tensor_digest(t)}
        for name, t in sorted(named_tensors, key=lambda item: item[0])
    }


def to_wire(checks: Mapping[str, TensorCheck]) -> dict[str, dict[str, Any]]:
    """JSON form of `checks` (the embedded server's /verify_weights body)."""
    out = {}
    for name, c in checks.items():
        entry: dict[str, Any] = {"shape": list(c.shape), "dtype": c.dtype}
        if c.digest is not None:
            entry["sha256"] = c.digest
        else:
            entry["values"] = c.values.to(torch.float64).tolist()  # exact for every float dtype up to 64 bits
        out[name] = entry
    return out


def from_wire(body: Mapping[str, Any]) -> dict[str, TensorCheck]:
    """`to_wire`'s inverse; ValueError names the first malformed entry."""
    out = {}
    for name, entry in body.items():
        if not isinstance(entry, Mapping) or "shape" not in entry or "dtype" not in entry:
            raise ValueError(f"check of {name!r} must be an object with shape, dtype and values or sha256")
        dtype = getattr(torch, str(entry["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"check of {name!r}: unknown dtype {entry['dtype']!r}")
        check = TensorCheck(tuple(int(s) for s in entry["shape"]), str(entry["dtype"]))
        if "sha256" in entry:
            check.digest = str(entry["sha256"])
        elif isinstance(entry.get("values"), list):
            check.values = torch.tensor(entry["values"], dtype=torch.float64).to(dtype)
        else:
            raise ValueError(f"check of {name!r} has neither values nor sha256")
        out[name] = check
    return out
