"""A gateway served from a background event loop (so synchronous SDK clients can call it), and
generators that record what they received and sampled."""

from __future__ import annotations

import asyncio
import platform
import threading
from typing import Any, Optional

from megatron_stepwise.gateway.server import Gateway, GatewaySettings
from megatron_stepwise.rollout.agent.context import encode
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams
from megatron_stepwise.steps import TrajectoryID

# The SDK clients' first request asks `platform.processor()`, which runs `uname -p` once per
# process (then cached): asked here, at import, so no test starts a process (test-fast checks).
platform.processor()


class Recording:
    """Wraps a generator; `calls` holds (input_ids, output_ids, logprobs, sampling) per generate."""

    def __init__(self, inner: Any):
        self.inner, self.calls = inner, []

    async def generate(self, input_ids, sampling, rid=None, session=None):
        result = await self.inner.generate(input_ids, sampling, rid=rid, session=session)
        self.calls.append((list(input_ids), list(result.output_ids), list(result.logprobs), sampling))
        return result


class Scripted:
    """Answers with the given texts in turn (a random tiny model never writes a valid tool call):
    their token ids and the EOS, each with a made-up log-prob."""

    def __init__(self, tokenizer: Any, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, list(replies)

    async def generate(self, input_ids, sampling: SamplingParams, rid=None, session=None) -> GenerateResult:
        eos = self.tokenizer.eos_token_id
        ids = encode(self.tokenizer, self.replies.pop(0)) + [eos]
        return GenerateResult(ids, [-0.25] * len(ids), "stop", weight_version=3, matched=eos, engine="scripted")


class Served:
    """A started `Gateway` on its own thread's event loop."""

    def __init__(self, generator: Any, tokenizer: Any, settings: Optional[GatewaySettings] = None, engine: Any = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.recording = Recording(generator)
        self.tokenizer = tokenizer
        self.engine = engine  # closed on this loop before it stops (its scheduler task lives here)
        settings = settings or GatewaySettings(sampling=SamplingParams(max_new_tokens=8), max_input_length=1024)
        self.gateway = Gateway(self.recording, tokenizer, [tokenizer.eos_token_id], settings)
        self.run(self.gateway.start())

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open(self, prompt_id: str = "p", k: int = 0) -> str:
        return self.gateway.open(TrajectoryID(prompt_id, k))

    def close(self) -> None:
        self.run(self.gateway.close())
        if self.engine is not None:
            self.run(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def assert_exact(steps, calls) -> None:
    """Every step's prompt is what the engine received; its response what it sampled (an EOS the
    gateway appended after it is loss-masked), its log-probs the engine's."""
    assert len(steps) == len(calls)
    for step, (received, sampled, logprobs, _) in zip(steps, calls):
        assert step.prompt_ids.tolist() == received
        response = step.response_ids.tolist()
        assert response[: len(sampled)] == sampled
        assert step.loss_mask.tolist() == [1] * len(sampled) + [0] * (len(response) - len(sampled))
        assert step.rollout_logprobs.tolist()[: len(sampled)] == [float(x) for x in logprobs] or all(
            abs(a - b) < 1e-6 for a, b in zip(step.rollout_logprobs.tolist(), logprobs)
        )


def assert_exact_in_any_order(steps, calls) -> None:
    """`assert_exact` for steps of concurrent trajectories: each step matches one call of its own."""
    left = list(calls)
    for step in steps:
        n = int(step.loss_mask.sum())
        key = (step.prompt_ids.tolist(), step.response_ids.tolist()[:n])
        match = next((c for c in left if (c[0], c[1]) == key), None)
        assert match is not None, (
            f"step {step.trajectory_id}/{step.metadata.get('turn')}: no call received and sampled it"
        )
        left.remove(match)
        assert_exact([step], [match])
    assert not left, f"{len(left)} calls recorded as no step"


def window_agent(client, turns: int = 6) -> list[list[dict]]:
    """A context-managing agent: each call sends the system prompt, the last two exchanges and a
    new question (from the fourth call on it drops a turn: a prefix break). Returns what it sent."""
    system = {"role": "system", "content": "answer"}
    history: list[dict] = []
    sent = []
    for turn in range(turns):
        window = [system] + history[-4:] + [{"role": "user", "content": f"say {turn}"}]
        sent.append(window)
        out = client.chat.completions.create(model="m", messages=window)
        history += [window[-1], {"role": "assistant", "content": out.choices[0].message.content}]
    return sent


def record_window_agent(rewards=(1.0, 0.0), turns: int = 6) -> tuple[list, list, dict]:
    """`window_agent` through a gateway over the tiny embedded engine (`tiny_bpe`), one
    trajectory per reward, all of one prompt: (steps, the engine's calls, the gateway's counts).
    CPU only, a few seconds; needs the `openai` SDK."""
    import openai

    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
    from tests.helpers import tiny_lm

    tok, config = tiny_lm("tiny_bpe")
    engine = LocalEngine(config, tokenizer=tok, eos_token_ids=[tok.eos_token_id], seed=0)
    served = Served(engine, tok, engine=engine)
    try:
        steps = []
        for k, reward in enumerate(rewards):
            url = served.open("window", k)
            window_agent(openai.OpenAI(base_url=url, api_key=served.gateway.api_key, max_retries=0), turns)
            steps += served.gateway.finish(url, reward)
        return steps, list(served.recording.calls), dict(served.gateway.counts)
    finally:
        served.close()
