"""Crash-safe files for checkpoints and HF exports, written by rank 0 for the whole job.

A rename survives a crash only once the directory holding it is fsynced too. A failure that
rank 0 meets while every rank waits must reach them all (`raise_together`), or they would hang
in the next collective.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Union

import torch.distributed as dist

PathLike = Union[str, os.PathLike]


def fsync_dir(path: PathLike) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: PathLike, text: str) -> None:
    """Replace `path` with `text`: a reader (or a restart after a crash) sees the old or the new
    content, never a partial file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def raise_together(error: Optional[str], error_type: type[Exception], src: int = 0) -> None:
    """Every rank raises `error_type` with rank `src`'s error, or none does. Collective."""
    box = [error]
    dist.broadcast_object_list(box, src=src)
    if box[0] is not None:
        raise error_type(box[0])


def make_staging_dir(path: Path, what: str, error_type: type[Exception]) -> None:
    """Rank 0 creates `path` empty (removing a crashed run's leftover); every rank raises
    `error_type` if it could not. Collective: the barrier before any rank writes into it."""
    error = None
    if dist.get_rank() == 0:
        try:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        except OSError as e:
            error = f"cannot create {what} {path}: {e}"
    raise_together(error, error_type)
