"""Train your own agent as a program: `examples/echo_agent.py` as a command (docs/gateway.md).

    megatron-stepwise train configs/tiny_cpu.yaml env.agent_command="python examples/echo_agent_command.py"

Run from the repository's root (the command starts in the trainer's working directory, inside
the sandbox). It reads the sample from stdin, talks to `OPENAI_BASE_URL` with `OPENAI_API_KEY`
(its own trajectory's, set by the trainer) as to any OpenAI endpoint, and prints its outcome as
its last line: `{"reward": r, "turn_rewards": [...]}`.
"""

import json
import sys

from openai import OpenAI

from megatron_stepwise.envs.echo import EchoEnv


def main() -> None:
    sample = json.load(sys.stdin)
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    task = EchoEnv()
    messages = task.reset(sample)  # [{"role": "user", "content": "say 3"}]
    rewards, done = [], False
    while not done:
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content
        feedback, reward, done, _ = task.step(text)
        rewards.append(reward)
        messages = messages + [{"role": "assistant", "content": text}] + feedback
    client.close()
    print(json.dumps({"reward": sum(rewards), "turn_rewards": rewards}))


if __name__ == "__main__":
    main()
