"""The sandbox against hostile model-written code (the corpus: tests/sandbox_corpus.py).

The corpus runs in this process (root, here: the code then runs as nobody), as an unprivileged
user (the suite's own uid when it is not root, else `setpriv` to nobody), and with namespaces
switched off (the degraded mode docs/security.md describes). Every escape must be blocked in each.
"""

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sandbox_corpus import CORPUS, run_corpus, without_namespaces

from megatron_stepwise.envs import sandbox
from megatron_stepwise.envs.math_tool import DATA

CORPUS_SCRIPT = Path(__file__).parents[1] / "sandbox_corpus.py"
NOBODY = 65534


def assert_all_blocked(report):
    open_ = {name: case["detail"] for name, case in report["cases"].items() if not case["blocked"]}
    assert not open_, f"escapes not blocked ({report['isolation']}): {open_}"
    assert set(report["cases"]) == set(CORPUS)


def test_hostile_corpus_is_blocked():
    assert_all_blocked(run_corpus(sandbox))


def _python_for_nobody():
    setpriv = shutil.which("setpriv")
    for python in (os.path.realpath(sys.executable), shutil.which("python3", path="/usr/bin:/bin")):
        if (
            setpriv
            and python
            and subprocess.run(
                [
                    setpriv,
                    f"--reuid={NOBODY}",
                    f"--regid={NOBODY}",
                    "--clear-groups",
                    python,
                    "-I",
                    "-c",
                    f"open({str(CORPUS_SCRIPT)!r}).close()",
                ],
                capture_output=True,
                cwd="/",
            ).returncode
            == 0
        ):
            return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python]
    return None


@pytest.mark.skipif(
    os.geteuid() != 0, reason="the suite already runs as non-root: test_hostile_corpus_is_blocked is the non-root run"
)
@pytest.mark.parametrize("mode", [[], ["--no-namespaces"]], ids=["namespaces", "no-namespaces"])
def test_hostile_corpus_is_blocked_as_non_root(mode):
    if mode and sandbox.isolation().landlock_abi < 6:
        pytest.skip(
            "without namespaces the corpus needs Landlock ABI >= 6 (signal scoping); this case runs on "
            "kernels with Landlock ABI >= 6 (Linux 6.12+)"
        )
    command = _python_for_nobody()
    if command is None:
        pytest.skip(
            "no interpreter that uid 65534 can run with setpriv here (needs setpriv and a python3 readable "
            "by nobody, as on Debian: /usr/bin/python3); the non-root run then happens when the suite "
            "itself runs as a non-root user (test_hostile_corpus_is_blocked)"
        )
    done = subprocess.run([*command, str(CORPUS_SCRIPT), *mode], capture_output=True, text=True, cwd="/", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["euid"] == NOBODY
    assert_all_blocked(report)


def test_hostile_corpus_is_blocked_without_namespaces(monkeypatch):
    """The degraded mode (no user namespaces): Landlock, seccomp, limits and the supervisor."""
    if sandbox.isolation().landlock_abi < 6:
        pytest.skip(
            f"the kernel's Landlock ABI is {sandbox.isolation().landlock_abi} (< 6: no signal scoping); "
            "docs/security.md lists what does not hold then; this test runs on kernels with Landlock ABI "
            ">= 6 (Linux 6.12+)"
        )
    real = sandbox.isolation
    monkeypatch.setattr(sandbox, "isolation", real)  # restored after the test
    report = run_corpus(without_namespaces(sandbox))
    assert report["isolation"].startswith("no namespaces")
    assert_all_blocked(report)


def test_memfds_do_not_escape_the_memory_total():
    """900 MiB in memfds nobody maps (RssShmem never sees them) against a 512 MiB total: refused."""
    code, judge = CORPUS["memory_memfd"]
    r = sandbox.run_python(code.format(), timeout_s=10.0)
    assert judge(r, None), r.as_observation(400)
    assert "held 0" in r.stdout or "memory" in r.limit, r.as_observation(400)


def test_a_stdout_flood_costs_the_parent_at_most_about_twice_the_cap():
    """Measured in a fresh process (this one's peak RSS is already far above the numbers)."""
    done = subprocess.run([sys.executable, str(CORPUS_SCRIPT), "--flood"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for cap, m in json.loads(done.stdout).items():
        cap = int(cap)
        assert m["truncated"] and m["kept_bytes"] == cap
        assert m["growth_kib"] * 1024 <= 3 * cap + (1 << 20), m  # bytes kept, one copy, one decode


def test_the_dataset_is_outside_everything_the_sandbox_may_read():
    allowed = sandbox.readable_paths(sandbox.isolation())
    for path in (DATA, Path(sandbox.__file__), Path(sys.prefix)):
        assert not any(Path(path).resolve().is_relative_to(a) for a in allowed), (path, allowed)


def test_concurrent_calls_from_threads_without_preexec_fn(monkeypatch):
    """The agent loop calls the sandbox from a thread pool: no preexec_fn (unsafe with threads)."""
    popen = subprocess.Popen

    def checked(*args, **kwargs):
        assert kwargs.get("preexec_fn") is None
        return popen(*args, **kwargs)

    monkeypatch.setattr(sandbox.subprocess, "Popen", checked)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: sandbox.run_python(f"print({i} * {i})", timeout_s=60), range(16)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(16)]


REAPER = """
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
from sandbox_corpus import load_sandbox
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here
sandbox = load_sandbox()
calls = [sandbox.run_python("import time\\nwhile True: time.sleep(0.01)", timeout_s=1.0),  # timed out
         sandbox.run_python("import sys\\nwhile True: sys.stdout.write('x' * 65536)", timeout_s=30),  # truncated
         sandbox.run_python("import os\\nif os.fork() == 0:\\n    os.setsid()\\n    import time; time.sleep(600)",
                            timeout_s=5)]  # a child left running
zombies = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        continue
    fields = stat[stat.rfind(b")") + 2:].split()
    if int(fields[1]) == os.getpid():
        zombies.append((int(pid), fields[0].decode()))
print(json.dumps({"timed_out": calls[0].timed_out, "truncated": calls[1].output_truncated, "left": zombies}))
"""


def test_the_sandbox_reaps_what_it_starts_leaving_no_orphan_to_a_reaper():
    """Where PID 1 never reaps (a container whose entrypoint is the trainer), every orphan
    re-parented to it would stay a zombie: a subreaper here sees what would reach PID 1."""
    done = subprocess.run(
        [sys.executable, "-c", REAPER, str(Path(__file__).parents[1])],
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["timed_out"] and report["truncated"]
    assert report["left"] == [], f"processes left to the reaper ({sandbox.isolation().describe()}): {report['left']}"


def test_a_tree_the_code_cannot_be_made_to_keep_is_removed(tmp_path):
    """The cleanup itself, on what rmtree fails at: a deep chain (RecursionError), chmod 0 dirs,
    a symlink out (not followed)."""
    root = tmp_path / "call"
    (root / "locked" / "inner").mkdir(parents=True)
    (root / "locked" / "inner" / "f").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    (root / "link").symlink_to(outside)
    os.chmod(root / "locked" / "inner", 0)
    os.chmod(root / "locked", 0)
    fd = os.open(root, os.O_RDONLY)
    for _ in range(1500):
        os.mkdir("d", dir_fd=fd)
        fd, old = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)
    sandbox.remove_tree(str(root))
    assert not root.exists() and (outside / "keep").is_file()


def test_read_grants_never_cover_a_package_directory(tmp_path):
    """conda, pyenv and python:3.x images keep site-packages inside the standard library's
    directory: it is granted entry by entry, the package directory left out (links need none)."""
    stdlib = tmp_path / "prefix" / "lib" / "python3.11"
    (stdlib / "site-packages" / "megatron_stepwise" / "envs" / "data").mkdir(parents=True)
    (stdlib / "lib-dynload").mkdir()
    (stdlib / "json").mkdir()
    (stdlib / "os.py").write_text("")
    (stdlib / "to-packages").symlink_to(stdlib / "site-packages")
    other = tmp_path / "prefix" / "share"  # nothing packaged within: one rule for the whole tree
    (other / "a" / "b").mkdir(parents=True)
    grants = sandbox._grants(str(stdlib), 3) + sandbox._grants(str(other), 3)
    assert sorted(grants) == sorted(map(str, [stdlib / "json", stdlib / "lib-dynload", stdlib / "os.py", other]))
    # and on this machine: no grant holds a package directory of any interpreter here
    import site
    import sysconfig

    packages = {
        Path(p).resolve()
        for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"], "/usr/lib/python3/dist-packages"]
        if os.path.isdir(p)
    }
    for path in sandbox.readable_paths(sandbox.isolation()):
        assert not any(pkg.is_relative_to(Path(path).resolve()) for pkg in packages), (path, packages)


def test_the_code_cannot_forge_a_setup_failure_but_a_real_one_still_raises(monkeypatch):
    """Printing the setup-failure line and exiting 120 is the code's own result (it used to raise
    SandboxError in the trainer); a failure of setup itself is still an error, never run unconfined."""
    forged = sandbox.run_python("import sys\nsys.stderr.write('sandbox setup failed: forged\\n')\nsys.exit(120)")
    assert forged.returncode == 120 and "forged" in forged.stderr and not forged.timed_out
    broken = sandbox.init_source().replace(
        "def set_limits(cfg: dict) -> None:\n",
        "def set_limits(cfg: dict) -> None:\n    raise OSError('limits refused')\n",
    )
    assert broken != sandbox.init_source()
    monkeypatch.setattr(sandbox, "init_source", lambda: broken)
    with pytest.raises(sandbox.SandboxError, match=r"^sandbox setup failed: OSError: limits refused$"):
        sandbox.run_python("print('never runs')")


BOMB = (
    "import os, time\nfor _ in range(64):\n    try:\n        if os.fork() == 0:\n            time.sleep(600)\n"
    "    except OSError:\n        pass\ntime.sleep(600)"
)


def _processes_of(uids) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        count += uid in uids
    return count


def test_a_fork_bomb_does_not_stop_a_concurrent_call_without_namespaces(monkeypatch):
    """Without namespaces RLIMIT_NPROC counts a uid's processes machine-wide: were every call
    nobody, a call holding 16 processes would leave a concurrent one unable to start any."""
    if not sandbox.isolation().run_as:
        pytest.skip(
            "the trainer is not root here: every call runs as the trainer's uid, and docs/security.md "
            "says what holds then (the uid pool needs root); this test runs when the suite runs as root, "
            "as in CI"
        )
    monkeypatch.setattr(sandbox, "isolation", sandbox.isolation)  # restored after the test
    without_namespaces(sandbox)
    uids = set(sandbox.UID_POOL)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bomb = pool.submit(sandbox.run_python, BOMB, timeout_s=15)
        deadline = time.monotonic() + 60
        while _processes_of(uids) < 16 and not bomb.done():
            assert time.monotonic() < deadline, "the fork bomb never reached its process limit"
            time.sleep(0.05)
        other = sandbox.run_python(
            "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait(); print('forked')", timeout_s=30
        )
        assert other.stdout == "forked\n", other
        assert not bomb.done()  # it still held its processes while the other call forked
    assert bomb.result().timed_out
