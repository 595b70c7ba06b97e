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
