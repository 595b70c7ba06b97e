"""Per-call totals the kernel does not keep for the sandbox here, checked from the trainer's side.

- memory: the resident anonymous and shared memory of every process of the call, summed. Limits
  per process (RLIMIT_AS) do not cap a tree of processes, and a cgroup for the call would need a
  delegated cgroup v2 hierarchy, which most machines that train do not give a job;
- disk, only where the call has no tmpfs of its own (no namespaces): the bytes allocated under
  the call's directory and the number of its files and directories.

The call's processes are the descendants of the process the trainer started: with namespaces
every orphan is re-parented to the PID namespace's init, without them to the supervisor (a
subreaper), both of which are descendants too. A check is a poll: the overshoot is what the code
manages to allocate or write between two checks, which is why the interval shortens as a total
nears its limit. Standard library only: `sandbox.py` is also loaded by path by an unprivileged
user, for whom the project's package is not importable.
"""

from __future__ import annotations

import ctypes
import os
import time

SLOW, FAST = 0.05, 0.005  # seconds between checks: normally, and past half of a limit


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children, by parent pid (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def process_tree(root: int) -> list[int]:
    """`root` and its descendants."""
    children = children_by_parent()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def private_memory(pid: int) -> int:
    """Resident memory not backed by a regular file, in bytes (0 once gone): anonymous pages and
    shared memory (`mmap(-1, n)`, memfd, SysV), the latter counted in each process mapping it."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return 0
    kib = 0
    for line in status.splitlines():
        if line.startswith((b"RssAnon:", b"RssShmem:")):
            kib += int(line.split()[1])
    return kib << 10


def disk_usage(root: str, max_entries: int, on_dir=None) -> tuple[int, int]:
    """(bytes allocated, entries) under `root`, without recursion; stops counting past
    `max_entries`; `on_dir(path)` sees each directory. A directory the code made unreadable is
    made readable again (its owner, or root, may), so hiding files costs nothing but a retry."""
    used, entries, todo = 0, 0, [root]
    while todo and entries <= max_entries:
        path = todo.pop()
        if on_dir is not None:
            on_dir(path)
        try:
            scan = os.scandir(path)
        except PermissionError:
            try:
                os.chmod(path, 0o700)
                scan = os.scandir(path)
            except OSError:
                continue
        except OSError:
            continue  # removed meanwhile
        with scan:
            for entry in scan:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                entries += 1
                used += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
    return used, entries


_IN_NONBLOCK_CLOEXEC = 0o4000 | 0o2000000
_IN_EVENTS = 0x2 | 0x100 | 0x80  # IN_MODIFY, IN_CREATE, IN_MOVED_TO


class DirEvents:
    """inotify on every directory of the tree: its fd turns readable as soon as the code writes,
    so writing wakes a check at once instead of at the next poll (a burst of writes at page-cache
    speed fills hundreds of MiB between two 50 ms polls). Directories are added as each check
    walks the tree. None of it is needed for correctness: without inotify, polls still hold."""

    def __init__(self):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(_IN_NONBLOCK_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")

    def add(self, path: str) -> None:
        self._libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_EVENTS)  # a directory gone meanwhile: ignored

    def drain(self) -> None:
        try:
            while os.read(self.fd, 1 << 16):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        os.close(self.fd)


class Watch:
    """Polls one call against its totals; `check()` says which one it broke, if any."""

    def __init__(self, pid: int, memory_bytes: int, disk: tuple[str, int, int] | None = None):
        self.pid, self.memory_bytes, self.disk = pid, memory_bytes, disk  # disk: (dir, bytes, entries)
        self.interval, self.next, self.last = SLOW, 0.0, 0.0
        self.peak_memory = self.peak_disk = 0
        self.events = None
        if disk is not None:
            try:
                self.events = DirEvents()
            except (OSError, AttributeError):
                pass

    def fileno(self) -> int | None:
        """A descriptor that turns readable when the code writes (None: poll only)."""
        return None if self.events is None else self.events.fd

    def woken(self) -> None:
        """The code wrote: check at once (at most every FAST seconds)."""
        self.events.drain()
        self.next = min(self.next, self.last + FAST)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()

    def due(self) -> float:
        """Seconds until the next check (0: now)."""
        return max(0.0, self.next - time.monotonic())

    def check(self) -> str | None:
        self.last = time.monotonic()
        memory = sum(map(private_memory, process_tree(self.pid)))
        self.peak_memory = max(self.peak_memory, memory)
        share = memory / self.memory_bytes
        if memory > self.memory_bytes:
            return (
                f"the call's processes held {memory >> 20} MiB of memory together "
                f"(limit {self.memory_bytes >> 20} MiB for all of them)"
            )
        if self.disk is not None:
            root, limit, max_entries = self.disk
            used, entries = disk_usage(root, max_entries, self.events and self.events.add)
            self.peak_disk = max(self.peak_disk, used)
            if used > limit:
                return f"the call wrote {used >> 20} MiB (limit {limit >> 20} MiB for all its files)"
            if entries > max_entries:
                return f"the call made more than {max_entries} files and directories (the limit)"
            share = max(share, used / limit, entries / max_entries)
        self.interval = FAST if share > 0.5 else SLOW
        self.next = time.monotonic() + self.interval
        return None
