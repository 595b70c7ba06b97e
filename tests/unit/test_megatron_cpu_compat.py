"""The CPU compatibility layer: redirects CUDA device uses while active, restores on exit."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_stepwise.mcore.runtime import cpu_compat  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inert on a GPU machine")


def test_cuda_device_uses_land_on_cpu_and_are_restored():
    original_current_device = torch.cuda.current_device
    with cpu_compat.cpu_compat() as active:
        assert active and cpu_compat.cpu_compat_active()
        # schedules' token counter / default causal mask style allocations
        t = torch.zeros([], dtype=torch.int, device="cuda")
        assert t.device.type == "cpu"
        m = torch.triu(torch.ones(3, 3, device="cuda"), diagonal=1).bool()
        assert m.device.type == "cpu" and m.sum() == 3
        # p2p / buffers: device=torch.cuda.current_device()
        buf = torch.empty((2,), device=torch.cuda.current_device())
        assert buf.device.type == "cpu"
        x = torch.arange(4.0)
        assert x.cuda() is x and x.to("cuda").device.type == "cpu"
        # optimizer dtype checks
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        # explicit conversions are untouched
        assert x.type(torch.float64).dtype == torch.float64
        torch.cuda.synchronize()
    assert not cpu_compat.cpu_compat_active()
    assert torch.cuda.current_device is original_current_device
    assert torch.arange(2.0).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_nested_use_is_reference_counted():
    with cpu_compat.cpu_compat():
        with cpu_compat.cpu_compat():
            pass
        assert cpu_compat.cpu_compat_active()
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert not cpu_compat.cpu_compat_active()


def test_rng_tracker_runs_on_the_cpu_generator_and_is_reproducible():
    from megatron.core import tensor_parallel

    with cpu_compat.cpu_compat():
        tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(5)
        # fork() leaves the default stream where it was
        assert torch.equal(before, torch.get_rng_state())
        with tracker.fork():
            b = torch.rand(5)
        tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
        with tracker.fork():
            a2 = torch.rand(5)
    assert not torch.equal(a, b)  # the tracked stream advanced
    assert torch.equal(a, a2)  # and is reproducible from the seed


def test_numerics_are_unchanged():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    ref = torch.softmax(x @ w, dim=-1)
    with cpu_compat.cpu_compat():
        out = torch.softmax(x @ w, dim=-1)
    assert torch.equal(ref, out)
