"""Per-call totals the kernel does not keep for the sandbox here, checked from the trainer's side.

- memory: the resident anonymous and shared memory of every process of the call, summed, plus
  what the kernel may hold for its sockets and pipes (`kernel_buffers`). Limits per process
  (RLIMIT_AS) do not cap a tree of processes, and a cgroup for the call would need a delegated
  cgroup v2 hierarchy, which most machines that train do not give a job (nor would it count unix
  socket buffers, which no cgroup charges);
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
import stat
import time

SLOW, FAST = 0.05, 0.005  # seconds between checks: normally, and past half of a limit
BRAKE_NICENESS = 19  # the code's niceness past half of a limit


def brake(pids) -> None:
    """Renice every thread of `pids` to BRAKE_NICENESS: past half a limit the code slows down
    before its watch does on a loaded machine, so what it adds between two checks stays small
    (the watch is a poll). Niceness ranks threads only within one scheduler autogroup (one per
    session where the kernel has them), which is why the code stays in the trainer's session
    and may not call setsid. Threads and processes started later inherit it."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), BRAKE_NICENESS)
            except OSError:
                pass  # gone meanwhile


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


def _sysctl(name: str, default: int) -> int:
    try:
        with open(f"/proc/sys/{name}") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


# What one socket or pipe can hold at most: the code may not raise a socket's buffers (SO_SNDBUF,
# SO_RCVBUF) or a pipe's size (F_SETPIPE_SZ): `sandbox_init.deny_sockets` refuses them, so each
# stays at the kernel's default. A unix socket's queued data is charged to its sender's send
# buffer, a datagram socket's to its receiver's: a socket is counted at both.
SOCKET_BYTES = _sysctl("net/core/wmem_default", 212992) + _sysctl("net/core/rmem_default", 212992)
PIPE_BYTES = 16 * os.sysconf("SC_PAGE_SIZE")  # a pipe's default capacity: 16 pages
_NET_TABLES = ("unix", "tcp", "tcp6", "udp", "udp6", "raw", "raw6")  # the families the code can create


class OpenFiles:
    """What one process holds open that the kernel keeps memory or disk for: sockets and pipes (by
    inode), and files of the call's directory it deleted (bytes allocated, by (device, inode))."""

    def __init__(self):
        self.sockets: set[int] = set()
        self.pipes: set[int] = set()
        self.deleted: dict[tuple[int, int], int] = {}


def open_files_of(pid: int, root: str | None = None) -> OpenFiles | None:
    """One pass over `pid`'s descriptors (`root`: the call's directory, for deleted files); None
    when they cannot be read (a process that made itself undumpable, seen by a watcher that is
    not root)."""
    found = OpenFiles()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return found  # gone
    except OSError:
        return None
    prefix = None if root is None else root.rstrip("/") + "/"
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                found.sockets.add(int(target[8:-1]))
            elif target.startswith("pipe:["):
                found.pipes.add(int(target[6:-1]))
            elif prefix and target.startswith(prefix) and target.endswith(" (deleted)"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if stat.S_ISREG(st.st_mode):
                    found.deleted[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        except OSError:
            continue  # closed meanwhile
    return found


def _network_namespace(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def namespace_sockets(pid: int) -> set[int] | None:
    """Every socket of `pid`'s network namespace, held open or in flight (sent over a unix socket
    and closed), by inode: with a namespace of its own, all of them are the call's. None while
    `pid` is still in the trainer's namespace (not yet moved, or cannot be told)."""
    ns = _network_namespace(pid)
    if ns is None or ns == _network_namespace("self"):
        return None
    inodes = set()
    for table in _NET_TABLES:
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        column = 6 if table == "unix" else 9  # the inode column
        for line in lines:
            fields = line.split()
            if len(fields) > column and fields[column].isdigit():
                inodes.add(int(fields[column]))
    inodes.discard(0)
    return inodes


def kernel_buffers(
    opened: list[OpenFiles | None], open_files: int, listed: set[int] | None = None, in_flight: bool = True
) -> int:
    """Bytes the kernel may hold for the call's sockets and pipes (`opened`: `open_files_of` for
    each of its processes): unread socket data is kernel memory that no process's resident memory
    shows (one call held 3.3 GB that way). Each socket and pipe counts once, at its capacity,
    since the kernel does not tell how much of it is used. A process whose descriptors cannot be
    read counts as holding `open_files` sockets.

    Descriptors sent over a unix socket and then closed are in flight: held by no process, yet
    the kernel keeps their buffers. It lets a user have at most RLIMIT_NOFILE in flight, so while
    the call holds a socket that many more are reserved; `listed` (the sockets of the call's own
    network namespace, `namespace_sockets`) covers the sockets in flight, and then only pipes
    need the reserve. `in_flight` False: the call cannot send descriptors (model code: sendmsg is
    refused).
    """
    sockets, pipes = set(listed or ()), set()
    hidden = sum(found is None for found in opened)
    for found in opened:
        if found is not None:
            sockets |= found.sockets
            pipes |= found.pipes
    reserve = 0
    if in_flight and (sockets or hidden):
        reserve = open_files * (PIPE_BYTES if listed is not None else SOCKET_BYTES)
    return len(sockets) * SOCKET_BYTES + len(pipes) * PIPE_BYTES + hidden * open_files * SOCKET_BYTES + reserve


MAX_DEPTH = 64  # directory levels under the call's directory; a deeper chain stops the call
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskCount:
    """What a walk of the call's directory found."""

    def __init__(self):
        self.used = self.entries = 0  # bytes allocated; files and directories
        self.too_deep = False


def disk_usage(root: str, max_entries: int, on_dir=None) -> DiskCount:
    """Bytes allocated and entries under `root`; stops counting past `max_entries` or below
    MAX_DEPTH levels; `on_dir(path)` sees each directory. Each directory is opened relative to its
    parent's descriptor: a path walked from the root costs a lookup per level, so a chain of
    thousands of directories made every check quadratic (seconds), and past PATH_MAX its files
    were not seen at all. A directory the code made unreadable is made readable again (its owner,
    or root, may), so hiding files costs nothing but a retry."""
    count = DiskCount()
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return count
    try:
        _count_dir(fd, 0, count, max_entries, on_dir)
    finally:
        os.close(fd)
    return count


def _count_dir(fd: int, depth: int, count: DiskCount, max_entries: int, on_dir) -> None:
    if on_dir is not None:
        on_dir(f"/proc/self/fd/{fd}")
    try:
        scan = os.scandir(fd)
    except OSError:
        return  # removed meanwhile
    with scan:
        for entry in scan:
            if count.entries > max_entries or count.too_deep:
                return
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            count.entries += 1
            count.used += st.st_blocks * 512
            if not stat.S_ISDIR(st.st_mode):
                continue
            if depth + 1 >= MAX_DEPTH:
                count.too_deep = True
                return
            child = _open_dir(entry.name, fd)
            if child is not None:
                try:
                    _count_dir(child, depth + 1, count, max_entries, on_dir)
                finally:
                    os.close(child)


def _open_dir(name: str, parent: int) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:
        pass
    except OSError:
        return None  # removed, or replaced by a symlink meanwhile
    try:  # chmod through a descriptor of the directory itself: never through a symlink put in its place
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return None
    try:
        if stat.S_ISDIR(os.fstat(handle).st_mode):
            os.chmod(f"/proc/self/fd/{handle}", 0o700)
            return os.open(f"/proc/self/fd/{handle}", _DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError:
        pass
    finally:
        os.close(handle)
    return None


def unlinked_files(tree: list[int], opened: list[OpenFiles | None], root: str) -> int:
    """Bytes in files of `root` the code deleted but keeps open or mapped (`opened`: the scans of
    `tree`'s processes, with `root`): the directory walk no longer sees them, yet their blocks stay
    allocated until the last descriptor or mapping goes (before, 714 MB were held that way against
    a 64 MiB quota). An open one is measured; one only mapped counts as its mapping's length, which
    its allocated blocks cannot exceed."""
    prefix, measured, mapped = root.rstrip("/") + "/", {}, {}
    for found in opened:
        if found is not None:
            measured.update(found.deleted)
    for pid in tree:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        if " (deleted)" not in maps:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # range perms offset dev inode path
            if len(fields) == 6 and fields[5].startswith(prefix) and fields[5].endswith(" (deleted)"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                key = (os.makedev(major, minor), int(fields[4]))
                mapped[key] = mapped.get(key, 0) + high - low
    return sum(measured.values()) + sum(size for key, size in mapped.items() if key not in measured)


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

    def __init__(
        self,
        pid: int,
        memory_bytes: int,
        disk: tuple[str, int, int] | None = None,
        open_files: int = 64,
        own_network: bool = False,
        in_flight: bool = True,
    ):
        self.pid, self.memory_bytes, self.disk = pid, memory_bytes, disk  # disk: (dir, bytes, entries)
        self.open_files, self.own_network = open_files, own_network  # RLIMIT_NOFILE; a network namespace
        self.in_flight = in_flight  # whether the call can send descriptors (kernel_buffers)
        self.interval, self.next, self.last = SLOW, 0.0, 0.0
        self.peak_memory = self.peak_disk = 0
        self.events = None
        self.tree, self.opened = [pid], []  # the last check's processes and their open files
        self.disk_share, self.counted = 0.0, 0.0  # of the last disk count, and when it was
        self.braked = {pid}  # reniced (`brake`); the root, `unshare` or the supervisor, never is:
        # it kills the rest at the deadline and must not be slowed
        if disk is not None:
            try:
                self.events = DirEvents()
            except (OSError, AttributeError):
                pass

    def fileno(self) -> int | None:
        """A descriptor that turns readable when the code writes (None: poll only)."""
        return None if self.events is None else self.events.fd

    def woken(self) -> str | None:
        """The code wrote: count the disk at once, without the process scan. A full check reads
        every process's /proc/PID/stat, tens of ms on a loaded machine, while page-cache writes
        went on at a GiB/s (150 MiB against 64 were written between two checks); a count walks
        only the call's directory. Below half the limit, counts are at most FAST apart."""
        self.events.drain()
        if self.disk_share < 0.5 and time.monotonic() - self.counted < FAST:
            self.next = min(self.next, self.counted + FAST)  # the full check counts it soon
            return None
        limit = self._disk(self.tree, self.opened)
        if self.disk_share > 0.5:
            self._brake(self.tree)
            self.next = min(self.next, self.last + FAST)  # and the open files with it
        return limit

    def close(self) -> None:
        if self.events is not None:
            self.events.close()

    def _disk(self, tree: list[int], opened: list) -> str | None:
        """The disk total broken, if any; sets `disk_share`, the largest share of a limit used."""
        if self.disk is None:
            return None
        self.counted = time.monotonic()
        root, limit, max_entries = self.disk
        count = disk_usage(root, max_entries, self.events and self.events.add)
        used, entries = count.used + unlinked_files(tree, opened, root), count.entries
        self.peak_disk = max(self.peak_disk, used)
        self.disk_share = max(used / limit, entries / max_entries)
        if used > limit:
            return f"the call wrote {used >> 20} MiB (limit {limit >> 20} MiB for all its files)"
        if entries > max_entries:
            return f"the call made more than {max_entries} files and directories (the limit)"
        if count.too_deep:
            return f"the call nested directories deeper than {MAX_DEPTH} levels (the limit)"
        return None

    def _brake(self, tree: list[int]) -> None:
        """Brake the processes not braked yet (the others' children inherit it)."""
        new = [pid for pid in tree if pid not in self.braked]
        brake(new)
        self.braked.update(new)

    def due(self) -> float:
        """Seconds until the next check (0: now)."""
        return max(0.0, self.next - time.monotonic())

    def check(self) -> str | None:
        self.last = time.monotonic()
        self.tree = tree = process_tree(self.pid)
        resident = sum(map(private_memory, tree))
        root = self.disk[0] if self.disk is not None else None
        self.opened = opened = [open_files_of(pid, root) for pid in tree]
        listed = namespace_sockets(tree[-1]) if self.own_network else None
        buffers = kernel_buffers(opened, self.open_files, listed, self.in_flight)
        memory = resident + buffers
        self.peak_memory = max(self.peak_memory, memory)
        if memory > self.memory_bytes:
            return (
                f"the call's processes held {memory >> 20} MiB of memory together, {buffers >> 20} MiB of it "
                f"in socket and pipe buffers (limit {self.memory_bytes >> 20} MiB for all of them)"
            )
        limit = self._disk(tree, opened)
        if limit:
            return limit
        self.interval = SLOW
        if max(self.disk_share, memory / self.memory_bytes) > 0.5:
            self._brake(tree)
            self.interval = FAST
        self.next = time.monotonic() + self.interval
        return None
