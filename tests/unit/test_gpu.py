"""CUDA-only checks (`pytest -m gpu` on a GPU machine; skipped without one): the policy losses,
their per-row (GSPO, sequence-level TIS / IcePop) reductions included, give on CUDA tensors what
they give on the CPU. The GPU training step itself is measured by tools/bench/bench_gpu.py,
tools/bench/bench_trainer_step.py --device cuda and tools/bench/bench_engine_agreement.py."""

import pytest
import torch

from megatron_stepwise import LossConfig, LossInputs, policy_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: runs on a GPU machine with `pytest -m gpu` (tools/gpu_check.sh)",
    ),
]

LOSS_CONFIGS = [
    LossConfig(policy_loss="ppo", clip_c=3.0),
    LossConfig(policy_loss="gspo", reduction="step_mean"),
    LossConfig(policy_loss="cispo"),
    LossConfig(policy_loss="ppo", tis="sequence", kl_coef=0.1, entropy_coef=0.01),
    LossConfig(policy_loss="ppo", icepop_low=0.5, icepop_high=2.0, icepop_level="sequence"),
]


def _inputs(device: str, n: int = 64) -> LossInputs:
    g = torch.Generator().manual_seed(0)
    r = lambda scale=0.1: (scale * torch.randn(n, generator=g, dtype=torch.float64)).to(device)  # noqa: E731
    return LossInputs(
        logprobs=(r() - 1.0).requires_grad_(True),
        old_logprobs=r() - 1.0,
        advantages=r(1.0),
        weights=torch.full((n,), 1.0 / n, dtype=torch.float64, device=device),
        segment_ids=(torch.arange(n) // 8).to(device),
        rollout_logprobs=r() - 1.0,
        ref_logprobs=r() - 1.0,
        entropy=r(1.0).abs().requires_grad_(True),
    )


@pytest.mark.parametrize("cfg", LOSS_CONFIGS, ids=lambda c: f"{c.policy_loss}-tis_{c.tis}-icepop_{c.uses_icepop}")
def test_policy_losses_on_cuda_equal_cpu(cfg):
    out = {}
    for device in ("cpu", "cuda"):
        inputs = _inputs(device)
        loss, metrics = policy_loss(inputs, cfg)
        loss.backward()
        out[device] = (
            loss.detach().cpu(),
            inputs.logprobs.grad.cpu(),
            {k: v.detach().cpu() for k, v in metrics.items()},
        )
    (l_cpu, g_cpu, m_cpu), (l_gpu, g_gpu, m_gpu) = out["cpu"], out["cuda"]
    torch.testing.assert_close(l_gpu, l_cpu)
    torch.testing.assert_close(g_gpu, g_cpu)
    assert m_gpu.keys() == m_cpu.keys()
    for k in m_cpu:
        torch.testing.assert_close(m_gpu[k], m_cpu[k], msg=k)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_one_call_packed_attention_equals_per_row_on_cuda(dtype, tol):
    """The local spec's one-call packed attention (a GPU's default) against the per-row path on
    CUDA kernels (flash / memory-efficient SDPA), outputs and gradients, GQA, mixed row lengths."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_stepwise.mcore.train.local_layers import PackedCausalAttention

    cfg = TransformerConfig(
        num_layers=1, hidden_size=14 * 64, num_attention_heads=14, num_query_groups=2, kv_channels=64
    )
    lengths = [700, 3, 1, 250, 64]
    cu = torch.tensor([0, 700, 703, 704, 954, 1018], dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1018, n, 64, generator=g).to("cuda", dtype) for n in (14, 2, 2)]
    runs = {}
    for mode in ("one_call", "per_row"):
        attn = PackedCausalAttention(cfg, 1, AttnMaskType.causal, "self", packed_attention=mode)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=700, max_seqlen_kv=700)
        inputs = [t.clone().requires_grad_() for t in base]
        out = attn(*inputs, None, packed_seq_params=psp)
        out.float().square().mean().backward()
        runs[mode] = [out, *(t.grad for t in inputs)]
    assert sum(lengths) == 1018
    for got, want in zip(runs["one_call"], runs["per_row"]):
        assert float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())
