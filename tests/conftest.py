"""Shared fixtures, for tests/unit and tests/integration alike.

Layout: tests/unit (in-process, fast), tests/integration (torchrun, Ray, subprocesses, end to
end), tests/workers (the scripts those launch and the modules only they import); the shared
helpers stay in tests/. pytest's `pythonpath` has tests/ and tests/workers.

The shared plain helpers are in tests/helpers.py, imported by bare name (`tests` is on pytest's
`pythonpath`): the Step factory `make_step` (also called from module-level data builders and
hypothesis strategies), the torchrun launcher `run_torchrun` / `check_ok` (called from cached
launch functions), `tiny_lm` and `load_script`.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

# Every test has a timeout (pyproject: `timeout`, or `@pytest.mark.timeout(N)` with the reason): on expiry
# tests/timeouts.py dumps every thread and child process, kills the test's children and fails the test alone.
from timeouts import pytest_fixture_setup, pytest_runtest_protocol, pytest_timeout_set_timer  # noqa: F401

# `make test-fast` (STEPWISE_NO_LAUNCH=1) runs tests/unit without the tests marked `launches`; any other test
# that starts a process fails, naming the launch. Audit events catch subprocess, fork and exec;
# multiprocessing's spawn start method goes through util.spawnv_passfds, wrapped below.
_NO_LAUNCH = os.environ.get("STEPWISE_NO_LAUNCH") == "1"
_LAUNCH_EVENTS = {
    "subprocess.Popen",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.exec",
    "os.spawn",
    "os.system",
    "multiprocessing.spawn",
}
_launches: list[str] | None = None  # while a test runs under STEPWISE_NO_LAUNCH=1: launches from other threads


def _refuse_launch(event: str, args) -> None:
    if _launches is None or event not in _LAUNCH_EVENTS:
        return
    what = (
        f"test-fast runs no processes, and this test started one ({event} {str(args)[:200]}): "
        "mark it `launches` or move it to tests/integration"
    )
    if threading.current_thread() is threading.main_thread():
        pytest.fail(what)  # a BaseException: `except Exception` in the code under test does not hide it
    _launches.append(what)  # failed at the test's teardown


if _NO_LAUNCH:
    import multiprocessing.util

    sys.addaudithook(_refuse_launch)
    _spawnv_passfds = multiprocessing.util.spawnv_passfds

    def _spawnv_passfds_checked(path, args, passfds):
        _refuse_launch("multiprocessing.spawn", args)
        return _spawnv_passfds(path, args, passfds)

    multiprocessing.util.spawnv_passfds = _spawnv_passfds_checked


@pytest.fixture(autouse=True)
def _no_process_launches():
    global _launches
    if not _NO_LAUNCH:
        yield
        return
    _launches = []
    try:
        yield
    finally:
        tried, _launches = _launches, None
    if tried:
        pytest.fail("\n".join(tried))


@pytest.fixture(scope="session")
def ray_session():
    """One Ray for the whole test session (per xdist worker): the first fleet starts it
    (`ensure_ray`), every later module that asks for it shares it, and it shuts down at the end. Starting one per module made
    the suite wait on a raylet's start deadline once per module (the one a busy machine misses).
    Modules use it with `pytestmark = [..., pytest.mark.usefixtures("ray_session")]` and shut
    their own fleets and workers down, so the next module finds every CPU free."""
    import ray

    yield
    ray.shutdown()


@pytest.fixture
def one_torch_thread():
    """A tiny model's ops on 2 threads of a machine other jobs load can be 100x slower than on one
    (`pytestmark = pytest.mark.usefixtures("one_torch_thread")` in modules that run one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The longest test files (seconds in an idle CI run, most first), collected first: `make test`
# hands files to the workers in collection order (`--no-loadscope-reorder`; by default xdist
# orders them by their number of tests, which started test_two_node_faults' 3 long tests last and
# left the other worker idle at the end). The rest keep their order.
LONGEST_FIRST = (
    "integration/test_gateway_e2e.py",  # one launch of 40 iterations through the gateway
    "integration/test_train_e2e.py",  # 344 s
    "integration/test_two_node_faults.py",  # 296 s
    "integration/test_two_nodes.py",  # 170 s
    "integration/test_async_train.py",  # 152 s
    "integration/test_real_model.py",  # 131 s
    "integration/test_replay_e2e.py",  # 100 s
    "integration/test_slurm_real.py",  # 96 s
    "integration/test_megatron_parallel.py",  # 88 s
    "integration/test_run_lifecycle.py",  # 72 s
    "integration/test_megatron_lm.py",  # 60 s
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
