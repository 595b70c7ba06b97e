"""One trainer per run directory, and a run's processes die with its launcher (rundir/lifecycle.py).

The slow test starts the tiny CPU experiment through `megatron-stepwise train` (launcher =
torchrun agent -> 2 ranks -> rank 0's local Ray: raylet, GCS, engine workers), checks that a
second trainer on the same run directory is refused, then SIGKILLs the launcher's process
group (or its top process alone) and waits until no process of the run is left.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_stepwise.rundir.lifecycle import LOCK_NAME, RUN_DIR_ENV, RunDirLocked, RunLock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def wait_for(condition, timeout, interval=0.2):
    """Poll `condition` until it returns something truthy or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


HOLDER = """
import sys, time
from megatron_stepwise.rundir.lifecycle import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _hold_lock(run_dir):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, run_dir], env=ENV, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_live_lock_is_refused_naming_its_owner_and_a_dead_ones_is_taken_over(tmp_path):
    run_dir = str(tmp_path / "run")
    holder = _hold_lock(run_dir)
    try:
        with pytest.raises(RunDirLocked, match=rf"in use by another trainer: pid {holder.pid} on "):
            RunLock(run_dir).acquire()
        with pytest.raises(RunDirLocked):
            RunLock(run_dir).probe()
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing anything: its record is still there, its lock is not.
    assert RunLock(run_dir).read_owner()["pid"] == holder.pid
    lock = RunLock(run_dir).acquire()
    try:
        assert lock.read_owner()["pid"] == os.getpid()
    finally:
        lock.release()
    assert RunLock(run_dir).read_owner() == {}  # released: no owner recorded
    RunLock(run_dir).acquire().release()


def test_train_rank_zero_refuses_a_locked_run_dir_with_exit_2(tmp_path, capsys, monkeypatch):
    from megatron_stepwise.cli.main import main

    run_dir = str(tmp_path / "run")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    # one process: no self-launch, so this process is rank 0 and takes the lock itself (cli/train.py `_train`)
    argv = [
        "train",
        os.path.join(ROOT, "configs/tiny_cpu.yaml"),
        f"logging.run_dir={run_dir}",
        "launch.nproc_per_node=1",
    ]
    lock = RunLock(run_dir).acquire()  # another open file description: conflicts even in-process
    try:
        assert main(argv) == 2
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert f"error: run directory {os.path.abspath(run_dir)} is in use by another trainer: pid {os.getpid()}" in err


CHILD = """
import os, sys, time
from megatron_stepwise.rundir.lifecycle import die_with_launcher
die_with_launcher()
print(os.getpid(), flush=True)
time.sleep(600)
"""
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)  # as torchrun does
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["parent", "launcher"])
def test_a_rank_dies_with_its_parent_or_its_launcher(tmp_path, how):
    """`parent`: the rank's parent (torchrun's agent) is killed: the parent-death signal.
    `launcher`: a process above the parent (a launch script) is killed: the pid watch."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) if how == "launcher" else None
    env = dict(ENV, MEGATRON_STEPWISE_LAUNCHER_PID=str(launcher.pid)) if launcher else ENV
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], env=env, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        (parent if how == "parent" else launcher).kill()
        assert wait_for(lambda: not _alive(child), timeout=30), "the rank outlived its launcher"
    finally:
        for p in (parent, launcher):
            if p is not None:
                p.kill()
                p.wait()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _name(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


DRIVER = """
import subprocess, sys, time
from megatron_stepwise.rundir.lifecycle import tagged_ray_instance
with tagged_ray_instance():  # what ensure_ray does around a local ray.init
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(helper.pid, flush=True)
time.sleep(600)
"""


def test_what_a_driver_started_for_ray_dies_with_it():
    """A process started inside `tagged_ray_instance` (as raylet, GCS and Ray's workers are) in a
    session of its own is killed by the reaper once the driver is SIGKILLed."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], env=ENV, stdout=subprocess.PIPE, text=True)
    helper = int(driver.stdout.readline())
    try:
        driver.kill()
        driver.wait()
        assert wait_for(lambda: not _alive(helper), timeout=30), "the tagged process outlived its driver"
    finally:
        if _alive(helper):
            os.kill(helper, signal.SIGKILL)


def _descendants(root):
    """Live descendants of `root` (by parent pid)."""
    parents = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = set(), [root]
    while todo:
        parent = todo.pop()
        children = {pid for pid, pp in parents.items() if pp == parent and pid not in found}
        found |= children
        todo.extend(children)
    return {pid for pid in found if _alive(pid)}


def _run_processes(run_dir, also=()):
    """pids of live processes carrying the run's marker in their environment or its dir in their
    command line, plus those of `also` still alive."""
    marker = f"{RUN_DIR_ENV}={run_dir}".encode()
    found = {pid for pid in also if _alive(pid)}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if (marker in environ or run_dir.encode() in cmdline) and _alive(name):
            found.add(int(name))
    return found


# The second trainer is refused by the lock rank 0 holds, whatever launched it and however it will be
# killed: started beside one of the runs below (a `train` command's start-up fewer for the others).
REFUSED_BESIDE = ("cli", "group")


@pytest.mark.slow
@pytest.mark.parametrize("launch, kill", [("cli", "group"), ("cli", "top"), ("script", "top")])
def test_second_trainer_refused_and_killing_the_launcher_leaves_nothing(tmp_path, launch, kill):
    """launch `cli`: `megatron-stepwise train` (torchrun's agent in-process) -> ranks;
    `script`: launch/train_local.sh (bash) -> torchrun -> ranks. kill `group`: SIGKILL to the
    launcher's process group; `top`: SIGKILL to the top process alone. Beside the first, a second
    trainer on the same run directory is refused (REFUSED_BESIDE)."""
    run_dir = str(tmp_path / "run")
    args = [
        os.path.join(ROOT, "configs/tiny_cpu.yaml"),
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "trainer.iterations=100000",
        "checkpoint.every=0",
    ]
    cmd = [sys.executable, "-m", "megatron_stepwise.cli", "train", *args]
    first = cmd if launch == "cli" else [os.path.join(ROOT, "launch/train_local.sh"), *args]
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen(
        first,
        env=dict(ENV, PYTHON=sys.executable),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    metrics = os.path.join(run_dir, "metrics.jsonl")
    before = set()
    try:
        # Training is under way (ranks, Ray and its engines all up) once an iteration is logged.
        started = wait_for(
            lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0 or launcher.poll() is not None,
            timeout=600,
            interval=1,
        )
        assert started and launcher.poll() is None, open(tmp_path / "launcher.log").read()[-3000:]
        with open(os.path.join(run_dir, LOCK_NAME)) as f:
            owner = json.load(f)

        if (launch, kill) == REFUSED_BESIDE:
            second = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert second.returncode == 2, second.stderr[-3000:]
            assert f"is in use by another trainer: pid {owner['pid']} on {owner['host']}" in second.stderr
            assert "Traceback" not in second.stderr and "launching" not in second.stdout

        before = _run_processes(run_dir, also=_descendants(launcher.pid))
        assert owner["pid"] in before and launcher.pid in before
        assert len(before) >= 5, before  # launcher, 2 ranks, raylet/GCS, engine workers
        names = {pid: _name(pid) for pid in before}
        t0 = time.monotonic()
        if kill == "group":
            os.killpg(launcher.pid, signal.SIGKILL)
        else:
            launcher.kill()
        # (a pid of `before` reused within 30 s would only make this stricter)
        survivors = wait_for(lambda: not _run_processes(run_dir, before), timeout=30, interval=0.2)
        elapsed = time.monotonic() - t0
        left = _run_processes(run_dir, before)
        print(
            f"{len(before)} processes of the run ({', '.join(sorted(names.values()))}); "
            f"none left {elapsed:.1f} s after the kill"
            if not left
            else f"survivors after 30 s: {left}"
        )
        assert survivors and not left, {pid: open(f"/proc/{pid}/cmdline").read() for pid in left}
        lock = RunLock(run_dir).acquire()  # and the run directory is free again
        lock.release()
    finally:
        for pid in _run_processes(run_dir, before):  # never leak a run, whatever failed above
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        launcher.kill()
        launcher.wait()
        log.close()
