"""`env.agent` in agent workers (`rollout.agent_workers` > 0): the gateway's counts (`gateway/*`,
`rollout/prefix_breaks`) come back with each worker's reply and reach the driver's metrics, the
ones the sources write to metrics.jsonl, as when the agent runs in the driver.

Without Ray: a worker's body (`AgentWorker`) with a real gateway `AgentRollout` on a scripted
generator, behind a handle that ships its reply pickled, as Ray does."""

from __future__ import annotations

import asyncio
import os
import pickle

import openai

from megatron_stepwise.config import load_config
from megatron_stepwise.gateway.agents import AgentRollout
from megatron_stepwise.gateway.server import GatewaySettings
from megatron_stepwise.loop.sources import Driver
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.rollout.fleet.engine_router import RequestCounters
from megatron_stepwise.workers.agent_workers import AgentWorker, AgentWorkers
from megatron_stepwise.workers.worker_rows import HeldRows
from tests.gateway_fixtures import Scripted
from tests.helpers import tiny_lm

TOK, _ = tiny_lm("tiny_bpe")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def forgetful_agent(sample, base_url, api_key):
    """Two calls; the second sends only a new question (it drops the first exchange): a break."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], temperature=1.5)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
    return 1.0


class Engines:
    """The worker's engine view, with nothing to report."""

    def refresh(self, engines) -> None:
        pass

    def take_report(self):
        return [], RequestCounters()


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class Handle:
    """An actor handle whose `rollout` runs the worker body here and ships the reply pickled."""

    def __init__(self, body: AgentWorker):
        async def rollout(*args):
            return pickle.loads(pickle.dumps(await body.rollout(*args)))

        async def ready():
            return True

        self.rollout, self.ready = Method(rollout), Method(ready)


class Fleet:
    def engine_table(self):
        return []

    def report_dead(self, index, incarnation) -> None:
        raise AssertionError("no engine died")

    def add_request_counts(self, counts) -> None:
        pass

    def metrics(self) -> dict:
        return {}


def worker_body(replies: int) -> AgentWorker:
    body = AgentWorker.__new__(AgentWorker)  # its __init__ builds the agent from a config; this one is given
    body.name, body.held, body.engines, body.served = "w0", HeldRows(), Engines(), {}
    settings = GatewaySettings(sampling=SamplingParams(max_new_tokens=4), max_input_length=512)
    generator = Scripted(TOK, ["ok"] * replies)
    body.agent = AgentRollout(generator, TOK, forgetful_agent, settings, [TOK.eos_token_id], n_samples_per_prompt=2)
    return body


def test_gateway_counts_of_agent_workers_reach_the_drivers_metrics():
    cfg = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"))
    body = worker_body(replies=2 * 2 * 3)  # 3 samples x 2 trajectories x 2 calls
    workers = AgentWorkers(cfg, fleet=Fleet(), n=1, spawn=lambda cfg, index, concurrency, name: Handle(body))
    samples = [{"prompt_id": p} for p in ("a", "b", "c")]

    async def go():
        try:
            groups = await workers.rollout_groups(samples)
            assert [len(t) for g in groups for t in g.trajectories] == [2] * 6
            return Driver(asyncio.get_running_loop(), Fleet(), workers).fleet_metrics()
        finally:
            await body.agent.gateway.close()

    metrics = asyncio.run(go())
    body.agent.close()
    assert metrics["gateway/calls"] == 12 and metrics["rollout/prefix_breaks"] == 6
    assert metrics["gateway/ignored_sampling"] == 6  # the first call's temperature: the trainer's is used
    assert metrics["gateway/agent_errors"] == 0 and metrics["agents/workers"] == 1
    again = workers.metrics()  # counts since the last report, as the driver's own agent reports them
    assert "gateway/calls" not in again and again["agents/workers"] == 1
