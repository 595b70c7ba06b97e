"""MoE router losses (balance and z-loss) in the step-wise loss.

Their invariance to every split (micro-batches, DP, CP, TP+SP, EP, PP, the per-token loss mode)
is checked by the MoE layouts of test_megatron_parallel.py, which train with both coefficients
on. Here: that what is trained is the documented loss (tests/workers/router_loss_worker.py re-computes
it row by row, in plain torch, from the routers' own logits and routing maps), that the metrics
report it, and that configuration refuses what cannot work.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers import check_ok, run_torchrun  # noqa: E402

from megatron_stepwise.algo.losses import LossConfig  # noqa: E402
from megatron_stepwise.mcore.train.router_losses import check_recompute  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("router_losses")
    # budget 40: several micro-batches, so the loss is summed over them
    check_ok(
        run_torchrun(
            "router_loss_worker.py",
            1,
            ["--out", str(out), "--budget", "40"],
            timeout=600,
            env={"CUDA_VISIBLE_DEVICES": ""},
        )
    )
    return torch.load(out / "router_losses.pt", weights_only=False)


def test_the_trained_gradient_is_the_documented_losses(result):
    added, direct = result["added"], result["direct"]
    router = [k for k in direct if k.endswith("mlp.router.weight")]
    assert len(router) == 4 and all(float(direct[k].abs().max()) > 1e-4 for k in router)
    for name, want in direct.items():
        err = float((added[name] - want).abs().max())
        assert err <= 1e-5 * float(want.abs().max()) + 1e-9, f"{name}: max |diff| {err:.3e}"


def test_metrics_report_the_losses_and_expert_load(result):
    got, want = result["metrics"], result["direct_values"]
    assert set(got) == set(want)
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-6 * max(abs(value), 1.0), f"{key}: {got[key]} vs {value}"
    assert want["moe/expert_load_max"] > 1.0 > want["moe/expert_load_min"] > 0.0
    # The metrics do not depend on the coefficients: they are reported with the losses off too.
    for key, value in result["metrics_without_coefficients"].items():
        assert abs(value - got[key]) <= 1e-6 * max(abs(value), 1.0), key


def test_coefficients_are_checked():
    with pytest.raises(ValueError, match="algo.loss.router_aux_coef"):
        LossConfig(router_aux_coef=-0.1)
    with pytest.raises(ValueError, match="algo.loss.router_z_coef"):
        LossConfig(router_z_coef=-1.0)


class _Config:
    def __init__(self, granularity, modules):
        self.recompute_granularity = granularity
        self.recompute_modules = modules


@pytest.mark.parametrize("granularity,modules", [("full", None), ("selective", ["moe"])])
def test_recomputed_routers_are_refused(granularity, modules):
    with pytest.raises(ValueError, match="activation recomputation"):
        check_recompute(_Config(granularity, modules))
    check_recompute(_Config("selective", ["core_attn"]))  # routers are not recomputed: fine
