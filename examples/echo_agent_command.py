"""Train your own agent as a program: `examples/echo_agent.py` as a command (docs/gateway.md).

    megatron-stepwise train configs/tiny_cpu.yaml env.agent_command="python examples/echo_agent_command.py"

Run from the repository's root (the command starts in the trainer's working directory, inside
the sandbox). It reads the sample from stdin, runs the same OpenAI-SDK agent against
`OPENAI_BASE_URL` with `OPENAI_API_KEY` (its own trajectory's, both set by the trainer), and
prints the outcome as its last line: `{"reward": r, "turn_rewards": [...]}`.
"""

import json
import os
import sys

from echo_agent import solve  # the script's own directory is on sys.path

if __name__ == "__main__":
    sample = json.load(sys.stdin)
    print(json.dumps(solve(sample, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])))
