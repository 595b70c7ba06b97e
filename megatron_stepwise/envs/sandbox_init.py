"""The first code that runs inside the sandbox: confine this process, then run the model's code.

Started by `sandbox.py` as `python -I -S -B -c <this file> CONFIG_JSON` inside the namespaces
`unshare` made; standard library only, so self-contained on purpose. Before one byte of model
code runs it mounts the tmpfs and drops capabilities, sets resource limits, sets no-new-privileges,
applies Landlock and seccomp, then executes the code as `__main__`. Exit code 120 means the
sandbox could not be set up; the status pipe (`status_fd`) tells the parent which it was, and is
closed before the code runs so the code cannot forge a setup failure.

Each layer in detail: docs/security.md, 'Inside the sandbox: the setup order'.
"""

import ctypes
import json
import os
import resource
import sys

SETUP_FAILED = 120

# linux/landlock.h (the syscall numbers are the same on every architecture)
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2
_PR_SET_NO_NEW_PRIVS = 38
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_ABI1 = (1 << 13) - 1  # execute .. make_sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # rights a file rule may hold


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (or it is disabled)."""
    try:
        abi = _libc().syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(0, int(abi))


def apply_landlock(read_only: list, read_write: list, connect_ports=()) -> int:
    """Restrict this process (and its future children) as described in the module docstring;
    TCP (ABI >= 4): no bind, connect only to `connect_ports`.

    Returns the ABI used (0: Landlock unavailable, nothing restricted).
    """
    abi = landlock_abi()
    if abi == 0:
        return 0
    libc = _libc()
    fs = (
        FS_ALL_ABI1
        | (FS_REFER if abi >= 2 else 0)
        | (FS_TRUNCATE if abi >= 3 else 0)
        | (FS_IOCTL_DEV if abi >= 5 else 0)
    )
    net = (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # older kernels refuse fields they do not know
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for paths, access in ((read_only, READ_ONLY), (read_write, fs)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except (FileNotFoundError, PermissionError):
                    continue  # e.g. /lib64 on a distribution without it; a path this uid cannot reach anyway
                try:
                    allowed = access & fs
                    if not os.path.isdir(path):
                        allowed &= FILE_ONLY
                    rule = _PathBeneathAttr(allowed, fd)
                    if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)):
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
                finally:
                    os.close(fd)
        for port in connect_ports if net else ():
            rule = _NetPortAttr(NET_CONNECT_TCP, int(port))
            if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_NET_PORT, ctypes.byref(rule), ctypes.c_uint32(0)):
                raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for TCP port {port}")
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)):
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi


# Seccomp (classic BPF over struct seccomp_data: nr at 0, arch at 4, args from 16).
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_EACCES = 0x7FFF0000, 0x00050000 | 13
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ARCHES = {  # machine -> (AUDIT_ARCH, socket, io_uring_setup, first x32 syscall or None)
    "x86_64": (0xC000003E, 41, 425, 0x40000000),
    "aarch64": (0xC00000B7, 198, 425, None),
}
_KEY_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}  # add_key, request_key, keyctl
# memfd_create, memfd_secret, shmget: memory no process needs to map, so no RSS the watch can sum
_UNMAPPED_MEMORY_SYSCALLS = {"x86_64": (319, 447, 29), "aarch64": (279, 447, 194)}
# setsockopt and fcntl: what grows a socket's buffers or a pipe past the kernel's default
_BUFFER_SYSCALLS = {"x86_64": (54, 72), "aarch64": (208, 25)}
_SENDMSG_SYSCALLS = {"x86_64": (46, 307), "aarch64": (211, 269)}  # sendmsg, sendmmsg: carry descriptors
# setsid: a new session is a new scheduler autogroup, where the code's niceness no longer ranks it
# below its watcher (with autogroups on, nice only orders processes within one group)
_SESSION_SYSCALLS = {"x86_64": (112,), "aarch64": (157,)}
_SOL_SOCKET, _BUFFER_OPTIONS = 1, (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE
_F_SETPIPE_SZ = 1031
_KEYCTL_JOIN_SESSION_KEYRING = 1
_AF_INET, _AF_INET6 = 2, 10


def new_session_keyring() -> bool:
    """Join a fresh anonymous session keyring, so the keys of the trainer's session (PAM,
    systemd, Kerberos) are not this process's; False where the kernel has no keyrings. The key
    syscalls are denied afterwards (`deny_sockets`), so this is depth, not the only layer."""
    nr = _KEY_SYSCALLS.get(os.uname().machine)
    if nr is None:
        return False
    return _libc().syscall(nr[2], _KEYCTL_JOIN_SESSION_KEYRING, None) >= 0


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def deny_sockets(allow_inet: bool = False) -> bool:
    """Seccomp: socket(), io_uring_setup, the key syscalls, memfd_create, memfd_secret, shmget and
    growing a buffer (SO_SNDBUF/SO_RCVBUF, F_SETPIPE_SZ) fail with EACCES; False if unsupported
    here. `allow_inet` (an agent command) lets socket() make AF_INET/AF_INET6 sockets only: those
    reach its own network namespace (or, without one, what Landlock's TCP rule allows), never a
    pathname unix socket of the host.

    Model code has no use for sockets, and each other layer leaves some open: a network namespace
    does not cover pathname unix sockets (the trainer's Ray sockets, when it is not root), Landlock
    (ABI <= 7) covers neither those nor UDP, and either may be missing. socketpair() stays allowed
    (an unconnected pair: asyncio's event loop makes one). io_uring is denied because it creates
    sockets without the socket() syscall; on x86_64 the 32-bit and x32 entry points are denied
    wholesale, since their syscall numbers differ. A memfd or SysV segment holds memory without
    being mapped (write() fills it), where the trainer's memory watch, which sums resident
    memory, sees none of it; the standard library needs neither (files go to the call's tmpfs).
    Unread socket and pipe data is such memory too: the watch counts each socket and pipe at its
    capacity (`sandbox_watch.kernel_buffers`), which holds only while the code cannot raise it.
    Model code may not call sendmsg/sendmmsg (the standard library sends with send/sendto): no
    descriptor can then be put in flight, held by no process where the watch would look for it.
    Nor may it call setsid: its own session would be its own autogroup, out of reach of its niceness.
    """
    machine = os.uname().machine
    arch = _ARCHES.get(machine)
    if arch is None:
        return False
    audit_arch, socket_nr, io_uring_nr, x32 = arch
    setsockopt_nr, fcntl_nr = _BUFFER_SYSCALLS[machine]
    # (code, k, jump-if-true label, jump-if-false label), or a label's name where it stands;
    # labels None (the next instruction), "allow", "deny" or a name in the program.
    prog = [(_LD_W_ABS, 4, None, None), (_JEQ_K, audit_arch, None, "deny"), (_LD_W_ABS, 0, None, None)]
    if x32 is not None:
        prog.append((_JGE_K, x32, "deny", None))
    denied = _KEY_SYSCALLS[machine] + _UNMAPPED_MEMORY_SYSCALLS[machine] + _SESSION_SYSCALLS[machine]
    if not allow_inet:
        denied += _SENDMSG_SYSCALLS[machine]
    prog += [(_JEQ_K, nr, "deny", None) for nr in denied]
    prog.append((_JEQ_K, io_uring_nr, "deny", None))
    prog += [(_JEQ_K, setsockopt_nr, "setsockopt", None), (_JEQ_K, fcntl_nr, "fcntl", None)]
    if allow_inet:  # socket(domain, ...): args[0]'s low word, at offset 16 (little-endian)
        prog += [(_JEQ_K, socket_nr, None, "allow"), (_LD_W_ABS, 16, None, None), (_JEQ_K, _AF_INET, "allow", None)]
        prog.append((_JEQ_K, _AF_INET6, "allow", "deny"))
    else:
        prog.append((_JEQ_K, socket_nr, "deny", "allow"))
    # setsockopt(fd, level, optname, ...): level at offset 24, optname at 32
    prog += [
        "setsockopt",
        (_LD_W_ABS, 24, None, None),
        (_JEQ_K, _SOL_SOCKET, None, "allow"),
        (_LD_W_ABS, 32, None, None),
    ]
    *others, last = _BUFFER_OPTIONS
    prog += [(_JEQ_K, option, "deny", None) for option in others] + [(_JEQ_K, last, "deny", "allow")]
    prog += ["fcntl", (_LD_W_ABS, 24, None, None), (_JEQ_K, _F_SETPIPE_SZ, "deny", "allow")]
    prog += ["allow", (_RET_K, _RET_ALLOW, None, None), "deny", (_RET_K, _RET_EACCES, None, None)]
    where, insns = {}, []
    for step in prog:
        if isinstance(step, str):
            where[step] = len(insns)
        else:
            insns.append(step)
    rel = lambda i, label: 0 if label is None else where[label] - i - 1  # noqa: E731
    filters = (_SockFilter * len(insns))(
        *(_SockFilter(code, rel(i, jt), rel(i, jf), k) for i, (code, k, jt, jf) in enumerate(insns))
    )
    fprog = _SockFprog(len(insns), filters)
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
    return True


_MS_NOSUID, _MS_NODEV = 2, 4


def mount_quota(path: str, size_bytes: int, inodes: int) -> None:
    """A tmpfs of `size_bytes` and `inodes` files and directories over the call's directory, in
    this call's own mount namespace: the kernel's total for everything the code writes (ENOSPC
    past it). Needs CAP_SYS_ADMIN in the user namespace owning the mount namespace, which is why
    the code starts as the namespace's root and drops every capability right after."""
    opts = f"size={size_bytes},nr_inodes={inodes},mode=0700".encode()
    if _libc().mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts):
        raise OSError(ctypes.get_errno(), f"mounting the call's tmpfs on {path} failed")
    os.chdir(path)  # the old cwd is the directory under the mount


_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Bring this network namespace's `lo` up (a new one starts with it down)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def hand_over_listener(fd: int, port: int) -> None:
    """Listen on this namespace's 127.0.0.1:`port` and send the socket over `fd` (a unix socket)
    to the trainer, whose gateway accepts on it: the command's one way out, relayed by nobody."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener, socket.socket(fileno=fd) as channel:
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        socket.send_fds(channel, [b"listening"], [listener.fileno()])


def run_command(argv: list, as_init: bool) -> None:
    """Run the agent command (this process confined already): as the PID namespace's init, fork
    it and reap everything until it exits, then exit with its status (every process left dies
    with the namespace); without one (the supervisor forked already), become it."""
    if as_init:
        child = os.fork()
        if child:
            while True:
                pid, status = os.wait()
                if pid == child:
                    os._exit(
                        os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
                    )
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"cannot run {argv[0]!r}: {e}", file=sys.stderr)
        os._exit(127)


_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# noroot, no_setuid_fixup and no_cap_ambient_raise set, keep_caps clear, each locked
_SECUREBITS = 0b11101111
_CAP_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def capabilities() -> int:
    """This process's effective capability set as a bit mask."""
    data = (_CapData * 2)()
    if _libc().capget(ctypes.byref(_CapHeader(_CAP_VERSION_3, 0)), data):
        raise OSError(ctypes.get_errno(), "capget failed")
    return data[0].effective | data[1].effective << 32


def drop_capabilities() -> None:
    """Lose every capability for good (also across execve: bounding set empty, root gets nothing
    back). The code starts as root of its user namespace only to mount its tmpfs."""
    if not capabilities():
        return  # nothing to drop: the bounding set only matters to who can regain, and NO_NEW_PRIVS holds
    libc = _libc()
    try:
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
    except (OSError, ValueError):
        last = 63
    if libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECUREBITS) failed")
    for cap in range(last + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0):
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap}) failed")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before Linux 4.3: none to clear
    if libc.capset(ctypes.byref(_CapHeader(_CAP_VERSION_3, 0)), (_CapData * 2)()):
        raise OSError(ctypes.get_errno(), "capset failed")
    if capabilities():
        raise OSError("capabilities are still held after dropping them")


def set_limits(cfg: dict) -> None:
    for name, value in (
        ("RLIMIT_AS", cfg["memory_bytes"]),
        ("RLIMIT_CPU", cfg["cpu_seconds"]),
        ("RLIMIT_FSIZE", cfg["file_bytes"]),
        ("RLIMIT_NPROC", cfg["processes"]),
        ("RLIMIT_NOFILE", cfg["open_files"]),
        ("RLIMIT_CORE", 0),
        ("RLIMIT_NICE", 0),  # no niceness below the one it has: the watch's brake holds
    ):
        resource.setrlimit(getattr(resource, name), (value, value))
    # The code runs at the trainer's priority until it nears a limit, when its watch renices it
    # (`sandbox_watch.brake`); it cannot climb back: RLIMIT_NICE is 0 and it has no CAP_SYS_NICE.


_PR_SET_CHILD_SUBREAPER = 36


def supervise(timeout_s: float, status_fd=None) -> None:
    """Without a PID namespace: fork; the child returns and runs the code, this process stays
    outside the code's Landlock domain (so the code cannot signal it) as the subreaper of
    everything the code starts, and when the code exits, times out or this process gets SIGTERM
    (from the trainer, at the output cap), kills every process the code left behind.
    A PID namespace gives the same for free: its processes die with its init."""
    if _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    child = os.fork()
    if child == 0:
        return
    if status_fd is not None:
        os.close(status_fd)  # the child reports; this process outlives the code and must not hold it
    import select
    import signal
    import time

    def end(status: int) -> None:
        kill_descendants()
        os._exit(status)

    signal.signal(signal.SIGTERM, lambda *_: end(128 + signal.SIGTERM))
    deadline = time.monotonic() + timeout_s
    pidfd = os.pidfd_open(child)
    while not select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        if time.monotonic() >= deadline:
            end(128 + signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    end(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def kill_descendants() -> None:
    """SIGKILL this process's children until there are none; orphans of killed children are
    reparented here (the subreaper), so grandchildren in other sessions are found too."""
    import signal

    me = os.getpid()
    while True:
        for pid in _children_of(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _children_of(parent: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2 :].split()
            if len(fields) > 1 and int(fields[1]) == parent:
                found.append(int(entry))
    return found


def _report(fd, message: str) -> None:
    if fd is not None:
        try:
            os.write(fd, message.encode("utf-8", "replace")[:4096])
        finally:
            os.close(fd)


def main() -> None:
    status = None
    try:
        cfg = json.loads(sys.argv[1])
        status = cfg.get("status_fd")
        if cfg.get("supervise"):
            supervise(cfg["timeout_s"], status)
        argv = cfg.get("argv")  # an agent command, else model code
        source = None if argv else open(cfg["code_path"]).read()
        if cfg.get("tmpfs_bytes"):
            mount_quota(cfg["read_write"][0], cfg["tmpfs_bytes"], cfg["tmpfs_inodes"])
        if cfg.get("cwd"):
            os.chdir(cfg["cwd"])
        if cfg.get("listen_port"):
            loopback_up()
            hand_over_listener(cfg["listen_fd"], cfg["listen_port"])
        drop_capabilities()
        set_limits(cfg)
        abi = apply_landlock(cfg["read_only"], cfg["read_write"], cfg.get("connect_ports", ()))
        if cfg.get("require_landlock") and abi == 0:
            raise OSError("Landlock is required but the kernel has none")
        new_session_keyring()
        deny_sockets(allow_inet=bool(argv))
    except BaseException as e:  # noqa: BLE001 - reported as a sandbox failure, never run unconfined
        message = f"sandbox setup failed: {type(e).__name__}: {e}"
        print(message, file=sys.stderr)
        _report(status, message)
        sys.exit(SETUP_FAILED)
    _report(status, "ok")  # and closed: nothing the code does can write to it
    if argv:
        run_command(argv, as_init=not cfg.get("supervise"))
    code = compile(source, "<model code>", "exec")  # a SyntaxError is the model's: traceback, exit 1
    sys.argv = ["<model code>"]
    del cfg, source
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
