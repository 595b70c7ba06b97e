"""The per-test timeout (tests/timeouts.py) and the launch helper (helpers.run_launch): a hung test fails
alone, with every thread's stack, its child processes listed and their stacks dumped, and no process of
it left behind. The hung tests run in a pytest of their own with a 2 s timeout; readiness is waited
for (a child says "ready" before the timer starts), never slept for."""

from __future__ import annotations

import os
import re
import sys

import psutil
from helpers import TESTS, run_launch

CHILD = "import threading; print('ready', flush=True); threading.Event().wait()"

HUNG_TESTS = f"""
import subprocess, sys, threading
from pathlib import Path

import psutil
import pytest

from helpers import run_launch

CHILD = {CHILD!r}
HERE = Path(__file__).parent


def _ready_child(tag):
    p = subprocess.Popen([sys.executable, "-c", CHILD, tag], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\\n"
    return p


@pytest.fixture(scope="module")
def module_child():
    p = _ready_child("module-child")  # outlives a test: a hung test must leave it alone
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def own_child():
    p = _ready_child("own-child")
    (HERE / "own_child.pid").write_text(str(p.pid))
    threading.Thread(target=threading.Event().wait, name="helper-thread-waits", daemon=True).start()
    return p


@pytest.mark.timeout(2, func_only=True)  # the timer starts once the fixtures' children are ready
def test_hangs(module_child, own_child):
    threading.Event().wait()  # MAIN-THREAD-WAITS-HERE


@pytest.mark.timeout(3)
def test_launch_hangs():
    # a launcher whose worker sits in a session of its own, as torchrun's do
    code = ("import subprocess, sys, threading; "
            "w = subprocess.Popen([sys.executable, '-c', 'import threading; threading.Event().wait()'], start_new_session=True); "
            "print('worker', w.pid, flush=True); threading.Event().wait()")
    run_launch([sys.executable, "-c", code], timeout=600)


def test_next_runs_and_the_module_child_is_kept(module_child):
    assert module_child.poll() is None
    pid = int((HERE / "own_child.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
"""


def test_a_hung_test_fails_alone_with_every_stack_and_no_process_left(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from timeouts import pytest_fixture_setup, pytest_runtest_protocol, pytest_timeout_set_timer  # noqa: F401\n"
    )
    (tmp_path / "test_hung.py").write_text(HUNG_TESTS)
    env = dict(os.environ, PYTHONPATH=f"{TESTS}:{TESTS.parent}")
    out = run_launch(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-o",
            "timeout_method=signal",
            "-q",
            "-rA",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_hung.py"),
        ],
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert re.search(r"2 failed, 1 passed", text), text
    # the test's process: every thread's stack, the main thread where it waited
    assert "Timeout >2.0s in test_hung.py::test_hangs" in text, text
    assert "MAIN-THREAD-WAITS-HERE" in text and "--- thread helper-thread-waits" in text, text
    # its children: the own one listed and dumped (faulthandler, on SIGABRT) then killed, the module's kept
    assert re.search(r"\[test's\] \S+ -c .* own-child", text) and re.search(
        r"\[older \(kept\)\] \S+ -c .* module-child", text
    ), text
    assert "Fatal Python error: Aborted" in text and 'File "<string>", line 1 in <module>' in text, text
    # the launch helper: the launcher and its worker in another session both killed, the output printed
    assert "Timeout >3.0s in test_hung.py::test_launch_hangs" in text, text
    assert "[run_launch] killed after Failed" in text, text
    worker = re.search(r"^worker (\d+)$", text, re.M)
    assert worker, text
    assert not psutil.pid_exists(int(worker.group(1))), text


STUCK_IN_C = """
import ctypes

import pytest


@pytest.mark.timeout(1)
def test_stuck_in_c():
    # a mutex locked twice by one thread: pthread_mutex_lock never returns, and no signal handler runs
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER on glibc
    libc = ctypes.CDLL(None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # STUCK-IN-C-HERE
"""


def test_a_test_stuck_in_c_code_ends_its_process_instead_of_hanging(tmp_path):
    """SIGALRM cannot interrupt a main thread inside C code: the watchdog dumps and ends the process."""
    (tmp_path / "conftest.py").write_text(
        "from timeouts import pytest_fixture_setup, pytest_runtest_protocol, pytest_timeout_set_timer  # noqa: F401\n"
    )
    (tmp_path / "test_stuck.py").write_text(STUCK_IN_C)
    env = dict(os.environ, PYTHONPATH=f"{TESTS}:{TESTS.parent}", STEPWISE_TIMEOUT_GRACE_S="1")
    out = run_launch(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-o",
            "timeout_method=signal",
            "-q",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_stuck.py"),
        ],
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text  # os._exit(1), not a hang
    assert "Timeout >1.0s in test_stuck.py::test_stuck_in_c" in text and "STUCK-IN-C-HERE" in text, text
