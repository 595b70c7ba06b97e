"""`env.agent_command`: a program run per trajectory in the sandbox, its calls the steps, its reward
printed or `env.reward_fn`'s; a failing command ends only its trajectory; what it can reach."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from megatron_stepwise.envs import sandbox
from megatron_stepwise.gateway.agents import AgentRollout
from megatron_stepwise.gateway.command_agent import CommandAgent, last_outcome, score
from megatron_stepwise.gateway.config import AgentConfig
from megatron_stepwise.gateway.server import GatewaySettings
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.steps import TrajectoryID
from tests.gateway_fixtures import Recording, assert_exact_in_any_order
from tests.helpers import tiny_lm

TOK, CONFIG = tiny_lm("tiny_bpe")
REPO = Path(__file__).resolve().parents[2]
COMMAND = ["python", "-m", "tests.command_agents"]
pytestmark = pytest.mark.timeout(300)


def rollout(samples, reward_fn=None, before=None, **agent_config):
    """Groups of two trajectories per sample through a gateway over a tiny embedded engine."""
    local = LocalEngine(CONFIG, tokenizer=TOK, eos_token_ids=[TOK.eos_token_id], seed=0)
    engine = Recording(local)
    settings = GatewaySettings(
        sampling=SamplingParams(max_new_tokens=4), max_input_length=512, agent=AgentConfig(**agent_config)
    )
    agent = CommandAgent(COMMAND, reward_fn, max_concurrency=4, cwd=str(REPO))
    source = AgentRollout(engine, TOK, agent, settings, [TOK.eos_token_id], n_samples_per_prompt=2)

    async def go():
        try:
            await source.gateway.start()
            await agent.start(source.gateway)
            extra = before(source.gateway) if before else {}
            return await source.rollout_groups([{**s, **extra} for s in samples])
        finally:
            await source.gateway.close()
            await local.close()

    groups = asyncio.run(go())
    source.close()
    return groups, engine.calls, source


def test_the_commands_sdk_calls_are_its_trajectorys_steps():
    groups, calls, source = rollout([{"prompt_id": "a", "n": 2}, {"prompt_id": "b", "n": 1}])
    assert [len(t) for g in groups for t in g.trajectories] == [2, 2, 1, 1] and len(calls) == 6
    for traj in (t for g in groups for t in g.trajectories):
        assert not traj[-1].invalid_reason, traj[-1].invalid_reason
        assert traj[-1].reward == 0.5 and [s.turn_reward for s in traj] == [0.25] * len(traj)
        assert traj[-1].metadata["agent_info"] == {"n": len(traj)}
        assert not any(s.metadata["prefix_break"] for s in traj)
    assert_exact_in_any_order([s for g in groups for t in g.trajectories for s in t], calls)
    assert source.metrics()["gateway/agent_errors"] == 0


def _last_reply_length(text, sample, transcript):
    assert transcript[-1]["messages"][-1] == {"role": "user", "content": "hi"}
    return {"reward": float(len(transcript)), "info": {"text": text, "sample": sample["prompt_id"]}}


def test_without_a_printed_reward_the_reward_is_env_reward_fns_over_the_transcript():
    groups, _, _ = rollout([{"prompt_id": "a", "mode": "silent"}], reward_fn=_last_reply_length)
    for traj in groups[0].trajectories:
        assert not traj[-1].invalid_reason and traj[-1].reward == 1.0
        assert traj[-1].metadata["agent_info"]["sample"] == "a"


@pytest.mark.parametrize(
    "mode, reason",
    [
        ("crash", "agent_exit: exit code 1; stderr: ...about to fail\nboom: the agent crashed"),
        ("silent", "agent_no_outcome: printed no JSON line with 'reward'"),
        ("hang", "agent_timeout (env.agent_timeout_s=30.0)"),
    ],
)
def test_a_failing_command_invalidates_only_its_own_trajectory(mode, reason):
    start = time.monotonic()
    groups, _, source = rollout([{"prompt_id": "a", "mode": mode}, {"prompt_id": "b"}], agent_timeout_s=30.0)
    assert time.monotonic() - start < 240  # the hanging tree was killed at its deadline, not waited for
    bad = [t[-1].invalid_reason for t in groups[0].trajectories]
    assert all(r and r.startswith(reason) for r in bad), bad
    assert all(not t[-1].invalid_reason and t[-1].reward == 0.5 for t in groups[1].trajectories)
    assert source.agent_errors == 2
    if mode == "crash":
        assert groups[0].trajectories[0][-1].metadata["agent_info"]["exit_code"] == 1
    deadline = time.monotonic() + 30
    while _agent_processes() and time.monotonic() < deadline:  # SIGKILLed: gone as soon as reaped
        time.sleep(0.1)
    assert not _agent_processes()  # the hanging command and the child it forked


def _agent_processes() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tests.command_agents" in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def probe_rollout(tmp_path, samples):
    """`samples` rolled out, the probe's told a listener on the host, another trajectory's path
    and a file of the trainer's (each of which it must not reach)."""
    listener = socket.create_server(("127.0.0.1", 0))
    secret = tmp_path / "answers.txt"
    secret.write_text("42")

    def before(gateway):
        other = gateway.open(TrajectoryID("other", 0))
        return {"other_path": other[len(gateway.url) :], "host_port": listener.getsockname()[1], "secret": str(secret)}

    try:
        return rollout(samples, before=before)[0]
    finally:
        listener.close()


def test_the_command_reaches_its_own_trajectory_and_nothing_else(tmp_path):
    groups = probe_rollout(tmp_path, [{"prompt_id": "a", "mode": "probe"}])
    found = groups[0].trajectories[0][-1].metadata["agent_info"]
    assert found["mine"] == 200 and found["other"] == 401 and found["no_key"] == 401, found
    assert found["host_port"] != "connected", found
    if sandbox.isolation().landlock_abi:
        assert found["secret"] == "PermissionError" and found["root_home"] == "PermissionError", found
        assert found["cwd_write"] in ("PermissionError", "OSError") and found["home_write"] == 2, found
    assert not (REPO / "written-by-the-agent").exists()
    assert set(found["env"]) <= {
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_BASE_URL",
        "HOME",
        "LANG",
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
        "PATH",
        "PYTHONPATH",
        "STEPWISE_SAMPLE_FILE",
        "TMPDIR",
        "VIRTUAL_ENV",
        "LC_CTYPE",
    }, found["env"]


def test_outcome_lines_and_reward_fn_signatures():
    assert last_outcome('{"reward": 1}\nlog\n{"reward": 2, "info": {}}\n{"other": 1}\nnot json {') == {
        "reward": 2,
        "info": {},
    }
    assert last_outcome("no outcome\n{broken") is None
    transcript = [{"reply": {"role": "assistant", "content": "hello"}}]
    assert score(lambda text, sample: len(text), {}, transcript) == 5
    assert score(lambda text, sample, **kw: (len(kw["transcript"]), "msg"), {}, transcript) == 1


@pytest.fixture
def no_namespaces(monkeypatch):
    """As on a machine without user namespaces, for a trainer that is not root (its own uid):
    the degraded mode docs/security.md describes."""
    from megatron_stepwise.envs import sandbox_command

    found = sandbox.isolation()
    degraded = sandbox.Isolation("none", found.landlock_abi, (), found.python, found.stdlib, ())
    monkeypatch.setattr(sandbox_command, "isolation", lambda: degraded)
    sandbox_command.command_isolation.cache_clear()
    yield
    sandbox_command.command_isolation.cache_clear()


def test_without_namespaces_the_command_reaches_the_gateways_port_only(tmp_path, no_namespaces):
    if sandbox.isolation().landlock_abi < 4:
        pytest.skip(
            "without namespaces only Landlock >= 4 limits TCP: runs on Linux >= 6.7 with Landlock (CI's machine)"
        )
    groups = probe_rollout(tmp_path, [{"prompt_id": "a", "mode": "probe"}, {"prompt_id": "b", "n": 2}])
    found = groups[0].trajectories[0][-1].metadata["agent_info"]
    assert found["mine"] == 200 and found["other"] == 401 and found["no_key"] == 401, found
    assert found["host_port"] == "PermissionError" and found["secret"] == "PermissionError", found
    assert all(len(t) == 2 and t[-1].reward == 0.5 for t in groups[1].trajectories)


def test_as_an_unprivileged_trainer_the_command_reaches_its_endpoint_only():
    import json
    import shutil
    import subprocess
    import sys

    if not os.path.exists("/usr/bin/python3"):
        pytest.skip(
            "no /usr/bin/python3 to run the command with: runs where the system Python exists (CI's Debian image)"
        )
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv: no unprivileged pass; runs where util-linux's setpriv is installed (CI)")
        prefix = [shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"]
    script = REPO / "tests" / "command_sandbox_as_user.py"
    done = subprocess.run(
        [*prefix, sys.executable, str(script), str(REPO)], capture_output=True, text=True, timeout=240, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["namespaces"] == "none":
        pytest.skip(
            "no user namespaces for an unprivileged user here: runs where unprivileged user namespaces are allowed (CI)"
        )
    assert report["rc"] == 0, report
    reached = json.loads(report["out"].strip().splitlines()[-1])
    assert reached["got"] == "endpoint", report
    assert reached["host"] != "connected", report
