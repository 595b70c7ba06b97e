"""Host cost of one gateway call beside one native agent-loop turn (prints figures; never asserts).

The same `echo` trajectories (`--turns` turns each, `tiny_bpe`, an engine that answers at once)
run twice in one process: through the native `AgentLoop` (token mode), and through the gateway
driven by agents (`--client`, all by default, side by side: bare aiohttp requests, which leave
the gateway's own cost; `AsyncOpenAI`; the synchronous client on the agent pool's threads, with
one shared `httpx.Client` or a client built per trajectory, whose TLS context costs ~40 ms). Figure: process CPU milliseconds per call (every thread counts: the
gateway's HTTP server, the SDK client, rendering, the step), median of `--repeats` after a warm-up.
The difference is what the gateway costs per call, its client included.

    python tools/bench/bench_gateway_cost.py [--prompts 8] [--turns 8] [--client raw async shared sync]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
from instant_engine import InstantEngine  # noqa: E402

from megatron_stepwise.envs.echo import EchoEnv, echo_dataset  # noqa: E402
from megatron_stepwise.gateway.agents import AgentRollout  # noqa: E402
from megatron_stepwise.gateway.server import GatewaySettings  # noqa: E402
from megatron_stepwise.hf.tokenizers import load_tokenizer  # noqa: E402
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig  # noqa: E402
from megatron_stepwise.rollout.engines.protocol import SamplingParams  # noqa: E402

CLIENTS = {
    "raw": "bare aiohttp requests (the gateway's own cost)",
    "async": "AsyncOpenAI, a client per trajectory",
    "shared": "OpenAI on threads, one shared httpx.Client",
    "sync": "OpenAI on threads, a client per trajectory",
}


def echo_agent(client: str):
    def play(sample):
        task = EchoEnv()
        return task, task.reset(sample)

    async def solve_async(sample, base_url, api_key):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        task, messages = play(sample)
        done, total = False, 0.0
        while not done:
            text = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message.content
            feedback, reward, done, _ = task.step(text)
            total += reward
            messages = messages + [{"role": "assistant", "content": text}] + feedback
        await client.close()
        return total

    async def solve_raw(sample, base_url, api_key):
        headers = {"Authorization": f"Bearer {api_key}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            task, messages = play(sample)
            done, total = False, 0.0
            while not done:
                async with http.post(base_url + "/chat/completions", json={"model": "m", "messages": messages}) as r:
                    text = (await r.json())["choices"][0]["message"]["content"]
                feedback, reward, done, _ = task.step(text)
                total += reward
                messages = messages + [{"role": "assistant", "content": text}] + feedback
        return total

    shared = httpx.Client()  # one connection pool for every trajectory (examples/echo_agent.py)

    def solve_sync(sample, base_url, api_key, http_client=None):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        task, messages = play(sample)
        done, total = False, 0.0
        while not done:
            text = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            feedback, reward, done, _ = task.step(text)
            total += reward
            messages = messages + [{"role": "assistant", "content": text}] + feedback
        if http_client is None:
            client.close()
        return total

    def solve_shared(sample, base_url, api_key):
        return solve_sync(sample, base_url, api_key, shared)

    return {"sync": solve_sync, "shared": solve_shared, "async": solve_async, "raw": solve_raw}[client]


def timed(run, calls: int, repeats: int) -> tuple[float, float]:
    """(CPU ms per call, wall ms per call), medians."""
    run()  # warm-up
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        run()
        cpu.append((time.process_time() - c) * 1e3 / calls)
        wall.append((time.perf_counter() - w) * 1e3 / calls)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--client",
        nargs="+",
        choices=tuple(CLIENTS),
        default=list(CLIENTS),
        help="which agents to measure, side by side in one run (default: all): "
        + "; ".join(f"{k}: {v}" for k, v in CLIENTS.items()),
    )
    args = p.parse_args()
    tok = load_tokenizer("tiny_bpe")
    engine = InstantEngine(tok, args.new_tokens)
    samples = echo_dataset(args.prompts, args.turns, num_digits=4)
    calls = args.prompts * args.samples * args.turns
    sampling = SamplingParams(max_new_tokens=args.new_tokens)
    loop = asyncio.new_event_loop()

    native = AgentLoop(
        engine,
        tok,
        EchoEnv,
        AgentLoopConfig(
            n_samples_per_prompt=args.samples,
            max_turns=args.turns,
            context="tokens",
            sampling=sampling,
            max_input_length=1 << 20,
            drift_sample_rate=0.0,
        ),
    )
    settings = GatewaySettings(sampling=sampling, max_input_length=1 << 20)
    print(f"{calls} calls per rollout ({args.prompts} prompts x {args.samples} samples x {args.turns} turns)")
    n_cpu, n_wall = timed(lambda: loop.run_until_complete(native.rollout(samples)), calls, args.repeats)
    print(f"native agent loop (tokens): {n_cpu:.3f} ms CPU / {n_wall:.3f} ms wall per turn")
    for client in args.client:
        gateway = AgentRollout(engine, tok, echo_agent(client), settings, [tok.eos_token_id], args.samples)
        g_cpu, g_wall = timed(lambda: loop.run_until_complete(gateway.rollout(samples)), calls, args.repeats)
        print(
            f"gateway + {CLIENTS[client]}: {g_cpu:.3f} ms CPU / {g_wall:.3f} ms wall per call "
            f"({g_cpu - n_cpu:+.3f} ms CPU beside the native turn)"
        )
        gateway.close()
        loop.run_until_complete(gateway.gateway.close())
    native.close()


if __name__ == "__main__":
    main()
