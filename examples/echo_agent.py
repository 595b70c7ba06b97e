"""Train your own agent: a plain OpenAI-SDK program that plays the `echo` task (docs/gateway.md).

    megatron-stepwise train configs/tiny_cpu.yaml env.agent=examples.echo_agent:solve

Nothing in it knows about training: it talks to `base_url` as to any OpenAI endpoint, and each
of its calls becomes one step of its trajectory. The reward is its own business (here the echo
environment's scoring, used as a plain Python object).
"""

import httpx
from openai import OpenAI

from megatron_stepwise.envs.echo import EchoEnv

# One HTTP connection pool for every trajectory: a client of its own costs ~40 ms of CPU to build
# (its TLS context), more than a tiny model's whole turn. httpx.Client is safe across threads.
HTTP = httpx.Client()


def solve(sample: dict, base_url: str, api_key: str) -> dict:
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=HTTP)
    task = EchoEnv()
    messages = task.reset(sample)  # [{"role": "user", "content": "say 3"}]
    rewards, done = [], False
    while not done:
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content
        feedback, reward, done, _ = task.step(text)
        rewards.append(reward)
        messages = messages + [{"role": "assistant", "content": text}] + feedback
    return {"reward": sum(rewards), "turn_rewards": rewards}
