"""A run directory that explains itself: what ran, how, from which code, with which packages.

Rank 0 writes, when training starts (docs/runs.md):
- `config.yaml`: the resolved config (defaults merged, overrides applied), the current start's;
- `run.json`: one entry per start (first run and every resume): the command line, working
  directory, host, time, the git commit of the package's source (and whether it had uncommitted
  changes) when it is a git checkout, and the versions of the packages that shape the results;
- `train.log`: rank 0's log records (appended across resumes).
`config_diff` lists the keys two resolved configs differ in (a resume names them).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from importlib import metadata
from typing import Any, Optional

from megatron_stepwise.rundir import paths

PACKAGES = (
    "megatron-stepwise",
    "torch",
    "megatron-core",
    "transformers",
    "ray",
    "sglang",
    "transformer-engine",
    "numpy",
)


def package_versions() -> dict[str, Optional[str]]:
    """Installed versions of PACKAGES (None: not installed) and Python's."""
    out: dict[str, Optional[str]] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(path: str) -> Optional[dict[str, Any]]:
    """{"sha", "dirty"} of the git checkout holding `path`; None when it is not one (or no git)."""
    try:
        sha = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"sha": sha.stdout.strip(), "dirty": bool(status.stdout.strip())}


def write_run_record(run_dir: str, config_yaml: str, argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Write config.yaml and append this start to run.json; returns the entry."""
    os.makedirs(run_dir, exist_ok=True)
    files = paths.RunDir(run_dir)
    _atomic_write(str(files.config), config_yaml)
    source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    entry = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": list(argv or sys.argv),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "git": git_commit(source),
        "versions": package_versions(),
    }
    path = str(files.run_record)
    starts = []
    try:
        with open(path) as f:
            starts = json.load(f).get("starts", [])
    except (OSError, ValueError):
        pass
    _atomic_write(path, json.dumps({"starts": starts + [entry]}, indent=1) + "\n")
    return entry


def log_to_run_dir(run_dir: str, logger_name: str = "megatron_stepwise") -> logging.Handler:
    """Append `logger_name`'s records (and warnings) to <run_dir>/train.log too."""
    path = str(paths.RunDir(run_dir).log)
    end_torn_line(path)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in (logger_name, "py.warnings"):
        logging.getLogger(name).addHandler(handler)
    logging.captureWarnings(True)
    return handler


def end_torn_line(path: str) -> None:
    """Before appending to a file a crash may have cut mid-line: end that line, so the first new
    record starts on a line of its own instead of being glued onto the torn one."""
    try:
        with open(path, "rb+") as f:
            if f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        pass


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v) and not _is_leaf_mapping(prefix + k):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _is_leaf_mapping(key: str) -> bool:
    """Dict-valued keys (options, fields, sets): compared as one value."""
    return key.rsplit(".", 1)[-1] in ("options", "dataset_options", "estimator_options", "fields", "sets")


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of every key two resolved configs differ in, sorted."""
    a, b = flatten(old), flatten(new)
    missing = object()
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)]


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
