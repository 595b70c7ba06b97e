"""The sandbox watch's count of kernel-held socket and pipe buffers (sandbox_watch.kernel_buffers).

The hostile cases (socketpairs filled by 16 processes, a pipe grown with F_SETPIPE_SZ) run in
tests/sandbox_corpus.py, in both sandbox modes; this checks the arithmetic on a plain process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_stepwise.envs.sandbox_watch import (
    MAX_DEPTH,
    PIPE_BYTES,
    SOCKET_BYTES,
    disk_usage,
    kernel_buffers,
    namespace_sockets,
    open_files_of,
    unlinked_files,
)

pytestmark = pytest.mark.launches  # each test starts the process it measures

HOLDER = """
import os, socket, sys
pairs = [socket.socketpair() for _ in range(int(sys.argv[1]))]
pipes = [os.pipe() for _ in range(int(sys.argv[2]))]
print('ready', flush=True)
sys.stdin.read()
"""


def _holder(pairs: int, pipes: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(pairs), str(pipes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def holders():
    started = []
    yield lambda pairs, pipes: started.append(_holder(pairs, pipes)) or started[-1]
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.timeout(60)
def test_each_socket_and_pipe_counts_at_capacity_plus_the_in_flight_reserve(holders):
    proc = holders(3, 2)
    # 3 pairs = 6 sockets; 2 pipes of its own plus its stdin and stdout pipes; 64 may be in flight
    assert (
        kernel_buffers([open_files_of(proc.pid)], open_files=64)
        == 6 * SOCKET_BYTES + 4 * PIPE_BYTES + 64 * SOCKET_BYTES
    )


@pytest.mark.timeout(60)
def test_a_descriptor_shared_by_two_processes_counts_once_and_pipes_alone_reserve_nothing(holders):
    proc = holders(0, 1)
    assert kernel_buffers([open_files_of(proc.pid)] * 2, open_files=64) == 3 * PIPE_BYTES


@pytest.mark.timeout(60)
def test_a_call_that_cannot_send_descriptors_reserves_nothing_for_them(holders):
    proc = holders(1, 0)
    assert (
        kernel_buffers([open_files_of(proc.pid)], open_files=64, in_flight=False) == 2 * SOCKET_BYTES + 2 * PIPE_BYTES
    )


@pytest.mark.timeout(60)
def test_a_process_still_in_the_trainers_network_namespace_is_not_read_as_its_own(holders):
    # the process shares this one's namespace (not moved yet): its table is the host's, not the call's
    proc = holders(1, 0)
    assert namespace_sockets(proc.pid) is None
    listed = {1, 2, 3}  # a namespace of the call's own: the sockets it lists count, and only pipes are reserved
    counted = kernel_buffers([open_files_of(proc.pid)], open_files=8, listed=listed)
    assert counted == 5 * SOCKET_BYTES + 2 * PIPE_BYTES + 8 * PIPE_BYTES


@pytest.mark.timeout(60)
def test_a_process_gone_counts_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert kernel_buffers([open_files_of(proc.pid)], open_files=64) == 0


def _chain(root, depth: int, name: str) -> str:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    leaf = os.open("leaf", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
    os.write(leaf, b"x" * (64 << 10))
    os.close(leaf)
    os.close(fd)


@pytest.mark.timeout(60)
def test_files_deeper_than_path_max_are_counted_and_a_chain_past_the_limit_is_flagged(tmp_path):
    deep = tmp_path / "deep"
    deep.mkdir()
    _chain(deep, 30, "n" * 250)  # 7.5 KB of path: past PATH_MAX, where a walk by path saw nothing
    count = disk_usage(str(deep), max_entries=1000)
    assert count.entries == 31 and count.used >= 64 << 10 and not count.too_deep
    chain = tmp_path / "chain"
    chain.mkdir()
    _chain(chain, MAX_DEPTH + 5, "d")
    assert disk_usage(str(chain), max_entries=1000).too_deep


HIDER = """
import ctypes, mmap, os, sys
root = sys.argv[1]
f = open(os.path.join(root, 'open'), 'wb'); f.write(b'x' * (1 << 20)); f.flush(); os.unlink(f.name)
fd = os.open(os.path.join(root, 'mapped'), os.O_RDWR | os.O_CREAT); os.write(fd, b'y' * (2 << 20))
libc = ctypes.CDLL(None); libc.mmap.restype = ctypes.c_void_p
libc.mmap(None, 2 << 20, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
os.close(fd); os.unlink(os.path.join(root, 'mapped'))  # held by the mapping alone
print('ready', flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_deleted_files_kept_open_or_mapped_still_count(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HIDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert disk_usage(str(tmp_path), max_entries=100).used == 0  # the walk sees nothing
        held = unlinked_files([proc.pid], [open_files_of(proc.pid, str(tmp_path))], str(tmp_path))
        assert (1 << 20) + (2 << 20) <= held <= (1 << 20) + (2 << 20) + (64 << 10)
        elsewhere = str(tmp_path / "elsewhere")
        assert unlinked_files([proc.pid], [open_files_of(proc.pid, elsewhere)], elsewhere) == 0
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.timeout(60)
def test_a_write_wakes_a_disk_count_that_scans_no_process(tmp_path, monkeypatch):
    """The wake after a write counts the directory only: a full check's scan of every process
    took tens of ms on a loaded machine, while the code went on writing."""
    from megatron_stepwise.envs import sandbox_watch

    watch = sandbox_watch.Watch(os.getpid(), memory_bytes=1 << 40, disk=(str(tmp_path), 4 << 20, 100))
    if watch.fileno() is None:
        pytest.skip("no inotify on this kernel: every Linux since 2.6.13 has it; the polls still hold")
    try:
        assert watch.check() is None  # the first check walks the directory and watches it
        (tmp_path / "a").write_bytes(b"x" * (3 << 20))
        monkeypatch.setattr(sandbox_watch, "process_tree", lambda pid: pytest.fail("a wake scanned processes"))
        deadline = time.monotonic() + 30
        while watch.disk_share == 0 and time.monotonic() < deadline:  # wakes within FAST of a count wait
            assert watch.woken() is None
        assert watch.disk_share > 0.5
        assert watch.due() <= sandbox_watch.FAST  # past half: the full check comes soon too
        (tmp_path / "b").write_bytes(b"x" * (2 << 20))
        assert "the call wrote 5 MiB (limit 4 MiB" in watch.woken()  # past half: no wait
    finally:
        watch.close()
