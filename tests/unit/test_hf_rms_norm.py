"""HFRoundedRMSNorm (the local spec's norm) rounds as transformers' Qwen2RMSNorm in bf16, where
torch.nn.RMSNorm does not, and is torch's RMSNorm in fp32."""

from types import SimpleNamespace

import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from megatron_stepwise.mcore.train.hf_rms_norm import HFRoundedRMSNorm


def _norms(dtype: torch.dtype, hidden: int = 256):
    weight = 1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(1))
    config = SimpleNamespace(params_dtype=dtype, sequence_parallel=False)
    ours, hf = HFRoundedRMSNorm(config, hidden, eps=1e-6), Qwen2RMSNorm(hidden, eps=1e-6).to(dtype)
    plain = torch.nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
    for norm in (ours, hf, plain):
        norm.weight.data.copy_(weight)
    x = torch.randn(512, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    return ours(x), hf(x), plain(x)


def test_bf16_output_is_transformers_bit_for_bit_and_not_torchs_single_rounding():
    ours, hf, plain = _norms(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, hf)
    assert (ours != plain).float().mean() > 0.05  # the difference the class exists for


def test_fp32_output_is_torchs_rms_norm():
    ours, hf, plain = _norms(torch.float32)
    torch.testing.assert_close(ours, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=1e-6)


def test_gradients_reach_the_input_and_the_weight():
    config = SimpleNamespace(params_dtype=torch.float32, sequence_parallel=True)
    norm = HFRoundedRMSNorm(config, 8, eps=1e-6)
    x = torch.randn(4, 8, requires_grad=True)
    (norm(x) * torch.arange(8.0)).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    assert norm.weight.sequence_parallel is True
