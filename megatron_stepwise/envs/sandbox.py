"""Run untrusted model-written Python in a subprocess with time, memory and network limits.

Limits: wall-clock timeout (the whole process group is killed), RLIMIT_CPU, RLIMIT_AS (memory),
RLIMIT_FSIZE (no large files), an empty temporary working directory, an isolated interpreter
(`-I`: no user site, no PYTHON* env vars) and a minimal environment. Network: the child first
tries to enter a fresh network namespace (only loopback, down) with unshare(CLONE_NEWNET), which
works when running as root; in every case a prelude replaces `socket.socket` so code cannot open
sockets through the standard library. This is a guard against accidents and reward hacking in a
research setting, not a security boundary against a determined attacker.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000

_PRELUDE = """
import socket as _s
def _no_network(*a, **k):
    raise OSError("network access is disabled in the sandbox")
_s.socket = _no_network
_s.create_connection = _no_network
del _s
"""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool

    def as_observation(self, max_chars: int = 500) -> str:
        if self.timed_out:
            return "Error: timed out"
        text = self.stdout
        if self.returncode != 0:  # the last stderr line is the exception message
            lines = self.stderr.strip().splitlines()
            text += lines[-1] if lines else f"Error: exit code {self.returncode}"
        return text.strip()[:max_chars]


def _limit(memory_bytes: int, cpu_seconds: int) -> None:
    """Runs in the child between fork and exec."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare(CLONE_NEWNET)  # best effort: needs CAP_SYS_ADMIN
    except Exception:
        pass


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Execute `code` with `python -I`; stdout/stderr are captured (truncated to 64 KiB)."""
    with tempfile.TemporaryDirectory(prefix="sandbox-") as cwd:
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _PRELUDE + "\n" + code],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _limit(memory_mb << 20, max(1, int(timeout_s) + 1)),
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
    decode = lambda b: b[: 64 << 10].decode("utf-8", "replace")  # noqa: E731
    return SandboxResult(decode(out), decode(err), proc.returncode, timed_out)
