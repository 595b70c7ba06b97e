"""RMSNorm rounded the way the rollout engine's model rounds it, for the local spec.

In bf16, `torch.nn.RMSNorm` multiplies the fp32-normalised input by the weight in fp32 and
rounds once; Hugging Face transformers' Llama/Qwen2/Qwen3 RMSNorm (the embedded engine's) rounds
the normalised input to bf16 first and multiplies by the bf16 weight, a second rounding.
One rounding is marginally closer to exact, but where the two differ (a quarter of the elements at
non-unit weights) the trainer's bf16 log-probs drift from the engine's: on SmolLM2-135M's weights
on CPU that was the whole difference, 0.5 max (docs/megatron.md, "bf16 agreement with the
engine"). In fp32 the two are the same function.
"""

from __future__ import annotations

import torch

from megatron_stepwise.mcore.train import fused_ops
from megatron_stepwise.mcore.train.local_layers import LocalRMSNorm


class HFRoundedRMSNorm(LocalRMSNorm):
    """`LocalRMSNorm` computing HF's `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)` (x in fp32);
    `fused` (model.fused_elementwise): the same formula compiled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_ops.hf_rounded_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
