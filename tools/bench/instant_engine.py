"""An engine that answers at once, for benchmarks of the rollout side's host work."""

from __future__ import annotations

from megatron_stepwise.rollout.agent.context import encode
from megatron_stepwise.rollout.engines.protocol import GenerateResult


class InstantEngine:
    """Answers every request at once with the same `new_tokens` ids (no model: only host work is left)."""

    def __init__(self, tokenizer, new_tokens: int = 32):
        ids = encode(tokenizer, "7 is the digit you asked for, and here it is again: 7. " * 8)
        eos = tokenizer.eos_token_id
        self.ids = [t for t in ids if t != eos][:new_tokens]

    async def generate(self, input_ids, sampling, rid=None, session=None) -> GenerateResult:
        return GenerateResult(
            output_ids=list(self.ids), logprobs=[-0.5] * len(self.ids), finish_reason="length", engine="instant"
        )
