"""Run a trusted program on untrusted input (an agent command) in the sandbox, with one way out.

The sandbox of `sandbox.py` runs model-written Python with the standard library and no socket.
A command (`python -m my_agent`, a harness) needs more: its interpreter, virtual environment and
code, and a connection to one endpoint. It gets them here, and nothing else of the trainer's:

- its own user, PID, mount, IPC, UTS and network namespaces (as `sandbox.py` probes them), the
  network namespace with only `lo`, up. Inside, before the command starts, `sandbox_init.py`
  listens on the namespace's 127.0.0.1:`BRIDGE_PORT` and hands that socket to the trainer (over
  a unix socket pair, SCM_RIGHTS), whose `serve(socket)` accepts on it: the command's connections
  arrive at the gateway directly, and no other address of any network answers it;
- Landlock: read and execute the system's directories, the interpreter, its virtual environment
  and `sys.path`, `PYTHONPATH`, the working directory and `read_paths`; write only its home (a
  tmpfs of `disk_mb`); TCP: no bind, connect only to its one port;
- seccomp: sockets of AF_INET/AF_INET6 only (no pathname unix socket of the host: Ray's,
  docker's); resource limits, no capabilities, no-new-privileges, a deadline after which its
  whole process tree is killed, memory summed over its processes (`sandbox_watch.Watch`);
- a fresh environment: what the caller passes, PATH (the interpreter's bin first), PYTHONPATH,
  VIRTUAL_ENV, HOME and TMPDIR (its private directory), LANG, and the sample's file
  (`STEPWISE_SAMPLE_FILE`, also its stdin).

Without namespaces (`isolation().namespaces == "none"`) nothing bridges: the command connects to
the trainer's own `connect_port` on the host, which Landlock (ABI >= 4) makes the only TCP port
it may reach; UDP is not restricted there (docs/security.md, 'An agent command').
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron_stepwise.envs.sandbox import (
    SANDBOX_UID,
    Isolation,
    SandboxError,
    collect_output,
    init_source,
    isolation,
    kill_all,
    read_status,
    readable_paths,
    remove_tree,
    sandbox_uid,
)
from megatron_stepwise.envs.sandbox_watch import Watch

log = logging.getLogger(__name__)

BRIDGE_PORT = 8000  # the command's endpoint, on its own network namespace's 127.0.0.1
_SYSTEM_READS = ("/usr/local", "/etc/ssl", "/etc/ca-certificates", "/etc/hosts", "/etc/nsswitch.conf")
_SYSTEM_READS += ("/etc/localtime", "/etc/passwd", "/etc/group", "/etc/alternatives", "/dev/tty")


@dataclass(frozen=True)
class CommandLimits:
    timeout_s: float = 300.0
    memory_mb: int = 4096  # all the command's processes together (and each one's address space)
    processes: int = 256
    open_files: int = 1024
    disk_mb: int = 256  # its home, a tmpfs
    max_files: int = 16384
    output_bytes: int = 1 << 20  # the tail of stdout and of stderr kept, each


@dataclass
class CommandResult:
    stdout: str  # its last `output_bytes`
    stderr: str
    returncode: int
    timed_out: bool
    limit: str = ""  # the per-call total it broke and was stopped for ("" if none)


def bridged(iso: Optional[Isolation] = None) -> bool:
    """Whether a command gets a network namespace of its own (else it reaches the host's TCP)."""
    return (iso or isolation()).namespaces != "none"


@functools.lru_cache(maxsize=1)
def command_isolation() -> Isolation:
    """The sandbox's isolation for commands: as `isolation()`, except that a trainer running as
    root whose interpreter the sandbox's uid cannot read (a python under /root) runs the command
    as root of its own user namespace, every capability dropped (its PID namespace and Landlock
    keep it from the trainer's processes and files); without namespaces that is refused."""
    iso = isolation()
    if not bridged(iso):
        log.warning(
            "env.agent_command runs without namespaces (%s): it shares the host's network, TCP limited "
            "to the gateway's port only with Landlock >= 4; per-trajectory keys still hold (docs/security.md)",
            iso.describe(),
        )
    interpreter = os.path.realpath(sys.executable)
    if iso.run_as and subprocess.run([*iso.run_as, "test", "-r", interpreter], cwd="/").returncode != 0:
        if not bridged(iso):
            raise SandboxError(
                f"env.agent_command: uid {SANDBOX_UID} cannot read the interpreter {interpreter}, and without "
                "namespaces the command cannot run as root's namespace root: install Python where others can read it"
            )
        log.warning(
            "env.agent_command: uid %s cannot read %s; the command runs as its namespace's root",
            SANDBOX_UID,
            interpreter,
        )
        iso = dataclasses.replace(iso, run_as=())
    return iso


def command_environment(extra: dict[str, str]) -> dict[str, str]:
    """What a command needs of the trainer's environment: its interpreter first on PATH, its
    virtual environment and PYTHONPATH (so `python -m my_agent` imports what the trainer does)."""
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return {**env, **extra}


def command_readable_paths(iso: Isolation, cwd: str, read_paths: Sequence[str] = ()) -> list[str]:
    """The sandbox's system grants, and the interpreter's installation, virtual environment,
    `sys.path` and PYTHONPATH entries, the working directory and `read_paths` (existing ones)."""
    interpreter = os.path.realpath(sys.executable)
    paths = [
        *readable_paths(iso),
        *_SYSTEM_READS,
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.dirname(interpreter)),
        *sys.path,
        *os.environ.get("PYTHONPATH", "").split(os.pathsep),
        cwd,
        *read_paths,
    ]
    if bridged(iso):
        paths.append("/proc")  # its own PID namespace's
    return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})


def run_command(
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str,
    sample: dict,
    limits: CommandLimits,
    serve: Optional[Callable[[socket.socket], Callable[[], None]]] = None,
    connect_port: Optional[int] = None,
    read_paths: Sequence[str] = (),
    started: Optional[Callable[[subprocess.Popen], None]] = None,
) -> CommandResult:
    """Run `argv` in `cwd` on `sample` (see the module docstring). With namespaces, `serve` gets
    the listening socket of the command's 127.0.0.1:BRIDGE_PORT and returns how to stop serving
    it; without, the command may connect to `connect_port` of the host. `started(proc)` lets the
    caller kill a run it abandons (`kill_all`). Blocking: run it on a thread of its own."""
    iso = command_isolation()
    if bridged(iso) and serve is None:
        raise ValueError("run_command: a command in its own network namespace needs `serve` for its endpoint")
    calldir = tempfile.mkdtemp(prefix="agent-")
    home = os.path.join(calldir, "home")
    sample_path = os.path.join(calldir, "sample.json")
    os.mkdir(home, 0o700)
    with open(sample_path, "w", encoding="utf-8") as f:
        json.dump(sample, f, default=_plain)
    os.chmod(sample_path, 0o644)
    os.chmod(calldir, 0o711)  # the sample readable by the command's uid, nothing else listable
    try:
        with sandbox_uid(iso) as uid:
            run_as = iso.run_as
            if uid is not None:
                os.chown(home, uid, uid)
                run_as = (iso.run_as[0], f"--reuid={uid}", f"--regid={uid}", "--clear-groups")
            cfg = _init_config(iso, argv, cwd, home, sample_path, limits, connect_port, read_paths)
            env = {**env, "HOME": home, "TMPDIR": home, "STEPWISE_SAMPLE_FILE": sample_path}
            return _run(iso, run_as, cfg, env, cwd, sample_path, limits, serve, started)
    finally:
        remove_tree(calldir)


def _init_config(iso, argv, cwd, home, sample_path, limits, connect_port, read_paths) -> dict:
    return {
        "argv": list(argv),
        "cwd": cwd,
        "memory_bytes": limits.memory_mb << 20,
        "cpu_seconds": max(1, int(limits.timeout_s) + 1),
        "file_bytes": limits.disk_mb << 20,
        "processes": limits.processes,
        "open_files": limits.open_files,
        "read_only": [*command_readable_paths(iso, cwd, read_paths), sample_path],
        "read_write": [home],
        "require_landlock": iso.landlock_abi > 0,
        "supervise": not bridged(iso),
        "timeout_s": limits.timeout_s,
        "tmpfs_bytes": (limits.disk_mb << 20) if iso.tmpfs else 0,
        "tmpfs_inodes": limits.max_files,
        "listen_port": BRIDGE_PORT if bridged(iso) else 0,
        "connect_ports": [BRIDGE_PORT] if bridged(iso) else [p for p in (connect_port,) if p],
    }


def _run(iso, run_as, cfg, env, cwd, sample_path, limits, serve, started) -> CommandResult:
    status_r, status_w = os.pipe()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    cfg.update(status_fd=status_w, listen_fd=theirs.fileno())
    stop_serving, no_listener = None, None
    disk = None if iso.tmpfs else (cfg["read_write"][0], cfg["file_bytes"], limits.max_files)
    try:
        with open(sample_path, "rb") as stdin:
            proc = subprocess.Popen(
                [*run_as, *iso.unshare, iso.python, "-I", "-S", "-B", "-c", init_source(), json.dumps(cfg)],
                cwd=cwd,
                env=env,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                process_group=0,  # its own group, not session: a session is an autogroup (sandbox_watch.brake)
                close_fds=True,
                pass_fds=(status_w, theirs.fileno()),
            )
        os.close(status_w)
        theirs.close()
        if started is not None:
            started(proc)
        deadline = time.monotonic() + limits.timeout_s
        out = err = b""
        timed_out, limit = False, None
        try:
            if cfg["listen_port"]:
                listener = _listener(ours, deadline)
                stop_serving = serve(listener) if listener is not None else None
                no_listener = listener is None
            if not no_listener:
                watch = Watch(proc.pid, limits.memory_mb << 20, disk, limits.open_files, own_network=bool(iso.unshare))
                out, err, timed_out, _, limit = collect_output(proc, deadline, limits.output_bytes, watch, tail=True)
        finally:
            kill_all(proc, supervised=cfg["supervise"])
            if stop_serving is not None:
                stop_serving()
        returncode = proc.wait()
        status = read_status(status_r)
    finally:
        os.close(status_r)
        ours.close()
    if status.startswith("sandbox setup failed") or no_listener:
        raise SandboxError(status or "sandbox: the agent command's namespace sent no listening socket")
    decode = lambda b: b.decode("utf-8", "replace")  # noqa: E731
    return CommandResult(decode(out), decode(err), returncode, timed_out, limit or "")


def _listener(channel: socket.socket, deadline: float) -> Optional[socket.socket]:
    """The listening socket the sandbox's init sends once set up; None if it ends first."""
    channel.settimeout(max(0.1, deadline - time.monotonic()))
    try:
        _, fds, _, _ = socket.recv_fds(channel, 64, 1)
    except OSError:  # socket.timeout too
        return None
    return socket.socket(fileno=fds[0]) if fds else None


def _plain(value):
    """A sample's non-JSON value (a numpy scalar or array from a dataset file) as plain data."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
