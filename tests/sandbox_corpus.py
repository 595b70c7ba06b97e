"""The hostile-code corpus for the sandbox: every escape an attacker tried on `math_tool`.

Standard library only and runnable as a script, so the very same corpus runs inside the test
process (as root, here) and under an unprivileged uid (`setpriv` in tests/integration/test_sandbox.py), with
this process as the "trainer" the code attacks: its environment, its memory, its pid, files it
may write, a TCP and a UDP port and a unix socket it listens on.

    python tests/sandbox_corpus.py            -> {"isolation": ..., "cases": {name: {"blocked", "detail"}}}
    python tests/sandbox_corpus.py --flood    -> the peak-RSS growth of this process under stdout floods
    python tests/sandbox_corpus.py --no-namespaces  -> the corpus with namespaces off (the degraded mode)
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATASET = REPO / "megatron_stepwise" / "envs" / "data" / "math_problems.jsonl"


def load_sandbox():
    """sandbox.py by path: it needs only the standard library, so an unprivileged user (who may
    not be able to import the project's dependencies) runs it too."""
    name = "megatron_stepwise.envs.sandbox"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location("sandbox_under_test", REPO / "megatron_stepwise/envs/sandbox.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class Trainer:
    """What the attacked process exposes, and how to tell whether an attack reached it."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.secret = f"SECRET-{self.token}".encode()  # lives in this process's memory only
        self.home = tempfile.mkdtemp(prefix="trainer-")  # writable by this process's uid
        self.marker = os.path.join(self.home, "escaped")
        self.signalled = False
        self._old_handler = signal.signal(signal.SIGUSR1, self._on_signal)
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.tcp.setblocking(False)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.unix_path = os.path.join(self.home, "trainer.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        self.unix.listen(8)
        self.unix.setblocking(False)

    def _on_signal(self, *_):
        self.signalled = True

    def fields(self) -> dict:
        return {
            "ppid": os.getpid(),
            "addr": id(self.secret),
            "marker": self.marker,
            "data": str(DATASET),
            "tcp": self.tcp.getsockname()[1],
            "udp": self.udp.getsockname()[1],
            "unix": self.unix_path,
            "token": self.token,
        }

    def connected(self, sock) -> bool:
        try:
            sock.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    def received(self) -> bool:
        try:
            self.udp.recv(64)
            return True
        except BlockingIOError:
            return False

    def leftovers(self) -> list[int]:
        """Processes (anyone's) whose command line carries this run's token."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if self.token.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
        return found

    def close(self) -> None:
        for s in (self.tcp, self.udp, self.unix):
            s.close()
        signal.signal(signal.SIGUSR1, self._old_handler)
        shutil.rmtree(self.home, ignore_errors=True)


def _failed(r) -> bool:
    return r.returncode != 0 or r.timed_out


# name -> (code, judge(result, trainer) -> blocked). Code is str.format'ed with Trainer.fields().
CORPUS = {
    "read_parent_environ": (
        "print(open('/proc/{ppid}/environ', 'rb').read()[:200])",
        lambda r, t: _failed(r) and "PATH" not in r.stdout,
    ),
    "read_ppid_environ": (  # the parent as the code sees it
        "import os; print(open(f'/proc/{{os.getppid()}}/environ', 'rb').read()[:200])",
        lambda r, t: _failed(r) and "PATH" not in r.stdout,
    ),
    "read_parent_memory": (
        "f = open('/proc/{ppid}/mem', 'rb'); f.seek({addr}); print(f.read(4096))",
        lambda r, t: _failed(r) and t.token not in r.stdout,
    ),
    "signal_parent": (
        "import os, signal; os.kill({ppid}, signal.SIGUSR1); print('signalled')",
        lambda r, t: _failed(r) and "signalled" not in r.stdout and not t.signalled,
    ),
    "kill_parent_group": (  # the pgid of the trainer; a no-op or EPERM, never delivered
        "import os, signal; os.killpg(os.getpgid({ppid}), signal.SIGUSR1); print('signalled')",
        lambda r, t: _failed(r) and not t.signalled,
    ),
    "write_outside_tempdir": (
        "open({marker!r}, 'w').write('x'); print('wrote')",
        lambda r, t: _failed(r) and not os.path.exists(t.marker),
    ),
    "write_tmp": (
        "open('/tmp/escaped-{token}', 'w').write('x'); print('wrote')",
        lambda r, t: _failed(r) and not os.path.exists(f"/tmp/escaped-{t.token}"),
    ),
    "read_dataset_answers": (
        "print(open({data!r}).read()[:300])",
        lambda r, t: _failed(r) and '"answer"' not in r.stdout,
    ),
    "find_dataset": (
        "import os\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    if 'math_problems.jsonl' in files: print('found', root)",
        lambda r, t: "found" not in r.stdout,
    ),
    "leave_children_running": (  # a new session and a double fork: out of any process group
        "import os, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{token}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execv('/bin/sleep', ['sleep', '600', '{token}'])\n"
        "    os._exit(0)\n"
        "print('spawned')",
        lambda r, t: _wait_for(lambda: not t.leftovers()),
    ),
    "tcp_via__socket": (
        "import _socket; s = _socket.socket(); s.settimeout(5); s.connect(('127.0.0.1', {tcp})); print('connected')",
        lambda r, t: _failed(r) and "connected" not in r.stdout and not t.connected(t.tcp),
    ),
    "tcp_internet": (
        "import _socket; s = _socket.socket(); s.settimeout(3); s.connect(('1.1.1.1', 53)); print('connected')",
        lambda r, t: _failed(r) and "connected" not in r.stdout,
    ),
    "udp_via__socket": (
        "import _socket; s = _socket.socket(2, 2); s.sendto(b'x', ('127.0.0.1', {udp})); print('sent')",
        lambda r, t: not t.received(),
    ),
    "unix_socket": (
        "import _socket; s = _socket.socket(1, 1); s.connect({unix!r}); print('connected')",
        lambda r, t: _failed(r) and not t.connected(t.unix),
    ),
    "rejoin_host_network": (  # setns into the init's namespace: the root escape of the old sandbox
        "import ctypes, os; fd = os.open('/proc/1/ns/net', os.O_RDONLY)\n"
        "libc = ctypes.CDLL(None, use_errno=True); print('setns', libc.setns(fd, 0x40000000))\n"
        "import _socket; s = _socket.socket(); s.settimeout(3); s.connect(('127.0.0.1', {tcp})); print('connected')",
        lambda r, t: "connected" not in r.stdout and not t.connected(t.tcp),
    ),
    "unmount_proc": (
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); print(libc.umount2(b'/proc', 2))\n"
        "print(open('/proc/{ppid}/environ', 'rb').read()[:100])",
        lambda r, t: "PATH" not in r.stdout,
    ),
    "stdout_flood": (
        "import sys\nwhile True: sys.stdout.write('x' * 65536)",
        lambda r, t: r.output_truncated and len(r.stdout) <= 64 << 10,
    ),
    "stderr_flood": (
        "import sys\nwhile True: sys.stderr.write('x' * 65536)",
        lambda r, t: r.output_truncated and len(r.stderr) <= 64 << 10,
    ),
    "fork_bomb": (
        "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            time.sleep(600)\n        n += 1\nexcept OSError as e:\n    print('stopped at', n)",
        lambda r, t: "stopped at" in r.stdout and int(r.stdout.split()[-1]) < 200,
    ),
    "memory_hog": (
        "b = bytearray(4 << 30); print('allocated')",
        lambda r, t: _failed(r) and "allocated" not in r.stdout,
    ),
    "disk_fill": (
        "f = open('big', 'wb')\nfor _ in range(64): f.write(b'x' * (1 << 20))\nprint('wrote 64 MiB')",
        lambda r, t: _failed(r) and "wrote" not in r.stdout,
    ),
    "outrun_the_watch": (  # past half its memory limit the watch renices it, and it cannot climb back
        "import os, time\nstart = os.getpriority(os.PRIO_PROCESS, 0)\nb = b'x' * (280 << 20)\n"
        "end = time.monotonic() + 8\nwhile os.getpriority(os.PRIO_PROCESS, 0) < 19 and time.monotonic() < end:\n"
        "    sum(range(10000))\nprint('nice', os.getpriority(os.PRIO_PROCESS, 0), 'from', start, flush=True)\ntry:\n"
        "    os.setpriority(os.PRIO_PROCESS, 0, start); print('raised', flush=True)\nexcept OSError:\n    print('refused', flush=True)",
        lambda r, t: _niceness(r) == 19 and "refused" in r.stdout and "raised" not in r.stdout,
    ),
    "leave_the_session": (  # a session of its own is a scheduler autogroup its niceness does not rank
        "import os\nif os.fork() == 0:\n    try:\n        os.setsid(); print('left', flush=True)\n"
        "    except OSError as e:\n        print('refused', e.errno, flush=True)\n    os._exit(0)\nos.wait()",
        lambda r, t: "refused 13" in r.stdout and "left" not in r.stdout,
    ),
    "disk_fill_many_files": (  # each file within RLIMIT_FSIZE, 3000 MiB in all
        "n = 0\ntry:\n    for i in range(3000):\n        open(f'f{{i}}', 'wb').write(b'x' * (1 << 20)); n += 1\n"
        "        print(n, flush=True)\nexcept OSError as e:\n    print('stopped', e)",
        # stopped by the quota, or by its deadline first on a machine too loaded to reach it
        lambda r, t: (
            _written_mib(r) <= 2 * DISK_MB
            and ("No space left" in r.stdout or ("wrote" in r.limit and _held_mib(r) <= 2 * DISK_MB) or r.timed_out)
        ),
    ),
    "memory_many_processes": (  # 16 processes of ~400 MiB each: within RLIMIT_AS one by one
        "import os, time\nfor _ in range(15):\n    try:\n        if os.fork() == 0:\n"
        "            b = b'x' * (400 << 20); time.sleep(600)\n    except OSError:\n        pass\n"
        "b = b'x' * (400 << 20); time.sleep(600)",
        lambda r, t: "memory" in r.limit and _held_mib(r) <= 2 * MEMORY_MB and not r.timed_out,
    ),
    "memory_shared_mappings": (  # the same in shared memory (mmap(-1, n) is MAP_SHARED: not anonymous)
        "import mmap, os, time\nchunk = b'x' * (1 << 20)\nfor _ in range(15):\n    try:\n"
        "        if os.fork() == 0:\n            break\n    except OSError:\n        pass\n"
        "m = mmap.mmap(-1, 400 << 20)\nfor i in range(400):\n    m[i << 20:(i + 1) << 20] = chunk\ntime.sleep(600)",
        lambda r, t: "memory" in r.limit and _held_mib(r) <= 2 * MEMORY_MB and not r.timed_out,
    ),
    "memory_memfd": (  # 900 MiB in unmapped memfds (1 MiB each: RLIMIT_FSIZE), 60 in each of 15 processes
        "import os, time\nchunk = b'x' * (1 << 20)\nkept = []\nfor _ in range(14):\n    try:\n"
        "        if os.fork() == 0:\n            break\n    except OSError:\n        pass\n"
        "try:\n    for i in range(60):\n        fd = os.memfd_create(f'm{{i}}')\n"
        "        os.ftruncate(fd, 1 << 20); os.write(fd, chunk); kept.append(fd)\n"
        "except OSError as e:\n    print('refused', e, flush=True)\nprint('held', len(kept), flush=True)\nif kept:\n    time.sleep(600)",
        lambda r, t: (
            ("refused" in r.stdout and "held 60" not in r.stdout)
            or ("memory" in r.limit and _held_mib(r) <= 2 * MEMORY_MB)
        ),
    ),
    "memory_socket_buffers": (  # unread socketpair data is kernel memory no RSS shows: 16 processes x 30 full pairs
        "import os, socket, time\na, b = socket.socketpair()\ntry:\n"
        "    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30); print('raised', flush=True)\n"
        "except OSError as e:\n    print('refused', e.errno, flush=True)\n"
        "for _ in range(15):\n    try:\n        if os.fork() == 0:\n            break\n    except OSError:\n        pass\n"
        "ballast = b'x' * (20 << 20)\nheld = []\ntry:\n    for i in range(30):\n"
        "        a, b = socket.socketpair(); a.setblocking(False)\n        try:\n"
        "            while True:\n                a.send(b'x' * 65536)\n        except BlockingIOError:\n            pass\n"
        "        held.append((a, b))\nexcept OSError:\n    pass\ntime.sleep(600)",
        lambda r, t: "refused 13" in r.stdout and "socket and pipe buffers" in r.limit and not r.timed_out,
    ),
    "pipe_grown": (  # F_SETPIPE_SZ would let one pipe hold 1 MiB (and root's pipes far more) unseen
        "import fcntl, os\nr, w = os.pipe()\ntry:\n    fcntl.fcntl(w, 1031, 1 << 20); print('grown', flush=True)\n"
        "except OSError as e:\n    print('refused', e.errno)",
        lambda r, t: "refused 13" in r.stdout,
    ),
    "disk_unlinked_open_files": (  # 1 MiB files deleted but kept open by 4 processes: the walk no longer sees them
        "import os, time\nfor _ in range(3):\n    try:\n        if os.fork() == 0:\n            break\n    except OSError:\n        pass\n"
        "kept, refused = [], False\ntry:\n    for i in range(60):\n        name = f'u{{os.getpid()}}-{{i}}'\n"
        "        f = open(name, 'wb'); f.write(b'x' * (1 << 20)); f.flush(); os.unlink(name); kept.append(f)\n"
        "except OSError as e:\n    refused = True; print('stopped', e, flush=True)\nprint('held', len(kept), flush=True)\n"
        "if not refused:\n    time.sleep(600)",
        lambda r, t: (
            ("wrote" in r.limit and _held_mib(r) <= 2 * DISK_MB) or "No space left" in r.stdout
        ),  # a tmpfs: the kernel's own quota (a refused process exits, freeing room the last one may fill and hold)
    ),
    "disk_deep_chain": (  # 4000 nested directories, a file of 256 KiB in each deep one: hidden past PATH_MAX, and slow to walk
        "import os\nfor i in range(4000):\n    os.mkdir('d'); os.chdir('d')\n"
        "    if i > 1000:\n        open('f', 'wb').write(b'x' * (256 << 10))\nprint('built', flush=True)",
        lambda r, t: (
            "built" not in r.stdout
            and (
                "No space left" in r.stdout + r.stderr
                or "deeper" in r.limit
                or ("wrote" in r.limit and _held_mib(r) <= 2 * DISK_MB)
            )
        ),
    ),
    "send_descriptors": (  # a descriptor in flight (sent, then closed) is held by no process the watch reads
        "import os, socket\na, b = socket.socketpair()\nr, w = os.pipe()\ntry:\n"
        "    socket.send_fds(a, [b'x'], [r]); print('sent', flush=True)\nexcept OSError as e:\n    print('refused', e.errno)",
        lambda r, t: "refused 13" in r.stdout,
    ),
    "regain_capabilities": (  # the code starts as its user namespace's root to mount its tmpfs
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
        "hdr = (ctypes.c_uint32 * 2)(0x20080522, 0); data = (ctypes.c_uint32 * 6)(); libc.capget(hdr, data)\n"
        "print('effective', data[0], data[3], 'permitted', data[1], data[4])\n"
        "print('mount', libc.mount(b'tmpfs', b'.', b'tmpfs', 0, b'size=1g'))",
        lambda r, t: "effective 0 0 permitted 0 0" in r.stdout and "mount -1" in r.stdout,
    ),
    "endless_loop": ("while True: pass", lambda r, t: r.timed_out),
    "key_syscalls": (  # the trainer's session keyring: add a key to it, read its id
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
        "add_key, keyctl = {{'x86_64': (248, 250), 'aarch64': (217, 219)}}[os.uname().machine]\n"
        "r = libc.syscall(add_key, b'user', b'k{token}', b'v', 1, -3)\n"
        "print('added' if r >= 0 else 'add denied', ctypes.get_errno())\n"
        "r = libc.syscall(keyctl, 0, -3, 0)\n"
        "print('read' if r >= 0 else 'read denied', ctypes.get_errno())",
        lambda r, t: "add denied 13" in r.stdout and "read denied 13" in r.stdout,
    ),
    "undeletable_tree": (  # a directory chain deeper than rmtree recurses, and chmod 0 directories
        "import os; print(os.getcwd(), flush=True)\n"
        "os.makedirs('locked/inner'); open('locked/inner/f', 'w').write('x')\n"
        "os.chmod('locked/inner', 0); os.chmod('locked', 0)\n"
        "for _ in range(1500): os.mkdir('d'); os.chdir('d')\n"
        "open('leaf', 'w').write('x'); print('built')",
        # built, or stopped past the watch's depth limit (no tmpfs): either way nothing is left behind
        lambda r, t: ("built" in r.stdout or "deeper" in r.limit) and not os.path.exists(r.stdout.split()[0]),
    ),
}


DISK_MB, MEMORY_MB = 64, 512  # run_python's defaults, which the corpus runs with


def _niceness(r) -> int:
    words = r.stdout.split()
    return int(words[1]) if len(words) > 1 and words[0] == "nice" else -100


def _written_mib(r) -> int:
    """The files the disk case wrote: the last count it printed, and one more it may have been
    killed in the middle of."""
    counts = [int(w) for w in r.stdout.split() if w.isdigit()]
    return (counts[-1] if counts else 0) + 1


def _held_mib(r) -> int:
    words = r.limit.split()
    return int(words[words.index("MiB") - 1]) if "MiB" in words else 1 << 30


def _wait_for(predicate, deadline_s: float = 30.0) -> bool:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


# The endless loop needs a short deadline to end. Past half a limit the code is braked to nice 19
# and crawls on a loaded machine, by design, so the cases that climb to a limit get longer (each
# ends when the watch stops it); every other case ends by itself well within the default.
_CLIMBERS = ("outrun_the_watch", "memory_many_processes", "memory_shared_mappings", "memory_memfd")
TIMEOUTS = {"endless_loop": 2.0, **{name: 120.0 for name in (*_CLIMBERS, "memory_socket_buffers")}}


def run_corpus(sandbox=None, timeout_s: float = 10.0) -> dict:
    """Every case against a fresh Trainer; {"isolation": str, "cases": {name: {blocked, detail}}}."""
    sandbox = sandbox or load_sandbox()
    trainer = Trainer()
    out = {}
    try:
        for name, (template, judge) in CORPUS.items():
            r = sandbox.run_python(template.format(**trainer.fields()), timeout_s=TIMEOUTS.get(name, timeout_s))
            out[name] = {
                "blocked": bool(judge(r, trainer)),
                "detail": r.as_observation(160),
                "returncode": r.returncode,
            }
    finally:
        trainer.close()
    return {"isolation": sandbox.isolation().describe(), "euid": os.geteuid(), "cases": out}


def flood_memory(caps=(64 << 10, 4 << 20)) -> dict:
    """Peak RSS growth (KiB) of this process while sandboxed code floods stdout, per output cap."""
    sandbox = load_sandbox()
    sandbox.run_python("print(1)")  # probes and imports first: the baseline includes them
    out = {}
    for cap in caps:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = sandbox.run_python(
            "import sys\nwhile True: sys.stdout.write('x' * 65536)", timeout_s=30, max_output_bytes=cap
        )
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out[str(cap)] = {
            "growth_kib": after - before,
            "baseline_kib": before,
            "kept_bytes": len(r.stdout),
            "truncated": r.output_truncated,
        }
    return out


def without_namespaces(sandbox):
    """Make `sandbox` run as on a machine without user namespaces (what docs/security.md calls degraded)."""
    found = sandbox.isolation()
    degraded = sandbox.Isolation("none", found.landlock_abi, found.run_as, found.python, found.stdlib, ())
    sandbox.isolation = lambda: degraded
    return sandbox


if __name__ == "__main__":
    if "--flood" in sys.argv:
        print(json.dumps(flood_memory()))
    else:
        module = load_sandbox()
        print(json.dumps(run_corpus(without_namespaces(module) if "--no-namespaces" in sys.argv else module)))
