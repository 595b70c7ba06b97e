"""Starting Ray for the fleets and agent workers: a private local instance, or a cluster joined.

A local instance's workers inherit their environment from the `ray.init` call (this package's
sources on PYTHONPATH, one OpenMP thread) and die with this process; see `ensure_ray`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional

from megatron_stepwise.rundir.lifecycle import tagged_ray_instance


def ensure_ray(address: Optional[str] = None, num_cpus: Optional[int] = None) -> None:
    """Start (or connect to) Ray once: local by default, `address='auto'` joins a cluster."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    # Workers import this package: they see the same sources as the driver, and one OpenMP thread.
    worker_env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    if address:
        kwargs["address"] = address
        kwargs["runtime_env"] = {"env_vars": worker_env}  # the other nodes' raylets have their own environment
    else:
        # A new local instance: never join a cluster someone else started on this machine (a
        # bare ray.init() connects to the one `ray start` recorded in /tmp/ray).
        kwargs.update(address="local", num_cpus=num_cpus or 4)
        # Ray runs its workers at niceness 15 by default; ours (engines, agent workers) are the
        # run's critical path, and at 15 any busy process on the node (a rank, a data loader)
        # starves them (19x slower behind one busy loop per core: tools/bench/bench_ray_priority.py).
        # No idle workers prestarted for the first driver: engines and agent workers start their
        # own, and on a small machine those imports only compete with the ranks' start.
        kwargs["_system_config"] = {"worker_niceness": 0, "prestart_worker_first_driver": False}
        # Recent Ray turns token auth on for a new local instance and warns about it on every start;
        # for this private instance (loopback, ours alone) that is the right default, not news.
        quiet_ray_token_notice()
    local = kwargs["address"] == "local"
    # A local instance's processes die with this one, even by SIGKILL (Ray leaves its agents behind).
    # Its raylet, and so every worker it starts, inherits the environment ray.init runs in: the
    # workers get theirs from it, not from a runtime_env (which starts each worker through an extra
    # setup process and the runtime-env agent: ~0.3 CPU-seconds per worker).
    with tagged_ray_instance() if local else contextlib.nullcontext(), _environment(worker_env if local else {}):
        ray.init(**kwargs)


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    """os.environ with `variables` set while the block runs, as it was afterwards."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _DropRayTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled for this Ray cluster")


def quiet_ray_token_notice() -> None:
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropRayTokenNotice) for f in logger.filters):
        logger.addFilter(_DropRayTokenNotice())
