"""Per-test timeouts that say where a hung test was stuck, then fail that test alone.

pytest-timeout supplies the settings (the `timeout` ini value, `@pytest.mark.timeout(N)`, `--timeout`);
these two hooks replace its signal-method timer (tests/conftest.py imports them). On expiry:

1. the stack of every thread of the test's process goes into the failure message;
2. the test's child processes (all descendants started since the test began, except those of
   module- or session-scoped fixtures and Ray's, which outlive the test) are listed with their state, what they wait on (`wchan`) and command line;
   the Python ones dump every thread's stack (faulthandler on SIGABRT: PYTHONFAULTHANDLER is
   exported below, so every Python process a test starts inherits it) to their own stderr, which
   is the test's captured stderr or the launch helper's pipe (`helpers.run_launch` prints it);
   then every one of them is killed;
3. the test fails (pytest.fail), and the next test runs.

SIGALRM only reaches Python code when the main thread next runs bytecode. If it is stuck inside C
code that never returns, a watchdog thread GRACE_S later dumps the same and ends the process
(pytest-timeout's thread method): under pytest-xdist only that worker is lost and the test is
reported as crashed; nothing waits forever either way.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import traceback

import psutil
import pytest
import pytest_timeout

os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # children dump their threads on SIGABRT (and on a crash)

GRACE_S = float(
    os.environ.get("STEPWISE_TIMEOUT_GRACE_S", 60)
)  # after the timeout, for a main thread SIGALRM cannot reach
DUMP_WAIT_S = 10.0  # for the children to finish writing their faulthandler dumps
_STATE = pytest.StashKey[dict]()
_RUNNER_FRAME = re.compile(r"/_pytest/|/pluggy/|/pytest/__main__\.py$|^<frozen runpy>$")  # left out of the stacks


def _key(p: psutil.Process):
    try:
        return (p.pid, p.create_time())
    except psutil.Error:
        return None


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _snapshot() -> set:
    return {_key(p) for p in _descendants()}


def _is_ray(p: psutil.Process) -> bool:
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return False
    return name in ("raylet", "gcs_server") or cmd.startswith("ray::") or "/ray/" in cmd


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip() or "-"
    except OSError:
        return "?"


def _thread_stacks(frame=None) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, f in sys._current_frames().items():
        if ident == me and frame is not None:
            f = frame  # the main thread, where the signal found it (not this handler)
        elif ident == me:
            continue
        frames = [fr for fr in traceback.extract_stack(f) if not _RUNNER_FRAME.search(fr.filename)]
        out.append(
            f"--- thread {names.get(ident, '<unknown>')} ({ident}) ---\n" + "".join(traceback.format_list(frames))
        )
    return "\n".join(out)


def _children_report(before: set) -> str:
    """List the process tree; SIGABRT the test's own Python children (they dump their stacks), then kill
    the test's own children. Ray's processes and their descendants are listed only."""
    procs = _descendants()
    if not procs:
        return "no child processes"
    ray_pids = set()
    for p in procs:  # parents come before children in psutil's recursive listing
        try:
            if _is_ray(p) or p.ppid() in ray_pids:
                ray_pids.add(p.pid)
        except psutil.Error:
            pass
    lines, own = [], []
    for p in procs:
        try:
            with p.oneshot():
                new = _key(p) not in before
                tag = "ray (kept)" if p.pid in ray_pids else ("test's" if new else "older (kept)")
                lines.append(
                    f"  pid {p.pid} ppid {p.ppid()} {p.status()} wchan={_wchan(p.pid)} [{tag}] "
                    f"{' '.join(p.cmdline())[:300]}"
                )
            if new and p.pid not in ray_pids:
                own.append(p)
        except psutil.Error:
            continue
    dumping = []
    for p in own:
        try:
            python = "python" in p.name().lower() or "python" in os.path.basename(p.exe()).lower()
            if python and "PYTHONFAULTHANDLER" in p.environ() and p.status() != psutil.STATUS_ZOMBIE:
                p.send_signal(signal.SIGABRT)
                dumping.append(p)
        except psutil.Error:
            continue
    # each dump ends with the process's exit: wait for that event (bounded), not for a fixed time
    psutil.wait_procs(dumping, timeout=DUMP_WAIT_S)
    for p in own:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(own, timeout=DUMP_WAIT_S)
    return (
        "child processes (the test's own: Python ones dumped their threads' stacks to their stderr on SIGABRT, "
        f"pids {[p.pid for p in dumping]}; then all of the test's own were killed):\n" + "\n".join(lines)
    )


def _report(item, settings, before: set, frame=None) -> str:
    return (
        f"Timeout >{settings.timeout}s in {item.nodeid} (pid {os.getpid()})\n"
        f"stacks of every thread of the test process:\n{_thread_stacks(frame)}\n"
        f"{_children_report(before)}"
    )


_current: dict | None = None  # the running test's state: {"before": the processes it does not own}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item):
    global _current
    _current = {"before": _snapshot()}
    item.stash[_STATE] = _current


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A module- or session-scoped fixture's processes outlive the test that first asked for it: not the test's."""
    try:
        return (yield)
    finally:
        if fixturedef.scope != "function" and _current is not None:
            _current["before"] |= _snapshot()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer
    state = item.stash.get(_STATE, None) or {"before": _snapshot()}

    def on_alarm(signum, frame):
        __tracebackhide__ = True
        if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
            return
        pytest.fail(_report(item, settings, state["before"], frame))

    def last_resort():
        if state.get("cancelled"):
            return
        try:
            terminal = item.config.get_terminal_writer()
            terminal.write(_report(item, settings, state["before"]) + "\n")
        finally:
            pytest_timeout.timeout_timer(item, settings)  # dumps again with the captured output, os._exit(1)

    watchdog = threading.Timer(settings.timeout + GRACE_S, last_resort)
    watchdog.daemon = True
    watchdog.name = f"timeout watchdog {item.nodeid}"

    def cancel():
        state["cancelled"] = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        watchdog.cancel()

    item.cancel_timeout = cancel  # pytest-timeout's pytest_timeout_cancel_timer calls it
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    watchdog.start()
    return True
