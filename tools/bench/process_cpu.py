"""CPU seconds of a command's whole process tree, per process and by role (Linux /proc, psutil).

`ProcessTreeSampler(root_pid)` polls the root and all its descendants (torchrun's ranks, Ray's
GCS, raylet and agents, its workers and actors); a process keeps the CPU it had at its last poll,
so one that exits between two polls loses less than one interval. `role()` names a process by
what it runs, again whenever its command line changes: a child seen between fork and exec shows
its parent's, and a Ray worker's changes as it takes on an actor (default_worker.py, then
ray::IDLE, then ray::EngineActor), which it keeps.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from typing import Optional

import psutil

# (pattern in the command line, role), first match wins; a rank is recognised by its RANK variable
_ROLES = [
    ("ray::EngineActor", "engine"),
    ("ray::AgentWorker", "agent worker"),
    ("gcs_server", "Ray GCS"),
    ("raylet/raylet", "raylet"),
    ("dashboard/dashboard.py", "Ray dashboard (head)"),
    ("dashboard/agent.py", "Ray dashboard agent"),
    ("ray::DashboardAgent", "Ray dashboard agent"),
    ("log_monitor.py", "Ray log monitor"),
    ("autoscaler/_private/monitor.py", "Ray autoscaler monitor"),
    ("runtime_env/agent", "Ray runtime-env agent"),
    ("ray::RuntimeEnvAgent", "Ray runtime-env agent"),
    ("ray::IDLE", "Ray worker (idle)"),
    ("default_worker.py", "Ray worker (idle)"),
    ("driver, tag", "Ray reaper (ours)"),
]
_GENERIC = {"Ray worker (idle)", "other"}  # a later, more specific role replaces these
_ACTOR = re.compile(r"^ray::(\w+)")


def role(cmdline: str, environ: Optional[dict] = None) -> str:
    """What a process of a training launch is, from its command line (and RANK for a rank)."""
    if "megatron_stepwise.cli" in cmdline and environ and "RANK" in environ:
        return f"rank {environ['RANK']}"
    for pattern, name in _ROLES:
        if pattern in cmdline:
            return name
    actor = _ACTOR.match(cmdline)
    return f"Ray actor {actor.group(1)}" if actor else "other"


@dataclass
class _Seen:
    role: str
    cmdline: str = ""
    cpu: float = 0.0  # user + system seconds at the last poll
    first_seen: float = 0.0  # seconds after the sampler started


@dataclass
class ProcessTreeSampler:
    root_pid: int
    root_role: str = "launcher (torchrun agent)"
    seen: dict[tuple[int, float], _Seen] = field(default_factory=dict)  # (pid, create time) -> _Seen

    def poll(self, now: float = 0.0) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            try:
                key = (p.pid, p.create_time())
                cmdline = " ".join(p.cmdline())
                entry = self.seen.get(key)
                if entry is None:
                    name = self.root_role if p.pid == self.root_pid else self._role_of(p, cmdline)
                    entry = self.seen[key] = _Seen(name, cmdline, first_seen=now)
                elif cmdline and cmdline != entry.cmdline and p.pid != self.root_pid:  # "": exiting
                    # exec'd since (seen between fork and exec, it showed its parent's command
                    # line and environment), or a Ray worker that took on an actor (never back)
                    name, entry.cmdline = self._role_of(p, cmdline), cmdline
                    if name not in _GENERIC or entry.role in _GENERIC or entry.role.startswith("rank "):
                        entry.role = name
                t = p.cpu_times()
                entry.cpu = t.user + t.system
            except psutil.Error:
                continue

    @staticmethod
    def _role_of(p: psutil.Process, cmdline: str) -> str:
        environ = p.environ() if "megatron_stepwise.cli" in cmdline else None
        return role(cmdline, environ)

    def by_role(self) -> dict[str, dict[str, float]]:
        """{role: {"cpu": seconds, "count": processes}}, largest CPU first."""
        out: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"cpu": 0.0, "count": 0})
        for entry in self.seen.values():
            out[entry.role]["cpu"] += entry.cpu
            out[entry.role]["count"] += 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu"]))

    def total(self) -> float:
        return sum(e.cpu for e in self.seen.values())
