"""The real sglang-router (PyPI `sglang-router`, a Rust binary that runs on CPU) in front of two
`megatron-stepwise serve` engines on loopback: requests as the router forwards them are accepted,
the router is seen to drop `return_routed_experts` (why routing replay refuses `router_url`), and
a 3-iteration training run generates through `rollout.sglang.router_url`.

The router is in the `test` extra, so this runs in CI (`make test`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers import run_launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.importorskip("sglang_router", reason="pip install -e .[test] installs sglang-router (runs in CI)")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "NO_COLOR": "1"}
DEADLINE_S = 180.0  # generous: a loaded 2-core CI machine


def _get(url: str, timeout: float = 5.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return None, None


def _post(url: str, body: dict, timeout: float = 60.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _poll(what: str, ready, proc: subprocess.Popen):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        if ready():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not ready after {DEADLINE_S}s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    from megatron_stepwise.hf.presets import resolve_hf_config
    from megatron_stepwise.hf.tokenizers import load_tokenizer

    config = tmp_path / "config.json"  # the `tiny` preset as the trainer sizes it for tiny_word
    config.write_text(json.dumps(resolve_hf_config("tiny", vocab_size=len(load_tokenizer("tiny_word")))))
    log = open(tmp_path / f"{name}.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_stepwise.cli",
            "serve",
            "--model-config",
            str(config),
            "--tokenizer",
            "tiny_word",
            "--port",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
        cwd=ROOT,
    )
    found: list[str] = []

    def announced():
        log.seek(0)
        found[:] = re.findall(r"serving the embedded engine on (http://127\.0\.0\.1:\d+)", log.read())
        return bool(found) and _get(found[0] + "/health")[0] == 200

    _poll(f"serve {name}", announced, proc)
    return proc, found[0]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """(router url, [server urls], router log path), torn down after the module."""
    tmp = tmp_path_factory.mktemp("router")
    procs = []
    try:
        servers = []
        for i in range(2):
            proc, url = _serve(tmp, f"engine{i}")
            procs.append(proc)
            servers.append(url)
        port = _free_port()
        log_path = tmp / "router.log"
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--worker-urls",
                    *servers,
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "info",
                ],
                stdout=open(log_path, "w"),
                stderr=subprocess.STDOUT,
                env=ENV,
            )
        )
        url = f"http://127.0.0.1:{port}"

        def both_workers_healthy():
            status, workers = _get(url + "/workers")
            return status == 200 and sum(w.get("is_healthy", False) for w in workers.get("workers", [])) == 2

        _poll("sglang-router", both_workers_healthy, procs[-1])
        yield url, servers, log_path
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _forwarded_generates(log_path) -> list[int]:
    """HTTP status of each /generate the router answered (from its request log)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", open(log_path).read())
    return [int(s) for s in re.findall(r"uri=/generate[^\n]*status_code=(\d+)", text)]


def test_requests_forwarded_by_the_router_are_accepted(router):
    url, servers, _ = router
    for i in range(4):  # round robin: both engines answer
        status, data = _post(
            url + "/generate",
            {
                "input_ids": [1, 5, 8, 2],
                "rid": f"r{i}",
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 3, "temperature": 1.0},
            },
        )
        assert status == 200, data
        assert [e[1] for e in data["meta_info"]["output_token_logprobs"]] == data["output_ids"]


def test_the_router_drops_return_routed_experts(router):
    """A dense engine refuses return_routed_experts (400); behind the router the same request
    succeeds, so the router did not forward it: routing replay cannot go through the router."""
    url, servers, _ = router
    body = {
        "input_ids": [1, 5, 8],
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 2},
    }
    status, text = _post(servers[0] + "/generate", body)
    assert status == 400 and "return_routed_experts" in text
    status, data = _post(url + "/generate", body)
    assert status == 200 and "routed_experts" not in data["meta_info"]


def test_three_iterations_train_through_the_router(router, tmp_path):
    url, servers, log_path = router
    before = len(_forwarded_generates(log_path))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megatron_stepwise.cli",
        "train",
        os.path.join(ROOT, "configs/tiny_cpu.yaml"),
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "trainer.iterations=3",
        "trainer.eval_every=0",
        "checkpoint.every=0",
        "launch.nproc_per_node=1",
        "data.prompts_per_iteration=4",
        "data.prompts_per_minibatch=2",
        "rollout.engine=sglang",
        "rollout.agent_workers=0",
        f"rollout.sglang.servers=[{','.join(servers)}]",
        f"rollout.sglang.router_url={url}",
    ]
    out = run_launch(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert all(m["rollout/trajectories"] == 4 * 8 for m in metrics)
    assert metrics[-1]["weight_version"] == 3
    # Every turn went through the router (4 prompts x 8 samples x up to 3 turns per iteration), all 200.
    statuses = _forwarded_generates(log_path)[before:]
    assert len(statuses) >= 3 * 32 and set(statuses) == {200}, statuses[-20:]
