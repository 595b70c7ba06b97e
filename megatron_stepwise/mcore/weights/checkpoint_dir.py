"""The files of a checkpoint directory: names, completeness, the `latest` pointer, the manifest
of sizes and hashes, and moving a finished save into place and pruning old ones (rank 0).

`CKPT_DIR/iter_0000042/` is complete when megatron-core's `metadata.json` and our
`trainer_state.json` are in it; `manifest.json`, written last, lets a load check every file
first. Why and how: docs/weights.md, 'Checkpoints'. A checkpoint may come from elsewhere, so what
it names is confined to it (`rundir/file_reads.py`): every file of the manifest and every storage
file of the index is a relative path inside the directory and a regular file, the index's are
listed in the manifest, and the small files (manifest, `latest`) are read only under a size cap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Optional, Union

from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError, UnsafeCheckpointError
from megatron_stepwise.mcore.weights.fileops import fsync_dir, write_atomic
from megatron_stepwise.rundir.file_reads import UnsafeFileError, confined, open_regular, read_regular
from megatron_stepwise.rundir.paths import iteration_name, parse_iteration

PathLike = Union[str, os.PathLike]
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
_HASH = "sha256"  # hardware-accelerated on current x86 and ARM: ~1.3 GB/s here, blake2b ~0.7
_COMPLETE_MARKERS = ("metadata.json", TRAINER_STATE)
MAX_MANIFEST_BYTES = 64 << 20  # ~150 bytes a file: far above any real checkpoint's
MAX_SMALL_FILE_BYTES = 16 << 20  # `latest`, trainer_state.json


def checkpoint_name(iteration: int) -> str:
    return iteration_name(iteration)


def checkpoint_iteration(path: Path) -> Optional[int]:
    return parse_iteration(path.name)


def is_complete(path: Path) -> bool:
    return (
        path.is_dir()
        and checkpoint_iteration(path) is not None
        and all((path / f).is_file() for f in _COMPLETE_MARKERS)
    )


def list_checkpoints(ckpt_dir: PathLike) -> list[Path]:
    """Complete checkpoints in `ckpt_dir`, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=checkpoint_iteration)


def find_latest(ckpt_dir: PathLike) -> Optional[Path]:
    """The checkpoint to resume from: the one `latest` names if it is complete, else the newest
    complete one (a lost or stale pointer never blocks a resume); None when there is none."""
    root = Path(ckpt_dir)
    target = read_pointer(root)
    if target is not None and is_complete(target):
        return target
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_pointer(root: Path) -> Optional[Path]:
    """The checkpoint `latest` names, or None when it is missing or not a regular file of a name."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = read_regular(pointer, 4096).decode().strip()
        confined(root, name)  # a name in this directory, not a path elsewhere
    except (OSError, UnicodeDecodeError):
        return None
    return root / name


# ----------------------------------------------------------------------------- manifest (rank 0)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: PathLike) -> Path:
    """Record the size and hash of every file under checkpoint directory `path` in
    `manifest.json` (written atomically; call it after every file is on disk)."""
    path = Path(path)
    skip = {MANIFEST, MANIFEST + ".tmp"}
    files = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        if rel not in skip:
            files[rel] = {"size": f.stat().st_size, _HASH: _digest(f)}
    write_atomic(path / MANIFEST, json.dumps({"format": 1, "hash": _HASH, "files": files}, indent=1, sort_keys=True))
    return path / MANIFEST


def verify_checkpoint(path: PathLike) -> tuple[Optional[str], bool]:
    """(problem, verified): problem is None when `path` is usable, else one line naming what is
    wrong (the file, expected vs got); verified is False for a checkpoint without a manifest
    (saved before manifests existed), which is usable but unchecked."""
    path = Path(path)
    if not path.is_dir():
        return "directory missing", False
    missing = [f for f in _COMPLETE_MARKERS if not (path / f).is_file()]
    if missing:
        return f"incomplete: {', '.join(missing)} missing", False
    if not (path / MANIFEST).is_file():
        return None, False
    try:
        entries = read_manifest(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__}: {e})", False
    for rel, size, _ in entries:  # sizes first: cheap, and what a truncation changes
        try:
            info = os.stat(confined(path, rel))
        except UnsafeFileError as e:
            return f"file {rel}: {e}", True
        except OSError:
            return f"file {rel}: missing (expected {size} bytes)", True
        if not stat.S_ISREG(info.st_mode):
            return f"file {rel}: not a regular file (a FIFO, device or directory): refused", True
        if info.st_size != size:
            return f"file {rel}: expected {size} bytes, got {info.st_size}", True
    for rel, _, digest in entries:
        try:
            got = _digest(confined(path, rel))
        except OSError as e:
            return f"file {rel}: unreadable ({e})", True
        if got != digest:
            return f"file {rel}: expected {_HASH} {digest[:16]}..., got {got[:16]}...", True
    return None, True


def read_manifest(path: Path) -> list[tuple[str, int, str]]:
    """(relative name, size, digest) of every file checkpoint `path`'s manifest lists; ValueError,
    KeyError, TypeError or OSError (UnsafeFileError for a FIFO or an oversized file) when unreadable."""
    manifest = json.loads(read_regular(path / MANIFEST, MAX_MANIFEST_BYTES))
    files = manifest["files"]
    algo = manifest.get("hash", _HASH)
    if algo != _HASH or not isinstance(files, dict):
        raise ValueError(f"unsupported hash {algo!r}" if algo != _HASH else "no file list")
    return [(str(rel), int(e["size"]), str(e[algo])) for rel, e in sorted(files.items())]


def check_index_paths(index, path: PathLike, source: str) -> None:
    """Raise UnsafeCheckpointError unless every storage file checkpoint index `index` (read from
    `source`) names is a relative path inside checkpoint `path`, a regular file, listed in its
    manifest when it has one, and holds the byte range the index gives it."""
    path = Path(path)
    listed = None
    if (path / MANIFEST).is_file():
        try:
            listed = {rel for rel, _, _ in read_manifest(path)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UnsafeCheckpointError(f"checkpoint {path}: {MANIFEST} unreadable ({type(e).__name__}: {e})") from None
    sizes: dict[str, int] = {}
    for key, info in (getattr(index, "storage_data", None) or {}).items():
        rel = getattr(info, "relative_path", None)
        where = f"checkpoint index {source}: item {getattr(key, 'fqn', key)!r} is stored in {rel!r}"
        try:
            if rel not in sizes:
                sizes[rel] = _regular_size(confined(path, rel))
        except OSError as e:
            raise UnsafeCheckpointError(f"{where}, which is refused: {e}") from None
        if listed is not None and rel not in listed:
            raise UnsafeCheckpointError(f"{where}, which {MANIFEST} does not list: refused")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(type(n) is int and n >= 0 for n in (offset, length)) or offset + length > sizes[rel]:
            raise UnsafeCheckpointError(
                f"{where} at bytes {offset!r}+{length!r}, which the file ({sizes[rel]} bytes) does not hold: refused"
            )


def _regular_size(path: Path) -> int:
    with open_regular(path) as f:
        return os.fstat(f.fileno()).st_size


# ----------------------------------------------------------------------------- file operations (rank 0)


def publish(tmp: Path, final: Path) -> None:
    """Move a finished `.tmp` checkpoint into place and point `latest` at it."""
    old = final.with_name(final.name + ".old")
    if final.exists():  # saving the same iteration again (e.g. right after a resume)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)
    write_atomic(final.parent / LATEST, final.name + "\n")


def check_keep_last(keep_last: int) -> None:
    if keep_last < 1:  # checkpoint.keep_last's bound, for callers outside the config
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")


def prune(ckpt_dir: PathLike, keep_last: int, *, protect: Optional[Path] = None) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and leftover `.tmp`/`.old`
    directories of interrupted saves; never `protect` or what `latest` names. Returns what went."""
    check_keep_last(keep_last)
    root = Path(ckpt_dir)
    keep = set(list_checkpoints(root)[-keep_last:])
    latest = find_latest(root)
    keep |= {p for p in (protect, latest) if p is not None}
    removed = []
    for p in root.iterdir():
        stale = p.is_dir() and p.suffix in (".tmp", ".old") and parse_iteration(p.stem) is not None
        if (is_complete(p) and p not in keep) or (stale and p != protect):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return sorted(removed)
