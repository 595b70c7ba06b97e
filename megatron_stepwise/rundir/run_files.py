"""Writing files under a run directory without following symbolic links planted in it.

`view` and `replay` read run directories that may come from someone else (a copied or downloaded
run). A link placed there, `RUN_DIR/view -> ~/.ssh` or `RUN_DIR/replay/iter_0000002.json ->
~/.bashrc`, would make an ordinary write land outside the run directory. So every directory below
the base is opened with O_NOFOLLOW relative to its parent (no window between a check and the
use), and the file is written to a fresh temporary name (O_EXCL | O_NOFOLLOW) then renamed over
the target; a link anywhere on the way is refused with `UnsafePathError` naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_stepwise.errors import UserError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafePathError(UserError, OSError):
    """A symbolic link where a run-directory write would go; the message names the link."""


def _refuse(path: Path) -> UnsafePathError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return UnsafePathError(
        f"{path} is a symbolic link (to {target}): refusing to write through it; remove the link, or write elsewhere"
    )


def _open_dirs(base: Path, parts: tuple[str, ...]) -> int:
    """An fd of base/parts[0]/..., each created when missing and none of them a link."""
    fd = os.open(base, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the base itself is the user's choice
    here = base
    try:
        for name in parts:
            here = here / name
            try:
                os.mkdir(name, 0o777, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if os.path.islink(here):
                    raise _refuse(here) from e
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_under(base: str | Path, relative: str | Path, data: bytes) -> Path:
    """Write `data` to base/relative (atomic: temporary file + rename), creating directories, and
    refusing any symbolic link below `base` (the directories and the file itself)."""
    base, rel = Path(base), Path(relative)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ValueError(f"{relative!r} is not a path inside {base}")
    target = base / rel
    fd = _open_dirs(base, rel.parts[:-1])
    name = rel.parts[-1]
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        if os.path.islink(target):
            raise _refuse(target)
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)  # replaces a name, never follows one
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=fd)
            except FileNotFoundError:
                pass
            raise
    finally:
        os.close(fd)
    return target


def write_path(path: str | Path, data: bytes, *, base: str | Path | None = None) -> Path:
    """`write_under` for a path that lies under `base` (the run directory), else under its own parent
    (a path the user named, e.g. `--out`: only the file itself must not be a link)."""
    path = Path(path)
    if base is not None:
        try:
            rel = Path(os.path.abspath(path)).relative_to(os.path.abspath(base))
        except ValueError:
            rel = None
        if rel is not None and rel.parts:
            return write_under(base, rel, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_under(path.parent, path.name, data)
