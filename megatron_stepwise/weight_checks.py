"""Checks that an engine holds the weights the trainer sent: used by both sides of a weight sync.

The trainer takes, from every HF-named tensor it sends, the values at `SAMPLE_SIZE` flat
positions, one per equal stratum, that both sides derive from (tensor name, weight version) alone
(`sample_positions`, `Positions`), so each version looks at other positions and no positions
travel; small tensors (norms, biases) are taken whole. The engine takes the same positions from
its own copy as it applies the update, inside the update request, and answers with them as
columns (`Sampler`, `Samples`); the trainer compares
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

VERIFY_MODES = ("sampled", "full", "off")
SAMPLE_SIZE = 128  # positions per tensor, one per stratum (docs/weights.md: what that catches)


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
        with plain_torch():
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


class Samples(Mapping):
    """An engine's samples of the tensors one update loaded, as columns: their names in load
    order, shapes and dtypes, and per dtype one flat tensor of their sampled values one after
    another (`min(numel, k)` each). Built, pickled and compared (`compare_samples`) without an
    object per tensor: an engine answers every sampled update with one. Read as a mapping
    {name: TensorCheck}, whose entries are made on access."""

    def __init__(self, names: list, shapes: list, dtypes: list, values: dict, k: int = SAMPLE_SIZE):
        self.names, self.shapes, self.dtypes, self.values, self.k = names, shapes, dtypes, values, k
        self._where: Optional[dict] = None  # name -> (index, offset in its dtype's values), on first access

    def _located(self) -> dict:
        if self._where is None:
            self._where, offsets = {}, dict.fromkeys(self.values, 0)
            for i, (name, shape, dtype) in enumerate(zip(self.names, self.shapes, self.dtypes)):
                self._where[name] = (i, offsets[dtype])
                offsets[dtype] += min(math.prod(shape), self.k)
        return self._where

    def __getitem__(self, name: str) -> TensorCheck:
        i, start = self._located()[name]
        shape, dtype = self.shapes[i], self.dtypes[i]
        return TensorCheck(shape, dtype, self.values[dtype][start : start + min(math.prod(shape), self.k)])

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __reduce__(self):
        with plain_torch():
            blobs = {d: v.reshape(-1).view(torch.uint8).numpy().tobytes() for d, v in self.values.items()}
        return (_unpack_samples, (self.names, self.shapes, self.dtypes, blobs, self.k))

    def same_as(self, sent: Mapping[str, TensorCheck]) -> bool:
        """Whether `sent` (the trainer's sampled record) holds exactly these tensors, with these
        shapes and, cast to the engine's dtype, these values: one comparison per dtype."""
        if len(sent) != len(self.names):
            return False
        try:
            checks = [sent[name] for name in self.names]
        except KeyError:
            return False
        if [c.shape for c in checks] != self.shapes or any(c.values is None for c in checks):
            return False
        with torch.no_grad(), plain_torch():
            for dtype, ours in self.values.items():
                theirs = [c.values for c, d in zip(checks, self.dtypes) if d == dtype]
                theirs = torch.cat(theirs).to(ours.dtype) if theirs else ours.new_empty(0)
                if len(theirs) != len(ours) or not torch.equal(ours, theirs):
                    return False
        return True


def _unpack_samples(names: list, shapes: list, dtypes: list, blobs: dict, k: int) -> Samples:
    values = {
        d: torch.frombuffer(bytearray(b), dtype=torch.uint8).view(getattr(torch, d))
        if b
        else torch.empty(0, dtype=getattr(torch, d))
        for d, b in blobs.items()
    }
    return Samples(names, shapes, dtypes, values, k)


def plain_torch():
    """Torch calls without any `__torch_function__` mode or tensor-subclass dispatch
    (`nn.Parameter`): sampling makes no device choice a mode could redirect, and the trainer's
    CPU compatibility mode (`mcore/runtime/cpu_compat.py`) costs more per call than a 128-element
    gather. A loop enters it once (the engine around its load loop, for `Sampler.take`)."""
    return torch._C.DisableTorchFunction()


def _pattern(version: int, k: int) -> torch.Tensor:
    """`k` fractions in [0, 1) drawn for weight `version`: where every tensor is sampled."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"@{int(version)}".encode()))
    return torch.rand(k, generator=generator, dtype=torch.float64)


def _position_matrix(names: list[str], version: int, numels: list[int], k: int) -> torch.Tensor:
    """[len(names), k] flat positions in tensors of more than `k` elements, ascending, one in each
    of `k` equal strata of the tensor: the version's k fractions, turned by crc32 of the tensor's
    name and the version, place each within its stratum (one op for all tensors). A wrong region
    of at least two strata therefore always holds a sampled position."""
    n = torch.tensor(numels, dtype=torch.int64)[:, None]
    turn = torch.tensor([zlib.crc32(f"{name}@{int(version)}".encode()) for name in names], dtype=torch.float64)
    bounds = torch.arange(k + 1, dtype=torch.int64)[None, :] * n // k  # [tensors, k + 1] strata edges
    starts, lengths = bounds[:, :-1], bounds[:, 1:] - bounds[:, :-1]  # every stratum >= 1 element (n > k)
    fractions = (_pattern(version, k)[None, :] + turn[:, None] / 2**32).remainder_(1.0)
    return starts + torch.minimum((fractions * lengths).long(), lengths - 1)


def sample_positions(name: str, version: int, numel: int, k: int = SAMPLE_SIZE) -> torch.Tensor:
    """Flat positions checked in tensor `name` at weight `version`: all of them when `numel <= k`,
    else `k` that both sides derive alike from the name and version (as `sample_many` takes them)."""
    if numel <= k:
        return torch.arange(numel)
    with plain_torch():
        return _position_matrix([name], version, [numel], k)[0]


class Positions:
    """The sample positions of one weight version, by (tensor name, numel): computed for many
    tensors in one op (`prepare`) and looked up per tensor (`row`, computed then if missing).
    A side that knows the names ahead prepares them before the update reaches it: the trainer
    from its previous push, on its sampling thread; an engine after a load, for the next version."""

    def __init__(self, version: int, k: int = SAMPLE_SIZE):
        self.version, self.k = int(version), k
        self._rows: dict = {}

    def prepare(self, names: list[str], numels: list[int]) -> "Positions":
        todo = [(name, n) for name, n in zip(names, numels) if n > self.k and (name, n) not in self._rows]
        if todo:
            with plain_torch():
                matrix = _position_matrix([name for name, _ in todo], self.version, [n for _, n in todo], self.k)
            self._rows.update(zip(todo, matrix.unbind(0)))
        return self

    def row(self, name: str, numel: int) -> Optional[torch.Tensor]:
        """The positions in tensor `name` (None: it has at most `k` elements and is taken whole)."""
        if numel <= self.k:
            return None
        row = self._rows.get((name, numel))
        if row is None:
            row = self.prepare([name], [numel])._rows[(name, numel)]
        return row


def take(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The elements at flat `positions`, without copying the tensor (it may be a strided view)."""
    with plain_torch():
        return torch.take(tensor.detach(), positions.to(tensor.device)).cpu()


def _gather(named: list, positions: Positions) -> dict:
    """The sampled values of every (name, tensor), joined on the CPU per (device, dtype):
    {(device, or None on the CPU, dtype): (indices into `named`, their values one after another)}."""
    positions.prepare([name for name, _ in named], [t.numel() for _, t in named])
    rows = [positions.row(name, t.numel()) for name, t in named]
    # (`is_cpu`, not `device`: a device object per tensor costs more than its gather)
    for device in {t.device for _, t in named if not t.is_cpu}:  # rows moved once per device
        moved = [i for i, (_, t) in enumerate(named) if t.device == device and rows[i] is not None]
        if moved:
            for i, row in zip(moved, torch.stack([rows[i] for i in moved]).to(device).unbind(0)):
                rows[i] = row
    groups: dict = {}
    for i, (_, t) in enumerate(named):
        part = t.reshape(-1) if rows[i] is None else torch.take(t, rows[i])
        indices, parts = groups.setdefault((None if t.is_cpu else t.device, t.dtype), ([], []))
        indices.append(i)
        parts.append(part)
    return {key: (indices, torch.cat(parts).cpu()) for key, (indices, parts) in groups.items()}


def sample_many(
    named: list[tuple[str, torch.Tensor]], version: int, k: int = SAMPLE_SIZE, positions: Optional[Positions] = None
) -> list[torch.Tensor]:
    """`take(t, sample_positions(name, version, t.numel()))` of every (name, t), on the CPU: one
    position matrix for all (or `positions`, of `version`, prepared ahead), one gather per tensor,
    one copy to the CPU per (device, dtype)."""
    positions = Positions(version, k) if positions is None else positions
    with torch.no_grad(), plain_torch():
        out: list = [None] * len(named)
        for indices, joined in _gather(named, positions).values():
            sizes = [min(named[i][1].numel(), positions.k) for i in indices]
            for i, values in zip(indices, joined.split(sizes)):
                out[i] = values
        return out


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's values in its own dtype (bytes in row-major order)."""
    t = tensor.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


_DTYPE_NAMES: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def check_of(name: str, tensor: torch.Tensor, version: int, mode: str) -> TensorCheck:
    """The trainer's record of one sent tensor (mode "sampled" or "full")."""
    return checks_of([(name, tensor)], version, mode)[name]


def checks_of(
    bucket: list[tuple[str, torch.Tensor]], version: int, mode: str, positions: Optional[Positions] = None
) -> dict[str, TensorCheck]:
    """The trainer's record of a bucket of sent tensors, {name: TensorCheck} (values are copies);
    `positions`: the version's, prepared ahead (sampled mode)."""
    if mode == "full":
        return {name: TensorCheck(tuple(t.shape), dtype_name(t.dtype), digest=tensor_digest(t)) for name, t in bucket}
    samples = sample_many(bucket, version, positions=positions)
    with plain_torch():
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
    it is written (`take`), while its memory is still in cache: reading 128 spread elements of
    each tensor after a whole model was loaded costs a cache miss each. Positions as
    `sample_positions`, from the version's `Positions` (prepared ahead where the engine could).

    `take` runs once per tensor on the engine's load path, so it does only the gather: the
    caller enters `plain_torch()` once around its load loop, and `checks` builds the record."""

    def __init__(self, names: list[str], numels: list[int], positions: Positions):
        positions.prepare(names, numels)
        self._rows = [positions.row(name, n) for name, n in zip(names, numels)]
        self._k = positions.k
        self._names = names
        self._taken: list = []

    def take(self, i: int, tensor: torch.Tensor) -> None:
        """Sample `tensor`, the one `names[i]` was just loaded into (a CPU tensor without grad)."""
        row = self._rows[i]
        self._taken.append((i, tensor, tensor.reshape(-1).clone() if row is None else torch.take(tensor, row)))

    def checks(self) -> Samples:
        """The samples of every tensor taken, in the engine's dtype."""
        names, shapes, dtypes, parts = [], [], [], {}
        for i, tensor, values in self._taken:
            dtype = dtype_name(tensor.dtype)
            names.append(self._names[i])
            shapes.append(tuple(tensor.shape))
            dtypes.append(dtype)
            parts.setdefault(dtype, []).append(values)
        with plain_torch():
            flat = {dtype: torch.cat(values) for dtype, values in parts.items()}
        return Samples(names, shapes, dtypes, flat, self._k)


def overlapping(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether two of `tensors` share memory (their extents in memory intersect): then a tensor
    sampled as soon as it was written may be overwritten by a later one. Tensors on storages of
    their own cannot overlap, so only storages that hold several are looked at."""
    by_storage: dict = {}
    for t in tensors:
        if t.numel():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return any(len(shared) > 1 and _extents_intersect(shared) for shared in by_storage.values())


def _extents_intersect(tensors: list[torch.Tensor]) -> bool:
    spans = []
    for t in tensors:
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
    if isinstance(held, Samples) and held.same_as(sent):
        return {}
    problems, groups = {}, {}
    with torch.no_grad(), plain_torch():
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
    with torch.no_grad(), plain_torch():
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
            ((indices, ours),) = _gather(items, Positions(version)).values()
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
