"""Run untrusted model-written Python isolated from the trainer (guarantees: docs/security.md).

Layers, each of which holds on its own: namespaces (`unshare`, probed once), `sandbox_init.py`
(tmpfs, capabilities, resource limits, no-new-privileges, Landlock, seccomp), and this module (a
fresh environment, capped output, totals watched, the whole process tree SIGKILLed at the end
and the call's directory removed). Only the code and an empty working directory reach the
sandbox: no environment variable, file or argument carries the trainer's state or an answer.

What each layer does and why (no `preexec_fn`, reaping, output caps): docs/security.md,
'The sandbox' and 'The sandbox's layers'.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:
    from megatron_stepwise.errors import UserError
except ModuleNotFoundError:  # loaded by file path, standard library only (the hostile corpus runs it as nobody)

    class UserError(Exception):
        """Stands in for `megatron_stepwise.errors.UserError` where the package cannot be imported."""


try:
    from .sandbox_watch import Watch, children_by_parent
except ImportError:  # loaded by path (tests/sandbox_corpus.py, run by an unprivileged user): the sibling file
    import importlib.util as _util

    _spec = _util.spec_from_file_location("sandbox_watch", Path(__file__).with_name("sandbox_watch.py"))
    _watch = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_watch)
    Watch, children_by_parent = _watch.Watch, _watch.children_by_parent

log = logging.getLogger(__name__)

INIT = Path(__file__).with_name("sandbox_init.py")
SETUP_FAILED = 120  # sandbox_init.py's exit code when it could not confine itself

# Namespace flags per isolation level; `--kill-child` also ends the namespace if unshare dies.
_NS = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
# The code starts as the user namespace's root (mapped to the trainer's uid, or nobody) to mount
# its tmpfs, then drops every capability before anything else (sandbox_init.drop_capabilities).
_UNSHARE_USERNS = ["--user", "--map-root-user", *_NS]


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    output_truncated: bool = False  # stdout or stderr hit the cap and the code was stopped there
    limit: str = ""  # the per-call total the code broke and was stopped for ("" if none)

    def as_observation(self, max_chars: int = 500) -> str:
        if self.limit:
            return f"Error: stopped: {self.limit}"
        if self.timed_out:
            return "Error: timed out"
        text = self.stdout
        if self.output_truncated:
            return (text[:max_chars] + " [output truncated]").strip()
        if self.returncode != 0:  # the last stderr line is the exception message
            lines = self.stderr.strip().splitlines()
            text += lines[-1] if lines else f"Error: exit code {self.returncode}"
        return text.strip()[:max_chars]


class SandboxError(UserError, RuntimeError):
    """The sandbox could not be set up (never: the code failed; that is a normal result)."""


SANDBOX_UID = 65534  # "nobody": the sandbox's uid when the trainer runs as root

# Run by the chosen interpreter as the sandbox's user: what it can import and whether the kernel
# has Landlock (the syscall returns the ABI version when asked with flag 1).
_PROBE = """
import ctypes, json, os, sys, sysconfig
paths = sysconfig.get_paths()
try:
    abi = max(0, ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
except Exception:
    abi = 0
tmpfs = False
if sys.argv[1:] == ["tmpfs"]:  # only ever inside a private mount namespace
    libc = ctypes.CDLL(None, use_errno=True)
    tmpfs = libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 6, b"size=1m,nr_inodes=16") == 0
print(json.dumps({"tmpfs": tmpfs, "stdlib": sorted({paths["stdlib"], paths["platstdlib"],
                                    os.path.join(paths["platstdlib"], "lib-dynload")}),
                  "executable": os.path.realpath(sys.executable), "landlock_abi": abi}))
"""


@dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox use (probed once per process)."""

    namespaces: str  # "user" (user+pid+net+ipc+uts), "root" (the same without a user ns), "none"
    landlock_abi: int  # 0 = no Landlock
    run_as: tuple[str, ...]  # the setpriv prefix that drops root to SANDBOX_UID; () when not root
    python: str  # the interpreter binary the sandbox runs
    stdlib: tuple[str, ...]  # its standard library, the only code the sandbox may read
    unshare: tuple[str, ...] = ()  # the unshare command and flags, () without namespaces
    tmpfs: bool = False  # each call gets a size-limited tmpfs in its own mount namespace

    def describe(self) -> str:
        ns = {"user": "user/pid/net namespaces", "root": "pid/net namespaces", "none": "no namespaces"}
        who = f"uid {os.geteuid()}"
        if self.run_as:
            who = f"uid {SANDBOX_UID}" if self.namespaces != "none" else f"one of uids {UID_POOL.start}.."
        disk = "tmpfs" if self.tmpfs else "watched"
        return (
            f"{ns[self.namespaces]}, Landlock ABI {self.landlock_abi or 'unavailable'}, runs as {who}, "
            f"disk quota {disk}"
        )


def _probe(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return None


@functools.lru_cache(maxsize=1)
def isolation() -> Isolation:
    """The strongest setup that runs here: as nobody before as root, namespaces before none.

    Each candidate is probed exactly as the sandbox will run it (same prefix, same interpreter).
    """
    drop: tuple[str, ...] = ()
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv:
        # Root is exempt from RLIMIT_NPROC and owns most files: the code runs as nobody instead.
        drop = (setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups")
    # A venv's bin/python links to its base interpreter; the venv (site-packages) stays unreadable.
    pythons = dict.fromkeys(
        p
        for p in (
            os.path.realpath(sys.executable),
            os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
            shutil.which("python3", path="/usr/bin:/bin"),
        )
        if p
    )
    unshare = shutil.which("unshare")
    for run_as in (drop, ()) if drop else ((),):
        namespaces, prefix = "none", []
        for level, flags in (("user", _UNSHARE_USERNS), ("root", _NS)):
            if unshare is None or (level == "root" and (os.geteuid() != 0 or run_as)):
                continue  # without a user namespace only real root may unshare
            done = _probe([*run_as, unshare, *flags, "true"])
            if done is not None and done.returncode == 0:
                namespaces, prefix = level, [unshare, *flags]
                break
        for python in pythons:
            done = _probe([*run_as, *prefix, python, "-I", "-S", "-B", "-c", _PROBE, *(["tmpfs"] if prefix else [])])
            if done is None or done.returncode != 0:
                continue
            facts = json.loads(done.stdout)
            found = Isolation(
                namespaces,
                int(facts["landlock_abi"]),
                tuple(run_as),
                python,
                tuple(facts["stdlib"]),
                tuple(prefix),
                bool(facts["tmpfs"]),
            )
            if namespaces != "user" or found.landlock_abi < 6 or not found.tmpfs or (os.geteuid() == 0 and not run_as):
                log.warning("sandbox degraded: %s; see docs/security.md for what holds without them", found.describe())
            return found
    raise SandboxError(f"sandbox: none of the interpreters {list(pythons)} can run a probe script")


_PACKAGE_DIRS = ("site-packages", "dist-packages")


@functools.lru_cache(maxsize=4)
def readable_paths(iso: Isolation) -> list[str]:
    """What the code may read and execute: the interpreter and its standard library, system dirs.

    Never the project, any site-packages or dist-packages (a conda, pyenv or Docker python's
    standard library directory holds its site-packages, and /usr/lib Debian's dist-packages: a
    non-editable install would expose the shipped datasets), datasets, /proc, /etc or /home.
    """
    grants = [g for path in (*iso.stdlib, "/usr/lib", "/usr/lib64", "/lib", "/lib64") for g in _grants(path, 3)]
    return sorted({*grants, iso.python, "/usr/bin", "/bin", "/dev/null", "/dev/zero", "/dev/urandom"})


def _grants(path: str, depth: int) -> list[str]:
    """`path` itself, or, when a package directory lies within `depth` levels under it, its
    entries one by one with the package directories left out (Landlock grants whole trees)."""
    path = os.path.realpath(path)  # a rule on a link grants its target (/lib -> usr/lib)
    if os.path.basename(path) in _PACKAGE_DIRS:
        return []
    if depth == 0 or not os.path.isdir(path):
        return [path]
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return [path]
    # Links need no rule of their own (Landlock checks where they lead), and one would grant
    # their target, which the whole directory's rule did not.
    children = [os.path.join(path, n) for n in names if not os.path.islink(os.path.join(path, n))]
    parts = [g for child in children for g in _grants(child, depth - 1)]
    return [path] if parts == children else parts


def write_code(workdir: str, code: str) -> str:
    """`workdir/main.py` holding `code` as UTF-8. Text the model wrote may hold a lone surrogate
    (a JSON "\\ud800" escape in a tool call): it is written as that escape, so the code fails in
    the sandbox like any other bad code instead of raising UnicodeEncodeError in the trainer."""
    path = os.path.join(workdir, "main.py")
    with open(path, "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(code)
    return path


def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 64 << 10,
    max_processes: int = 16,
    max_file_bytes: int = 1 << 20,
    disk_mb: int = 64,
    max_files: int = 4096,
) -> SandboxResult:
    """Execute `code` in the sandbox; stdout/stderr are each kept up to `max_output_bytes`.

    `memory_mb` bounds the call's processes together (and each one's address space), `disk_mb`
    and `max_files` everything it writes, `max_file_bytes` each file (docs/security.md).
    """
    iso = isolation()
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    status_r = None
    try:
        code_path = write_code(workdir, code)
        with sandbox_uid(iso) as uid:
            run_as = iso.run_as
            if uid is not None:
                os.chown(workdir, uid, uid)  # its only writable place
                run_as = (iso.run_as[0], f"--reuid={uid}", f"--regid={uid}", "--clear-groups")
            cfg = {
                "code_path": code_path,
                "memory_bytes": memory_mb << 20,
                "cpu_seconds": max(1, int(timeout_s) + 1),
                "file_bytes": max_file_bytes,
                "processes": max_processes,
                "open_files": 64,
                "read_only": readable_paths(iso),
                "read_write": [workdir],
                "require_landlock": iso.landlock_abi > 0,
                "supervise": iso.namespaces == "none",
                "timeout_s": timeout_s,
                "tmpfs_bytes": (disk_mb << 20) if iso.tmpfs else 0,
                "tmpfs_inodes": max_files,
            }
            # setup's own report ("ok" or why not), closed before the code runs: the code cannot forge it
            status_r, status_w = os.pipe()
            cfg["status_fd"] = status_w
            env = {
                "PATH": "/usr/bin:/bin",
                "HOME": workdir,
                "TMPDIR": workdir,
                "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
            }
            # The init script goes in as -c text: nothing of the project needs to be readable inside.
            try:
                proc = subprocess.Popen(
                    [*run_as, *iso.unshare, iso.python, "-I", "-S", "-B", "-c", init_source(), json.dumps(cfg)],
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    process_group=0,  # its own group, not session: a session is an autogroup (sandbox_watch.brake)
                    close_fds=True,
                    pass_fds=(status_w,),
                )
            finally:
                os.close(status_w)
            deadline = time.monotonic() + timeout_s
            disk = None if iso.tmpfs else (workdir, disk_mb << 20, max_files)
            # model code cannot send descriptors (sendmsg refused): nothing of it is in flight
            watch = Watch(proc.pid, memory_mb << 20, disk, cfg["open_files"], bool(iso.unshare), in_flight=False)
            try:
                out, err, timed_out, truncated, limit = collect_output(proc, deadline, max_output_bytes, watch)
            finally:
                kill_all(proc, supervised=cfg["supervise"])
            returncode = proc.wait()
        status = read_status(status_r)
    finally:
        if status_r is not None:
            os.close(status_r)
        remove_tree(workdir)
    decode = lambda b: b.decode("utf-8", "replace")  # noqa: E731
    if status.startswith("sandbox setup failed"):
        raise SandboxError(status)
    return SandboxResult(decode(out), decode(err), returncode, timed_out, truncated, limit or "")


# Without namespaces, RLIMIT_NPROC counts every process of a uid: as root each call then runs as
# a uid of its own from this pool, so one call's fork bomb cannot stop a concurrent call's forks.
UID_POOL = range(1_900_000_000, 1_900_000_064)


@contextlib.contextmanager
def sandbox_uid(iso: Isolation):
    """The uid the call runs as (None: the trainer's own), held until the call's processes are gone."""
    if not iso.run_as:
        yield None
        return
    if iso.namespaces != "none":
        yield SANDBOX_UID  # its own user namespace counts its processes apart
        return
    locks = _uid_lock_dir()
    free = [uid for uid in UID_POOL if not _has_user(uid)]
    fd = None
    try:
        for i, uid in enumerate([*free, free[0]] if free else []):
            fd = os.open(os.path.join(locks, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:  # every uid busy (more concurrent calls than the pool): wait for the first one
                fcntl.flock(fd, fcntl.LOCK_EX if i == len(free) else fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                os.close(fd)
                fd = None
        if fd is None:
            raise SandboxError(f"sandbox: every uid of {UID_POOL} belongs to a user of this machine")
        yield uid
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _has_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


@functools.lru_cache(maxsize=1)
def _uid_lock_dir() -> str:
    """Root's own directory for the pool's locks, shared by every trainer process on the machine."""
    parent = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(parent, "megatron-stepwise-sandbox-uids")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if st.st_uid != 0 or st.st_mode & 0o077 or not os.path.isdir(path) or os.path.islink(path):
        raise SandboxError(f"sandbox: {path} must be a directory of root's only (mode 0700); remove it")
    return path


def read_status(fd: int) -> str:
    """What setup reported: "ok", its failure, or "" (it never got that far: killed, timed out)."""
    try:
        os.set_blocking(fd, False)  # every writer is gone by now; never wait on a straggler
        return os.read(fd, 4096).decode("utf-8", "replace")
    except OSError:
        return ""


def remove_tree(root: str) -> None:
    """Delete a call's directory and whatever the code built in it; never raises.

    `shutil.rmtree` recurses (a chain of a few thousand directories makes it raise
    RecursionError) and skips what it may not read (a `chmod 0` directory, as non-root). Here
    no path gets deep: each directory is made accessible, its files unlinked and its
    subdirectories moved into one fresh directory of ours (`trash`) to be emptied in turn. What
    still cannot go is logged, not raised.
    """
    try:
        os.chmod(root, 0o700)
        trash = tempfile.mkdtemp(prefix=".remove-", dir=root)  # a name the code cannot have taken
        pending, moved = [root], 0
        while pending:
            path = pending.pop()
            os.chmod(path, 0o700)
            with os.scandir(path) as entries:
                found = [(e.path, e.is_dir(follow_symlinks=False)) for e in entries]
            for child, is_dir in found:
                if child == trash:
                    continue
                if not is_dir:
                    os.unlink(child)
                    continue
                moved += 1
                target = os.path.join(trash, str(moved))
                os.chmod(child, 0o700)  # moving a directory rewrites its "..": it must be writable
                os.rename(child, target)
                pending.append(target)
            if path != root:
                os.rmdir(path)  # its files are gone and its subdirectories moved out
        os.rmdir(trash)
        os.rmdir(root)
    except OSError as e:
        log.warning("sandbox: could not remove all of %s (%s)", root, e)
        shutil.rmtree(root, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def init_source() -> str:
    return INIT.read_text()


def _selector(pipes, watch: Watch) -> selectors.BaseSelector:
    """The code's pipes, non-blocking, and the watch's wake descriptor (if it has one)."""
    sel = selectors.DefaultSelector()
    for pipe in pipes:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    if watch.fileno() is not None:
        sel.register(watch.fileno(), selectors.EVENT_READ)
    return sel


def collect_output(
    proc: subprocess.Popen, deadline: float, cap: int, watch: Watch, tail: bool = False
) -> tuple[bytes, bytes, bool, bool, str | None]:
    """Read both pipes as data arrives until the code ends, the deadline, a pipe passing `cap`
    bytes or a per-call total broken (`watch`, checked between reads). With `tail`, a pipe
    past `cap` keeps its last `cap` bytes and the code runs on (an agent command's logs).

    Memory held here is at most 2 * cap + one read, whatever the code prints.
    Returns (stdout, stderr, timed out, truncated, the total broken or None).
    """
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = _selector(buffers, watch)
    timed_out = truncated = False
    limit = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not watch.due():
                limit = watch.check()
                if limit:
                    break
            wait = min(left, watch.due())
            if len(sel.get_map()) == (watch.fileno() is not None):  # pipes closed; the code may still run
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            for key, _ in sel.select(wait):
                if key.fileobj == watch.fileno():
                    limit = watch.woken()
                    if limit:
                        break
                    continue
                buf = buffers[key.fileobj]
                chunk = os.read(key.fd, 1 << 16 if tail else min(1 << 16, cap + 1 - len(buf)))
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf += chunk
                if len(buf) > cap:
                    buf[:] = buf[-cap:] if tail else buf[:cap]
                    truncated = True
            if limit or (truncated and not tail):
                break
    finally:
        sel.close()
        watch.close()
        for pipe in buffers:
            pipe.close()
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), timed_out, truncated, limit


def kill_all(proc: subprocess.Popen, supervised: bool) -> None:
    """SIGKILL the PID namespace's init (that ends every process in it) and the process group.

    The init is a child of `unshare`; the code may have left unshare's process group with
    setsid(), so it is found by its parent pid, not by its group. Without namespaces the
    supervisor (sandbox_init.supervise) is asked first, with SIGTERM, to kill what the code
    started, since only it can find processes that left the group.
    """
    if supervised and proc.poll() is None:
        _signal(lambda: os.kill(proc.pid, signal.SIGTERM))
        try:
            proc.wait(timeout=30)  # it kills and reaps, then exits; generous for a loaded machine
        except subprocess.TimeoutExpired:
            pass
    children = _children(proc.pid)
    for pid in children:
        _signal(lambda: os.kill(pid, signal.SIGKILL))
    if children and proc.poll() is None:
        # unshare reaps its child and exits by itself: killed first, it would leave that child a
        # zombie for whichever process reaps orphans (PID 1 in a container may never do it)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    _signal(lambda: os.killpg(proc.pid, signal.SIGKILL))


def _children(pid: int) -> list[int]:
    return children_by_parent().get(pid, [])


def _signal(send) -> None:
    try:
        send()
    except (ProcessLookupError, PermissionError):
        pass
