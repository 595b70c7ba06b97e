"""Checks that an engine holds the weights the trainer sent: used by both sides of a weight sync.

The trainer takes, from every HF-named tensor it sends, the values at `SAMPLE_SIZE` flat
positions that both sides derive from (tensor name, weight version) alone (`sample_positions`),
so each version looks at other positions and no positions travel; small tensors (norms, biases)
are taken whole. The engine takes the same positions from its own copy as it applies the update,
inside the update request, and answers with them (`Sampler`, `samples_of`); the trainer compares
exactly, in the engine's dtype (`compare_samples`): the sent values cast to it are what its load
stored. `verify: full` compares a sha256 of every whole tensor instead (`tensor_digest`, sent to
the engine, which compares: `compare_all`), and `manifest` lists such digests on demand.

Both sides work on many tensors at once (`sample_many`, `compare_samples`, `compare_all`): one
position matrix, one gather per tensor, one comparison per dtype, and no `__torch_function__`
mode in the way, since per-call overheads, not the gathers, are what a per-tensor loop costs.

How the check runs in each sync mode and what it costs: docs/weights.md, 'Every sync verified'.
"""

from __future__ import annotations

import hashlib
import math
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
    """{tensor name: TensorCheck} of one push (or of an engine's samples of it). Pickled with all
    sampled values of a dtype as one blob: Ray carries them between trainer and engines, and
    (un)pickling hundreds of small tensors costs ~10 us each, a blob nothing."""

    def __reduce__(self):
        names, meta, by_dtype = [], [], {}
        with _plain_torch():
            for name, c in self.items():
                names.append(name)
                kept = None
                if c.values is not None:
                    kept = (dtype_name(c.values.dtype), c.values.numel())
                    by_dtype.setdefault(kept[0], []).append(c.values.reshape(-1))
                meta.append((c.shape, c.dtype, c.digest, kept))
            blobs = {d: torch.cat(v).view(torch.uint8).numpy().tobytes() for d, v in by_dtype.items()}
        return (_unpack_checks, (names, meta, blobs))


def _unpack_checks(names: list, meta: list, blobs: dict) -> Checks:
    # Each dtype's blob holds its tensors' values in name order: split back into views of it.
    counts: dict = {}
    for *_, kept in meta:
        if kept is not None:
            counts.setdefault(kept[0], []).append(kept[1])
    parts = {}
    for dtype, sizes in counts.items():
        raw = (
            torch.frombuffer(bytearray(blobs[dtype]), dtype=torch.uint8)
            if blobs[dtype]
            else torch.empty(0, dtype=torch.uint8)
        )
        parts[dtype] = iter(raw.view(getattr(torch, dtype)).split(sizes))
    out = Checks()
    for name, (shape, dtype, digest, kept) in zip(names, meta):
        out[name] = TensorCheck(shape, dtype, None if kept is None else next(parts[kept[0]]), digest)
    return out


def _plain_torch():
    """Torch calls without any `__torch_function__` mode: sampling makes no device choice a mode
    could redirect, and the trainer's CPU compatibility mode (`mcore/runtime/cpu_compat.py`)
    costs more per call than a 256-element gather."""
    return torch._C.DisableTorchFunction()


def _pattern(version: int, k: int) -> torch.Tensor:
    """`k` fractions in [0, 1) drawn for weight `version`: where every tensor is sampled."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"@{int(version)}".encode()))
    return torch.rand(k, generator=generator, dtype=torch.float64)


def _position_matrix(names: list[str], version: int, numels: list[int], k: int) -> torch.Tensor:
    """[len(names), k] flat positions in tensors of more than `k` elements: the version's pattern
    scaled to each tensor and turned by crc32 of its name and the version (one op for all)."""
    n = torch.tensor(numels, dtype=torch.int64)[:, None]
    turn = torch.tensor([zlib.crc32(f"{name}@{int(version)}".encode()) for name in names], dtype=torch.int64)
    return ((_pattern(version, k)[None, :] * n).long() + turn[:, None]) % n


def sample_positions(name: str, version: int, numel: int, k: int = SAMPLE_SIZE) -> torch.Tensor:
    """Flat positions checked in tensor `name` at weight `version`: all of them when `numel <= k`,
    else `k` that both sides derive alike from the name and version (as `sample_many` takes them)."""
    if numel <= k:
        return torch.arange(numel)
    with _plain_torch():
        return _position_matrix([name], version, [numel], k)[0]


def take(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The elements at flat `positions`, without copying the tensor (it may be a strided view)."""
    with _plain_torch():
        return torch.take(tensor.detach(), positions.to(tensor.device)).cpu()


def _gather(named: list, version: int, k: int) -> dict:
    """The sampled values of every (name, tensor), joined on the CPU per (device, dtype):
    {(device, dtype): (indices into `named`, their values one after another)}."""
    numels = [t.numel() for _, t in named]
    big = [i for i, n in enumerate(numels) if n > k]
    row_of = {i: r for r, i in enumerate(big)}
    matrix = _position_matrix([named[i][0] for i in big], version, [numels[i] for i in big], k) if big else None
    rows_on: dict = {}  # the matrix's rows on each device the tensors live on (moved once)
    groups: dict = {}
    for i, (_, t) in enumerate(named):
        r = row_of.get(i)
        if r is None:
            part = t.reshape(-1)
        else:
            if t.device not in rows_on:
                rows_on[t.device] = matrix.to(t.device).unbind(0)
            part = torch.take(t, rows_on[t.device][r])
        indices, parts = groups.setdefault((t.device, t.dtype), ([], []))
        indices.append(i)
        parts.append(part)
    return {key: (indices, torch.cat(parts).cpu()) for key, (indices, parts) in groups.items()}


def sample_many(named: list[tuple[str, torch.Tensor]], version: int, k: int = SAMPLE_SIZE) -> list[torch.Tensor]:
    """`take(t, sample_positions(name, version, t.numel()))` of every (name, t), on the CPU: one
    position matrix for all, one gather per tensor, one copy to the CPU per (device, dtype)."""
    with torch.no_grad(), _plain_torch():
        out: list = [None] * len(named)
        for indices, joined in _gather(named, version, k).values():
            sizes = [min(named[i][1].numel(), k) for i in indices]
            for i, values in zip(indices, joined.split(sizes)):
                out[i] = values
        return out


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's values in its own dtype (bytes in row-major order)."""
    t = tensor.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_of(name: str, tensor: torch.Tensor, version: int, mode: str) -> TensorCheck:
    """The trainer's record of one sent tensor (mode "sampled" or "full")."""
    return checks_of([(name, tensor)], version, mode)[name]


def checks_of(bucket: list[tuple[str, torch.Tensor]], version: int, mode: str) -> dict[str, TensorCheck]:
    """The trainer's record of a bucket of sent tensors, {name: TensorCheck} (values are copies)."""
    if mode == "full":
        return {name: TensorCheck(tuple(t.shape), dtype_name(t.dtype), digest=tensor_digest(t)) for name, t in bucket}
    samples = sample_many(bucket, version)
    with _plain_torch():
        return {
            name: TensorCheck(tuple(t.shape), dtype_name(t.dtype), values) for (name, t), values in zip(bucket, samples)
        }


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
    return _difference(take(held, positions), sent.values.to(held.dtype), positions)


def _difference(ours: torch.Tensor, theirs: torch.Tensor, positions: torch.Tensor) -> Optional[str]:
    """Why the engine's sampled values `ours` are not the trainer's `theirs` (cast to the engine's
    dtype: what its load stored from what was sent), naming the first differing flat index."""
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


class Sampler:
    """An engine's samples of the tensors an update loads, taken one tensor at a time right after
    it is written (`take`), while its memory is still in cache: reading 256 random elements of
    each tensor after a whole model was loaded costs a cache miss each. Positions as
    `sample_positions`, computed for all tensors at once."""

    def __init__(self, names: list[str], numels: list[int], version: int, k: int = SAMPLE_SIZE):
        big = [i for i, n in enumerate(numels) if n > k]
        with _plain_torch():
            rows = _position_matrix([names[i] for i in big], version, [numels[i] for i in big], k) if big else None
        self._rows = dict(zip(big, rows.unbind(0))) if big else {}
        self._names = names
        self._taken: list = []

    def take(self, i: int, tensor: torch.Tensor) -> None:
        """Sample `tensor`, the one `names[i]` was just loaded into (a CPU tensor without grad)."""
        with _plain_torch():
            row = self._rows.get(i)
            self._taken.append((i, tensor, tensor.reshape(-1).clone() if row is None else torch.take(tensor, row)))

    def checks(self) -> Checks:
        """{name: TensorCheck} of every tensor taken, in the engine's dtype."""
        out = Checks()
        for i, tensor, values in self._taken:
            out[self._names[i]] = TensorCheck(tuple(tensor.shape), dtype_name(tensor.dtype), values)
        return out


def overlapping(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether two of `tensors` share memory (their extents in memory intersect): then a tensor
    sampled as soon as it was written may be overwritten by a later one."""
    spans = []
    for t in tensors:
        if t.numel():
            extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
            spans.append((t.data_ptr(), t.data_ptr() + extent * t.element_size()))
    spans.sort()
    end = None
    for start, stop in spans:
        if end is not None and start < end:
            return True
        end = stop if end is None else max(end, stop)
    return False


def samples_of(named: Iterable[tuple[str, torch.Tensor]], version: int) -> Checks:
    """The engine's answer to a sampled check: each (name, tensor it holds) with the values at the
    positions the trainer sampled, in the engine's own dtype."""
    return Checks(checks_of(list(named), version, "sampled"))


def compare_samples(held: Mapping[str, TensorCheck], sent: Mapping[str, TensorCheck], version: int) -> dict:
    """{tensor name: why it differs} over every sent tensor, in sent order: `held` is an engine's
    `samples_of` what it loaded, `sent` the trainer's record (sampled).

    As `compare_all`: one `torch.equal` per group (same sent and held dtype), tensor by tensor only
    in a group that differs, to name the tensor and the first differing flat index."""
    problems, groups = {}, {}
    with torch.no_grad(), _plain_torch():
        for name, check in sent.items():
            ours = held.get(name)
            if ours is None:
                problems[name] = "the engine did not load it in this update (no sample in its answer)"
            elif tuple(ours.shape) != tuple(check.shape):
                problems[name] = f"shape {tuple(ours.shape)}, the trainer sent {tuple(check.shape)}"
            else:
                groups.setdefault((check.values.dtype, ours.values.dtype), []).append(name)
        for (_, held_dtype), names in groups.items():
            ours = torch.cat([held[n].values for n in names])
            theirs = torch.cat([sent[n].values for n in names]).to(held_dtype)
            if len(ours) == len(theirs) and torch.equal(ours, theirs):
                continue
            for name in names:  # the slow path, only when something differs
                positions = sample_positions(name, version, math.prod(held[name].shape))
                why = _difference(held[name].values, sent[name].values.to(held_dtype), positions)
                if why is not None:
                    problems[name] = why
    order = {name: i for i, name in enumerate(sent)}
    return dict(sorted(problems.items(), key=lambda item: order[item[0]]))


def compare_all(held: Mapping[str, Optional[torch.Tensor]], sent: Mapping[str, TensorCheck], version: int) -> dict:
    """{tensor name: why it differs} over every sent tensor, in sent order; `held[name]` None =
    the engine has none.

    Sampled tensors are compared together: the engine's samples of a group (same sent dtype,
    held dtype and device) against the group's sent values, one `torch.equal`; only a group that
    differs is gone through tensor by tensor (`compare`) to name them."""
    problems, groups = {}, {}
    with torch.no_grad(), _plain_torch():
        for name, check in sent.items():
            tensor = held.get(name)
            if tensor is None:
                problems[name] = "not a weight of the engine's model"
            elif (
                check.values is None
                or tensor.shape != check.shape
                or len(check.values) != min(tensor.numel(), SAMPLE_SIZE)
            ):
                why = compare(name, tensor, check, version)  # a digest, or a record that cannot match
                if why is not None:
                    problems[name] = why
            else:
                groups.setdefault((check.values.dtype, tensor.dtype, tensor.device), []).append((name, tensor))
        for (_, held_dtype, _), items in groups.items():
            ((indices, ours),) = _gather(items, version, SAMPLE_SIZE).values()
            theirs = torch.cat([sent[items[i][0]].values for i in indices]).to(held_dtype)
            if torch.equal(ours, theirs):
                continue
            for name, tensor in items:  # the slow path, only when something differs
                why = compare(name, tensor, sent[name], version)
                if why is not None:
                    problems[name] = why
    order = {name: i for i, name in enumerate(sent)}
    return dict(sorted(problems.items(), key=lambda item: order[item[0]]))


def manifest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """{name: {shape, dtype, sha256}} of every tensor, in name order (a full check on demand)."""
    return {
        name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "sha256": tensor_digest(t)}
        for name, t in sorted(named_tensors, key=lambda item: item[0])
    }


def to_wire(checks: Mapping[str, TensorCheck]) -> dict[str, dict[str, Any]]:
    """JSON form of `checks` (the embedded server's /verify_weights body, and the samples in its answer
    to an update with `sample_weights`)."""
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
