"""Policy losses: clip / dual-clip / TIS / IcePop boundaries, GSPO, CISPO, KL, entropy, errors."""

import math

import pytest
import torch
from helpers import run_launch

from megatron_stepwise import (
    LossConfig,
    LossInputs,
    check_loss_compatibility,
    combine_metric_partials,
    list_policy_losses,
    policy_loss,
    register_policy_loss,
)
from megatron_stepwise.algo.losses import kl_estimate

D = 1e-3  # "just inside / just outside" a bound, relative


def _inputs(lp, adv, *, old=None, w=None, seg=None, rollout=None, ref=None, ent=None):
    n = len(lp)
    f = lambda x: None if x is None else torch.tensor(x, dtype=torch.float64)  # noqa: E731
    inputs = LossInputs(
        logprobs=torch.tensor(lp, dtype=torch.float64, requires_grad=True),
        old_logprobs=f(old) if old is not None else torch.zeros(n, dtype=torch.float64),
        advantages=f(adv),
        weights=f(w) if w is not None else torch.ones(n, dtype=torch.float64),
        segment_ids=torch.tensor(seg if seg is not None else list(range(n)), dtype=torch.long),
        rollout_logprobs=f(rollout),
        ref_logprobs=f(ref),
        entropy=None if ent is None else torch.tensor(ent, dtype=torch.float64, requires_grad=True),
    )
    return inputs


def _run(inputs, cfg):
    loss, metrics = policy_loss(inputs, cfg)
    loss.backward()
    return loss.item(), inputs.logprobs.grad, metrics


# ----------------------------------------------------------------------------- PPO clip / dual clip

PPO = LossConfig(clip_low=0.1, clip_high=0.3)
DUAL = LossConfig(clip_low=0.1, clip_high=0.3, clip_c=3.0)


@pytest.mark.parametrize(
    "cfg, adv, ratio, value, grad, flag",
    [
        # A > 0: clipped above 1 + clip_high
        (PPO, 1.0, 1.3 * (1 - D), -1.3 * (1 - D), -1.3 * (1 - D), None),
        (PPO, 1.0, 1.3 * (1 + D), -1.3, 0.0, "clipfrac_high"),
        # A < 0: clipped below 1 - clip_low
        (PPO, -1.0, 0.9 * (1 + D), 0.9 * (1 + D), 0.9 * (1 + D), None),
        (PPO, -1.0, 0.9 * (1 - D), 0.9, 0.0, "clipfrac_low"),
        # the pessimistic side is never clipped
        (PPO, 1.0, 0.5, -0.5, -0.5, None),
        (PPO, -1.0, 2.0, 2.0, 2.0, None),
        # dual clip: A < 0, loss capped at -A * clip_c
        (DUAL, -1.0, 3.0 * (1 - D), 3.0 * (1 - D), 3.0 * (1 - D), None),
        (DUAL, -1.0, 3.0 * (1 + D), 3.0, 0.0, "clipfrac_dual"),
        (DUAL, 1.0, 3.0 * (1 + D), -1.3, 0.0, "clipfrac_high"),
    ],
)
def test_ppo_clip_boundaries(cfg, adv, ratio, value, grad, flag):
    loss, g, m = _run(_inputs([math.log(ratio)], [adv]), cfg)
    assert loss == pytest.approx(value, rel=1e-9)
    assert g.item() == pytest.approx(grad, rel=1e-9, abs=1e-12)
    flags = [k for k in ("clipfrac_low", "clipfrac_high", "clipfrac_dual") if k in m and m[k].item() != 0]
    assert flags == ([flag] if flag else [])


def test_ppo_asymmetric_clip_and_weighted_clip_fractions():
    # Two tokens with weights 0.25 / 0.75: the first is clipped high, so clipfrac_high = 0.25.
    inputs = _inputs([math.log(1.35), math.log(1.25)], [1.0, 1.0], w=[0.25, 0.75])
    loss, g, m = _run(inputs, LossConfig(clip_low=0.1, clip_high=0.3))
    assert loss == pytest.approx(-(0.25 * 1.3 + 0.75 * 1.25))
    assert g.tolist() == pytest.approx([0.0, -0.75 * 1.25])
    assert m["clipfrac_high"].item() == pytest.approx(0.25) and m["clipfrac_low"].item() == 0
    assert m["pg_loss"].item() == pytest.approx(loss) and m["loss_weight_sum"].item() == pytest.approx(1.0)


# ----------------------------------------------------------------------------- off-policy correction


@pytest.mark.parametrize(
    "rho, weight, capped", [(2.0 * (1 - D), 2.0 * (1 - D), 0.0), (2.0 * (1 + D), 2.0, 1.0), (0.3, 0.3, 0.0)]
)
def test_token_tis_truncates_above_the_cap(rho, weight, capped):
    # ratio = 1, A = 1: pg = -1, scaled by the truncated old/rollout ratio.
    inputs = _inputs([-1.0], [1.0], old=[-1.0], rollout=[-1.0 - math.log(rho)])
    loss, g, m = _run(inputs, LossConfig(tis="token", tis_cap=2.0))
    assert loss == pytest.approx(-weight, rel=1e-9)
    assert g.item() == pytest.approx(-weight, rel=1e-9)
    assert m["tis_weight_mean"].item() == pytest.approx(weight)
    assert m["tis_weight_max"].item() == pytest.approx(weight)
    assert m["tis_capped_frac"].item() == capped
    assert m["logprob_gap"].item() == pytest.approx(abs(math.log(rho)))


def test_sequence_tis_uses_each_steps_product_ratio():
    # step 0: 1.5 * 1.5 = 2.25 > cap -> 2 on both tokens; step 1: 1.2 * 1.6 = 1.92 -> 1.92 on both.
    rho = [1.5, 1.5, 1.2, 1.6]
    inputs = _inputs([0.0] * 4, [1.0] * 4, w=[0.25] * 4, seg=[7, 7, 3, 3], rollout=[-math.log(r) for r in rho])
    loss, g, m = _run(inputs, LossConfig(tis="sequence", tis_cap=2.0))
    weights = [2.0, 2.0, 1.92, 1.92]
    assert loss == pytest.approx(-0.25 * sum(weights))
    assert g.tolist() == pytest.approx([-0.25 * x for x in weights])
    assert m["tis_capped_frac"].item() == pytest.approx(0.5)
    assert m["tis_weight_max"].item() == pytest.approx(2.0)
    assert m["logprob_gap_max"].item() == pytest.approx(math.log(1.6))


@pytest.mark.parametrize(
    "rho, kept", [(2.0 * (1 - D), True), (2.0 * (1 + D), False), (0.5 * (1 + D), True), (0.5 * (1 - D), False)]
)
def test_icepop_token_band(rho, kept):
    inputs = _inputs([0.0], [1.0], rollout=[-math.log(rho)])
    loss, g, m = _run(inputs, LossConfig(icepop_low=0.5, icepop_high=2.0))
    assert loss == pytest.approx(-1.0 if kept else 0.0)
    assert g.item() == (pytest.approx(-1.0) if kept else 0.0)
    assert m["icepop_masked_frac"].item() == (0.0 if kept else 1.0)


def test_icepop_one_sided_and_sequence_level():
    # Only an upper bound: a tiny ratio is kept.
    _, g, _ = _run(_inputs([0.0], [1.0], rollout=[-math.log(0.01)]), LossConfig(icepop_high=2.0))
    assert g.item() == pytest.approx(-1.0)
    # Sequence level: step 0 ratios (3.0, 1.2) -> geometric mean 1.897: kept, though 3.0 alone is out;
    # step 1 ratios (2.5, 1.7) -> 2.06: the whole step is masked.
    rho = [3.0, 1.2, 2.5, 1.7]
    inputs = _inputs([0.0] * 4, [1.0] * 4, w=[0.25] * 4, seg=[0, 0, 1, 1], rollout=[-math.log(r) for r in rho])
    loss, g, m = _run(inputs, LossConfig(icepop_low=0.5, icepop_high=2.0, icepop_level="sequence"))
    assert g.tolist() == pytest.approx([-0.25, -0.25, 0.0, 0.0])
    assert loss == pytest.approx(-0.5) and m["icepop_masked_frac"].item() == pytest.approx(0.5)


def test_tis_and_icepop_compose():
    rho = [1.5, 3.0]
    inputs = _inputs([0.0, 0.0], [1.0, 1.0], rollout=[-math.log(r) for r in rho])
    _, g, _ = _run(inputs, LossConfig(tis="token", tis_cap=4.0, icepop_high=2.0))
    assert g.tolist() == pytest.approx([-1.5, 0.0])


# ----------------------------------------------------------------------------- GSPO and CISPO


def test_gspo_clips_the_steps_ratio_not_the_tokens():
    # step 0: log-ratios (0.1, 0.3) -> s = e^0.2 = 1.221 > 1.2 with A > 0: both tokens clipped,
    # although token 0's own ratio e^0.1 is inside. step 1: s = e^-0.2 = 0.819, inside.
    inputs = _inputs([0.1, 0.3, -0.2], [1.0, 1.0, -1.0], w=[0.25, 0.25, 0.5], seg=[0, 0, 1])
    loss, g, m = _run(inputs, LossConfig(policy_loss="gspo"))
    s1 = math.exp(-0.2)
    assert loss == pytest.approx(-0.5 * 1.2 + 0.5 * s1)
    assert g.tolist() == pytest.approx([0.0, 0.0, 0.5 * s1])
    assert m["clipfrac_high"].item() == pytest.approx(0.5)


def test_gspo_gradient_equals_sequence_level_objective():
    # With step_mean weights (1 / (n_step * S)), GSPO-token's gradient is the gradient of
    # mean over steps of -A * exp(mean_t(logp - old)).
    lp, old, adv, seg = [-1.0, -0.5, -2.0], [-1.05, -0.45, -1.9], [0.7, 0.7, -0.4], [0, 0, 1]
    w = [0.25, 0.25, 0.5]
    _, g, _ = _run(_inputs(lp, adv, old=old, w=w, seg=seg), LossConfig(policy_loss="gspo", clip_low=0.5, clip_high=0.5))
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    o = torch.tensor(old, dtype=torch.float64)
    s0 = torch.exp((x[:2] - o[:2]).mean())
    s1 = torch.exp(x[2] - o[2])
    ((-0.7 * s0 + 0.4 * s1) / 2).backward()
    assert torch.allclose(g, x.grad)


def test_gspo_token_keeps_per_token_advantages_and_weights():
    # GSPO-token: each token's gradient is -A_t * w_t * s (value of the step ratio, own log-prob's
    # gradient), which matters once advantages or weights differ inside a step.
    lp, old = [-1.0, -2.0], [-1.02, -1.96]
    _, g, _ = _run(_inputs(lp, [1.0, -0.5], old=old, w=[0.3, 0.2], seg=[4, 4]), LossConfig(policy_loss="gspo"))
    s = math.exp(((lp[0] - old[0]) + (lp[1] - old[1])) / 2)
    assert g.tolist() == pytest.approx([-0.3 * s, 0.1 * s])


@pytest.mark.parametrize(
    "adv, ratio, iw, flag",
    [(1.0, 1.1, 1.1, None), (1.0, 1.5, 1.2, "clipfrac_high"), (-1.0, 0.5, 0.8, "clipfrac_low")],
)
def test_cispo_clips_the_weight_but_keeps_the_gradient(adv, ratio, iw, flag):
    lp = math.log(ratio) - 1.0
    loss, g, m = _run(_inputs([lp], [adv], old=[-1.0]), LossConfig(policy_loss="cispo"))
    assert loss == pytest.approx(-iw * adv * lp)
    assert g.item() == pytest.approx(-iw * adv)  # nonzero even when clipped
    flags = [k for k in ("clipfrac_low", "clipfrac_high") if m[k].item() != 0]
    assert flags == ([flag] if flag else [])


# ----------------------------------------------------------------------------- KL and entropy


@pytest.mark.parametrize(
    "est, d, value, grad",
    [
        ("k1", 0.5, 0.5, 1.0),
        ("k1", -0.5, -0.5, 1.0),
        ("k2", 0.5, 0.125, 0.5),
        ("k2", -0.5, 0.125, -0.5),
        ("k3", 0.5, math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),
        ("k3", -0.5, math.exp(0.5) - 1.5, 1 - math.exp(0.5)),
    ],
)
def test_kl_estimators_by_hand(est, d, value, grad):
    # d = logp - ref_logp. A = 0 so only the KL term remains, weight 0.5, coefficient 0.1.
    inputs = _inputs([-1.0], [0.0], old=[-1.0], w=[0.5], ref=[-1.0 - d])
    loss, g, m = _run(inputs, LossConfig(kl_coef=0.1, kl_estimator=est))
    assert m["kl"].item() == pytest.approx(0.5 * value)
    assert loss == pytest.approx(0.1 * 0.5 * value)
    assert g.item() == pytest.approx(0.1 * 0.5 * grad)
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-d]), est).item() == pytest.approx(value, rel=1e-6)


def test_kl_is_a_metric_even_without_coefficient():
    loss, g, m = _run(_inputs([-1.0], [0.0], old=[-1.0], ref=[-1.5]), LossConfig(kl_estimator="k1"))
    assert m["kl"].item() == pytest.approx(0.5) and loss == 0.0 and g.item() == 0.0


def test_entropy_bonus_lowers_the_loss_and_pushes_entropy_up():
    inputs = _inputs([-1.0], [0.0], old=[-1.0], w=[0.5], ent=[2.0])
    loss, metrics = policy_loss(inputs, LossConfig(entropy_coef=0.1))
    loss.backward()
    assert loss.item() == pytest.approx(-0.1 * 0.5 * 2.0)
    assert inputs.entropy.grad.item() == pytest.approx(-0.05)  # descent raises entropy
    assert metrics["entropy"].item() == pytest.approx(1.0)


# ----------------------------------------------------------------------------- metrics and errors


def test_combine_metric_partials_sums_and_maxes():
    a = {"pg_loss": torch.tensor(1.0), "tis_weight_max": torch.tensor(1.5)}
    b = {"pg_loss": torch.tensor(2.0), "tis_weight_max": torch.tensor(1.2)}
    out = combine_metric_partials([a, b])
    assert out["pg_loss"].item() == 3.0 and out["tis_weight_max"].item() == 1.5


def test_empty_micro_batch_gives_a_zero_partial():
    loss, g, m = _run(_inputs([], []), LossConfig())
    assert loss == 0.0 and g.numel() == 0 and m["num_tokens"].item() == 0


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(clip_c=1.0), "algo.loss.clip_c"),
        (dict(clip_low=1.0), "algo.loss.clip_low"),
        (dict(clip_low=-0.1), "algo.loss.clip_low"),
        (dict(clip_high=-0.1), "algo.loss.clip_high"),
        (dict(policy_loss="nope"), "algo.loss.policy_loss"),
        (dict(max_response_len=0), "algo.loss.max_response_len"),
        (dict(kl_coef=-1.0), "algo.loss.kl_coef"),
        (dict(icepop_low=-0.1), "algo.loss.icepop_low"),
        (dict(icepop_high=1.0), "algo.loss.icepop_high"),
        (dict(reduction="sum"), "algo.loss.reduction"),
        (dict(reduction="seq_mean_token_sum_norm"), "algo.loss.max_response_len"),
        (dict(kl_estimator="k4"), "algo.loss.kl_estimator"),
        (dict(tis="step"), "algo.loss.tis"),
        (dict(tis_cap=0.0), "algo.loss.tis_cap"),
        (dict(icepop_low=2.0, icepop_high=1.0), "algo.loss.icepop_low"),
        (dict(icepop_level="row"), "algo.loss.icepop_level"),
    ],
)
def test_bad_config_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        LossConfig(**kwargs)


def test_loss_config_is_declared_without_the_config_package():
    """algo/ sits below config/: LossConfig's options come from the pure-Python base module."""
    import sys

    code = (
        "import sys, megatron_stepwise.algo.losses as L; L.LossConfig(); "
        "print([m for m in sys.modules if m.startswith('megatron_stepwise.config') "
        "or m.split('.')[0] in ('megatron', 'ray', 'yaml')])"
    )
    out = run_launch([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_missing_inputs_name_what_is_missing():
    with pytest.raises(ValueError, match=r"algo\.loss\.tis='token'.*rollout_logprobs"):
        policy_loss(_inputs([0.0], [1.0]), LossConfig(tis="token"))
    with pytest.raises(ValueError, match=r"algo\.loss\.kl_coef.*ref_logprobs"):
        policy_loss(_inputs([0.0], [1.0]), LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match=r"algo\.loss\.entropy_coef.*entropy"):
        policy_loss(_inputs([0.0], [1.0]), LossConfig(entropy_coef=0.1))
    bad = _inputs([0.0, 0.0], [1.0, 1.0])
    bad.advantages = torch.zeros(3)
    with pytest.raises(ValueError, match=r"LossInputs\.advantages: has 3 entries, logprobs has 2"):
        policy_loss(bad, LossConfig())
    with pytest.raises(ValueError, match=r"algo\.loss\.policy_loss: 'nope' is not registered; known: .*ppo"):
        LossConfig(policy_loss="nope")


def test_custom_policy_loss_through_the_registry():
    @register_policy_loss("test_vanilla_pg")
    def vanilla(inputs, cfg, segments):
        return -inputs.advantages * inputs.logprobs * cfg.options["scale"], {"negative_adv": inputs.advantages < 0}

    assert "test_vanilla_pg" in list_policy_losses()
    inputs = _inputs([-1.0, -2.0], [1.0, -1.0], w=[0.5, 0.5])
    loss, g, m = _run(inputs, LossConfig(policy_loss="test_vanilla_pg", options={"scale": 2.0}))
    assert loss == pytest.approx(0.5 * 2 * (1.0 - 2.0))
    assert g.tolist() == pytest.approx([-1.0, 1.0])
    assert m["negative_adv"].item() == pytest.approx(0.5)


# ----------------------------------------------------------------------------- compatibility


def _compat(merge=True, estimator="grpo", multi_step=True, **kw):
    return check_loss_compatibility(LossConfig(**kw), merge_steps=merge, estimator=estimator, multi_step=multi_step)


def test_compatible_configurations_give_no_errors():
    for reduction in ("token_mean", "trajectory_mean", "prompt_mean"):
        assert _compat(reduction=reduction, tis="token", icepop_low=0.5) == []
    # Without merging every reduction / loss / TIS level is fine.
    assert _compat(merge=False, reduction="step_mean", policy_loss="gspo", tis="sequence") == []
    assert _compat(estimator="reinforce++", multi_step=False) == []


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(reduction="step_mean"), "algo.loss.reduction='step_mean' cannot be combined with data.merge_steps=true"),
        (
            dict(reduction="seq_mean_token_sum_norm", max_response_len=8),
            "algo.loss.reduction='seq_mean_token_sum_norm' cannot be combined with data.merge_steps=true",
        ),
        (dict(policy_loss="gspo"), "algo.loss.policy_loss='gspo' cannot be combined with data.merge_steps=true"),
        (dict(tis="sequence"), "algo.loss.tis='sequence' cannot be combined with data.merge_steps=true"),
        (
            dict(icepop_high=2.0, icepop_level="sequence"),
            "algo.loss.icepop_level='sequence' cannot be combined with data.merge_steps=true",
        ),
    ],
)
def test_merge_incompatible_settings_are_refused_by_key(kwargs, needle):
    errors = _compat(**kwargs)
    assert len(errors) == 1 and errors[0].startswith(needle)


def test_estimator_errors_name_the_key_and_accumulate():
    errors = _compat(estimator="gae", reduction="step_mean", policy_loss="gspo")
    assert any(e.startswith("algo.estimator='gae' is a temporal estimator") for e in errors)
    assert any(e.startswith("algo.loss.policy_loss='gspo'") for e in errors)
    assert any(e.startswith("algo.loss.reduction='step_mean'") for e in errors)
    assert _compat(estimator="unknown")[0].startswith("algo.estimator='unknown' is not a registered")


def test_custom_sequence_level_loss_is_refused_with_merging():
    register_policy_loss("test_seq_loss", sequence_level=True)(lambda inputs, cfg, seg: (inputs.logprobs * 0, {}))
    assert _compat(policy_loss="test_seq_loss")[0].startswith("algo.loss.policy_loss='test_seq_loss'")
    assert _compat(merge=False, policy_loss="test_seq_loss") == []
