"""Reading files that may come from someone else (checkpoints, rollout-bank files) as bounded data.

A checkpoint or a run directory may be copied from elsewhere, and a name in it may be a FIFO
(an `open` that never returns), a device (`/dev/zero`: endless), a link out of the directory, or a
sparse file of many gigabytes. So a file is opened non-blocking (a FIFO opens at once), checked to
be a regular file with `fstat` on the open descriptor (no window between the check and the read),
and its size is compared with a cap before a byte is read. `confined` resolves a relative name
inside a directory and refuses one that is absolute, climbs out (`..`) or leads out through a link.
Each refusal is an `UnsafeFileError` (an OSError) naming the file and what it is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, Optional, Union

from megatron_stepwise.errors import UserError

PathLike = Union[str, os.PathLike]

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}


class UnsafeFileError(UserError, OSError):
    """A file that is not a regular file, is larger than its cap, or lies outside its directory."""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def open_regular(path: PathLike, max_bytes: Optional[int] = None, *, follow: bool = True) -> BinaryIO:
    """`path` opened for reading if it is a regular file of at most `max_bytes` bytes, else
    `UnsafeFileError` naming it. `follow=False`: a symbolic link is refused too."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow and os.path.islink(path):
            raise UnsafeFileError(f"{path} is a symbolic link, not a regular file: refused") from e
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise UnsafeFileError(f"{path} is {kind}, not a regular file: refused")
        if max_bytes is not None and info.st_size > max_bytes:
            raise UnsafeFileError(
                f"{path} is {_mib(info.st_size)}, more than the {_mib(max_bytes)} such a file may hold: refused"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: PathLike, max_bytes: int, *, follow: bool = True) -> bytes:
    """The bytes of `path` if it is a regular file of at most `max_bytes` (`open_regular`); a file
    that grows past the cap while it is read is refused too."""
    with open_regular(path, max_bytes, follow=follow) as f:
        # read(n) allocates n bytes first: ask for the size fstat gave (and one more, to see growth)
        data = f.read(os.fstat(f.fileno()).st_size + 1)
    if len(data) > max_bytes:
        raise UnsafeFileError(f"{path} grew past {_mib(max_bytes)} while it was read: refused")
    return data


def confined(base: PathLike, relative: object) -> Path:
    """`base`/`relative`, resolved, if `relative` is a relative path (a str) that stays inside
    `base` once links are followed; else `UnsafeFileError` naming it."""
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise UnsafeFileError(f"{relative!r} is not a file name inside {base}")
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise UnsafeFileError(f"{relative!r} is not inside {base} (absolute, or climbs out with '..'): refused")
    root = os.path.realpath(base)
    resolved = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, resolved]) != root:
        raise UnsafeFileError(f"{relative!r} in {base} leads out of it (to {resolved}) through a link: refused")
    return Path(resolved)
