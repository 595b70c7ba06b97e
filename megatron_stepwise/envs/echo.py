"""`echo`: a multi-turn task a tiny randomly initialised model learns on CPU in minutes.

Each turn the user says `say D` (D a digit); the assistant should answer with D as its first
word. Per turn: 1 if the first word is D, 0.5 if D appears anywhere in the answer, 0 otherwise;
each turn's score is divided by the number of turns, so the trajectory reward (the sum) is the
mean score in [0, 1]. The next prompt carries feedback (`good` / `no`) and the next digit.

Why it suits CI: with the 21-token `tiny_word` vocabulary a random policy already hits the digit
now and then (non-zero reward variance inside a prompt group), and copying a token from the
prompt is a single attention pattern a 2-layer model picks up within a few dozen RL steps.
"""

from __future__ import annotations

import random
from typing import Any

from megatron_stepwise.envs.base import EnvSpec, Message, StepOutput, register_env


class EchoEnv:
    def __init__(self) -> None:
        self.digits: list[int] = []
        self.turn = 0

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        digits = sample.get("digits")
        if not digits or not all(isinstance(d, int) and 0 <= d <= 9 for d in digits):
            raise ValueError(f"echo sample {sample.get('prompt_id')!r}: 'digits' must be a non-empty list of 0-9")
        self.digits = list(digits)
        self.turn = 0
        return [{"role": "user", "content": f"say {self.digits[0]}"}]

    def step(self, assistant_text: str) -> StepOutput:
        if self.turn >= len(self.digits):
            raise RuntimeError("echo: step() after the episode ended")
        target = str(self.digits[self.turn])
        words = assistant_text.split()
        score = 1.0 if words[:1] == [target] else 0.5 if target in words else 0.0
        self.turn += 1
        reward = score / len(self.digits)
        info = {"turn_score": score}
        if self.turn == len(self.digits):
            return [], reward, True, info
        feedback = "good" if score == 1.0 else "no"
        return [{"role": "user", "content": f"{feedback} say {self.digits[self.turn]}"}], reward, False, info


def echo_dataset(num_prompts: int = 64, num_turns: int = 3, seed: int = 0, num_digits: int = 10) -> list[dict]:
    """Deterministic prompts: `num_turns` digits each (drawn from 0..num_digits-1)."""
    if not 1 <= num_digits <= 10:
        raise ValueError(f"echo: num_digits must be in 1..10, got {num_digits}")
    rng = random.Random(seed)
    return [
        {"prompt_id": f"echo-{seed}-{i}", "digits": [rng.randrange(num_digits) for _ in range(num_turns)]}
        for i in range(num_prompts)
    ]


register_env(
    EnvSpec(
        name="echo",
        factory=EchoEnv,
        dataset=echo_dataset,
        tokenizer="tiny_word",
        description="repeat the digit the user says, over several turns (partial credit)",
        required_fields=("digits",),
    )
)
