"""A run's processes live and die together (stdlib only; Linux, other POSIX degrade gracefully).

- `RunLock`: one trainer per run directory (an `flock` held by global rank 0; a second trainer
  gets `RunDirLocked` naming the owner). `run_locks` also locks an outside checkpoint directory.
- `die_with_launcher`: each rank dies when its launcher dies (parent-death signal, and a watcher
  thread on `MEGATRON_STEPWISE_LAUNCHER_PID`).
- `tagged_ray_instance`: around rank 0's local `ray.init`; a reaper kills whatever the driver
  started once the driver is gone.

Why each is needed (torchrun's sessions, Ray's lingering agents): docs/launch.md,
'One trainer per run directory; the run dies with its launcher'.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

from megatron_stepwise.errors import UserError
from megatron_stepwise.rundir.paths import LOCK, RunDir

LOCK_NAME = LOCK
LOCK_WAIT_S = 5.0  # how long `train` retries a held lock before refusing
LAUNCHER_PID_ENV = "MEGATRON_STEPWISE_LAUNCHER_PID"
RUN_DIR_ENV = "MEGATRON_STEPWISE_RUN_DIR"  # a marker in every process of a run (tests find them by it)
_PR_SET_PDEATHSIG = 1


class RunDirLocked(UserError):
    """Another live trainer holds the run directory; the message names it."""


def _describe(owner: dict) -> str:
    if not owner:
        return "another process (no owner recorded yet)"
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, started {when}"


class RunLock:
    """Exclusive lock on a run directory, held until `release()` or the holder's death."""

    def __init__(self, run_dir: str, what: str = "run directory", key: str = "logging.run_dir"):
        self.run_dir = run_dir
        self.path = str(RunDir(run_dir).lock)
        self.what, self.key = what, key  # for the message: what the directory is, the key that sets it
        self._fd: Optional[int] = None

    def read_owner(self) -> dict:
        try:
            with open(self.path) as f:
                return json.loads(f.read() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self, wait: float = 0.0, record: bool = True) -> "RunLock":
        """Take the lock; retry for up to `wait` seconds (a holder just killed is still exiting)."""
        import fcntl

        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
            os.close(fd)
            raise RunDirLocked(
                f"{self.what} {os.path.abspath(self.run_dir)} is in use by another trainer: "
                f"{_describe(self.read_owner())} (lock {self.path}); stop that run first, or set "
                f"{self.key} to another directory"
            ) from None
        if record:
            owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        self._fd = fd
        return self

    def probe(self, wait: float = 0.0) -> None:
        """Raise `RunDirLocked` if a live trainer holds the directory; hold nothing."""
        self.acquire(wait, record=False).release(keep_record=True)

    def release(self, keep_record: bool = False) -> None:
        if self._fd is None:
            return
        if not keep_record:
            try:
                os.ftruncate(self._fd, 0)  # the record describes only a live holder
            except OSError:
                pass
        os.close(self._fd)  # drops the flock
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def run_locks(run_dir: str, checkpoint_dir: str) -> list[RunLock]:
    """The locks a trainer holds: its run directory's, and its checkpoint directory's when that is
    not the run directory itself (one lock file cannot be taken twice)."""
    locks = [RunLock(run_dir)]
    if os.path.realpath(checkpoint_dir) != os.path.realpath(run_dir):
        locks.append(RunLock(checkpoint_dir, "checkpoint directory", "checkpoint.dir"))
    return locks


class HeldLocks:
    """Several `RunLock`s taken in order and released together; none is kept if one is refused."""

    def __init__(self, locks: list[RunLock]):
        self.locks = locks

    def acquire(self, wait: float = 0.0) -> "HeldLocks":
        try:
            for lock in self.locks:
                lock.acquire(wait)
        except BaseException:
            self.release()
            raise
        return self

    def probe(self, wait: float = 0.0) -> None:
        for lock in self.locks:
            lock.probe(wait)

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    """`pid` exists and has not exited (a zombie, killed but not yet reaped by its parent, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc: existence is all we know


def watch_pid(pid: int, interval: float = 1.0) -> threading.Thread:
    """Daemon thread: SIGKILL this process once `pid` no longer exists."""

    def run() -> None:
        while _alive(pid):
            time.sleep(interval)
        print(
            f"launcher (pid {pid}) is gone: training rank {os.environ.get('RANK', '?')} exits",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)

    t = threading.Thread(target=run, name="launcher-watch", daemon=True)
    t.start()
    return t


def die_with_launcher() -> None:
    """Called first thing in every training rank (see the module docstring)."""
    parent = os.getppid()
    if set_parent_death_signal() and os.getppid() != parent:  # the parent died before prctl
        os.kill(os.getpid(), signal.SIGKILL)
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if launcher.isdigit() and int(launcher) > 1:
        if not _alive(int(launcher)):
            os.kill(os.getpid(), signal.SIGKILL)
        watch_pid(int(launcher))


# --- Processes a local Ray instance leaves behind -------------------------------------------
# Ray gives raylet and GCS the parent-death signal of the process that called ray.init, and its
# workers exit with their raylet; but its agents (ray::DashboardAgent, the runtime-env agent)
# only poll for the raylet and then try to report to the dead GCS, and were seen alive 30 s after
# rank 0 was SIGKILLed. So the driver tags its instance (an environment variable the raylet
# passes on to its workers; the agents do not keep it) and a small reaper, in a session of its
# own, records the driver's process tree twice a second and, once the driver is gone, SIGKILLs
# every process of that tree (same pid and start time) and every process carrying the tag.
RAY_OWNER_ENV = "MEGATRON_STEPWISE_RAY_OWNER"

_REAPER = r"""
import os, signal, sys, time
driver, tag = int(sys.argv[1]), sys.argv[2].encode()
def stat(pid):  # (state, parent, start time) or None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), fields[19]
    except (OSError, IndexError, ValueError):
        return None
def snapshot():  # {pid: start time} of the driver's descendants
    table = {int(n): stat(n) for n in os.listdir("/proc") if n.isdigit()}
    found, todo = {}, [driver]
    while todo:
        parent = todo.pop()
        for pid, st in table.items():
            if st and st[1] == parent and pid not in found:
                found[pid] = st[2]
                todo.append(pid)
    return found
tree = {}
while (stat(driver) or "Z")[0] not in ("Z", "X"):
    tree.update(snapshot())  # Ray's agents drop the tag: remember the driver's process tree too
    time.sleep(0.5)
me = os.getpid()
for _ in range(3):  # a process starting during the sweep is caught by the next one
    for pid, started in tree.items():
        if pid != me and (stat(pid) or (0, 0, None))[2] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if tag in f.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.5)
"""


_ray_tag: Optional[str] = None


@contextlib.contextmanager
def tagged_ray_instance():
    """Around a local `ray.init`: the Ray processes it starts carry this driver's tag, and a
    reaper (one per driver) kills them once this process is gone, however it ends (Linux only;
    elsewhere a no-op). The driver's own later subprocesses are not tagged."""
    global _ray_tag
    if not os.path.isdir("/proc/self"):
        yield
        return
    if _ray_tag is None or not _ray_tag.startswith(f"{os.getpid()}:"):  # none yet, or a fork's
        import subprocess
        import uuid

        _ray_tag = f"{os.getpid()}:{uuid.uuid4().hex}"
        env = {k: v for k, v in os.environ.items() if k != RAY_OWNER_ENV}
        subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, str(os.getpid()), f"{RAY_OWNER_ENV}={_ray_tag}"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    previous = os.environ.get(RAY_OWNER_ENV)
    os.environ[RAY_OWNER_ENV] = _ray_tag
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RAY_OWNER_ENV, None)
        else:
            os.environ[RAY_OWNER_ENV] = previous


def run_torchrun(argv: list[str]) -> int:
    """torchrun in this process (the `train` and `replay` self-launchers); when a rank fails, its exit
    code and one line instead of torchrun's own traceback (the rank has already said why)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from megatron_stepwise.rundir.torchrun import register

    register()  # the bound-static rendezvous (rundir/torchrun.py) the self-launchers use
    try:
        run(parse_args(argv))
    except (SignalException, KeyboardInterrupt) as e:  # Ctrl-C: the ranks said where the run resumes
        sig = getattr(e, "sigval", signal.SIGINT)
        return 128 + int(sig)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        if failure.exitcode == 128 + signal.SIGINT:  # the ranks were interrupted and said so
            return failure.exitcode
        print(
            f"error: {len(e.failures)} training rank(s) failed (first: rank {rank}, exit code "
            f"{failure.exitcode}); see their messages above",
            file=sys.stderr,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def first_failure(failures: dict) -> tuple:
    """(rank, failure) of the rank that failed by itself, not one torchrun stopped afterwards
    (negative exit code: a signal); ties go to the earliest, then the lowest rank."""
    return min(failures.items(), key=lambda item: (item[1].exitcode <= 0, item[1].timestamp, item[0]))
