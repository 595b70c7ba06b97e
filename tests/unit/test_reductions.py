"""Loss reductions: hand-computed weights, and invariance of loss and gradient under any split
into micro-batches / DP shards, and under prefix merging (for the merge-invariant reductions)."""

import pytest
import torch
from helpers import make_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_stepwise import (
    LossConfig,
    LossInputs,
    StepBatch,
    combine_metric_partials,
    compute_advantages,
    loss_token_weights,
    make_padding_step,
    policy_loss,
)
from megatron_stepwise.algo.reductions import MERGE_INVARIANT_REDUCTIONS, REDUCTIONS

MAX_RESPONSE_LEN = 8


# ----------------------------------------------------------------------------- hand-computed weights


def _hand_batch():
    # group a: traj a#0 = 2 steps (2 + 1 trained tokens), a#1 = 1 step (1 token); group b: b#0 (4 tokens).
    return StepBatch.from_steps(
        [
            make_step("a", 0, [1], [5, 5, 5], [1, 1, 0], last=False),
            make_step("a", 0, [1, 5, 5, 5, 9], [5, 5], [0, 1], reward=1.0),
            make_padding_step(0),
            make_step("a", 1, [1, 2], [5], [1]),
            make_step("b", 0, [3], [5, 5, 5, 5], [1, 1, 1, 1]),
            make_step("b", 1, [3], [5, 5], [0, 0]),  # no trained token
        ]
    )


def _trained_weights(batch, reduction, **kw):
    w = loss_token_weights(batch, reduction, **kw)
    assert w.dtype == torch.float32 and w.shape == batch.tokens.shape
    mask = batch.token_fields["loss_mask"].bool()
    assert (w[~mask] == 0).all(), "weight outside trained positions"
    return w[mask].tolist()


@pytest.mark.parametrize(
    "reduction, expected",
    [
        ("token_mean", [1 / 8] * 8),
        # 4 rows with a trained token: row means 1/2, 1/1, 1/1, 1/4, each row weighs 1/4
        ("step_mean", [1 / 8, 1 / 8, 1 / 4, 1 / 4] + [1 / 16] * 4),
        # 3 trajectories with a trained token (b#1 has none): a#0 has 3 tokens, a#1 1, b#0 4
        ("trajectory_mean", [1 / 9] * 3 + [1 / 3] + [1 / 12] * 4),
        # 2 groups: a has 4 tokens, b has 4 tokens
        ("prompt_mean", [1 / 8] * 8),
        # constant 8, five real rows (padding excluded, b#1 counts as a sample)
        ("seq_mean_token_sum_norm", [1 / 40] * 8),
    ],
)
def test_reduction_weights_by_hand(reduction, expected):
    got = _trained_weights(_hand_batch(), reduction, max_response_len=8)
    assert got == pytest.approx(expected, rel=1e-6)


def test_prompt_mean_weighs_groups_equally():
    batch = StepBatch.from_steps([make_step("a", 0, [1], [5, 5, 5], [1, 1, 1]), make_step("b", 0, [1], [5], [1])])
    assert _trained_weights(batch, "prompt_mean") == pytest.approx([1 / 6] * 3 + [1 / 2])


def test_reduction_errors_name_the_key():
    with pytest.raises(ValueError, match="algo.loss.reduction='mean'"):
        loss_token_weights(_hand_batch(), "mean")
    with pytest.raises(ValueError, match="algo.loss.max_response_len"):
        loss_token_weights(_hand_batch(), "seq_mean_token_sum_norm")


# ----------------------------------------------------------------------------- random step batches


@st.composite
def stepwise_batches(draw):
    """Prefix-consistent multi-turn trajectories (prompt_i = prompt_{i-1} + response_{i-1} + obs_i)
    in prompt groups, with padding rows, random masks and random per-token policy values."""
    steps = []
    tok = st.integers(2, 50)
    for g in range(draw(st.integers(1, 3))):
        for k in range(draw(st.integers(1, 3))):
            prompt = draw(st.lists(tok, min_size=1, max_size=3))
            n_steps = draw(st.integers(1, 3))
            reward = draw(st.sampled_from([0.0, 1.0, 0.5]))
            for i in range(n_steps):
                n = draw(st.integers(0, 4))
                resp = draw(st.lists(tok, min_size=n, max_size=n))
                mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
                last = i == n_steps - 1
                steps.append(make_step(f"p{g}", k, prompt, resp, mask, last=last, reward=reward))
                steps[-1].turn_reward = draw(st.sampled_from([0.0, 0.25, -0.5]))  # for turn-level estimators
                prompt = prompt + resp + draw(st.lists(tok, min_size=0, max_size=2))
        if draw(st.booleans()):
            steps.append(make_padding_step(len(steps)))
    batch = StepBatch.from_steps(steps)
    adv = compute_advantages(
        steps,
        draw(
            st.sampled_from(
                ["grpo", "dr_grpo", "rloo", "maxrl", "turn_rloo", "turn_grpo", "turn_state_rloo", "turn_discount"]
            )
        ),
    )
    zeros = [torch.zeros(s.prompt_ids.numel()) for s in steps]
    batch.token_fields["adv"] = torch.cat([x for z, a in zip(zeros, adv) for x in (z, a)])
    # Per-token policy values; only trained positions matter. uid names each trained token.
    mask = batch.token_fields["loss_mask"].bool()
    n_trained = int(mask.sum())
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    uid = torch.zeros_like(batch.tokens)
    uid[mask] = torch.arange(n_trained)
    batch.token_fields["uid"] = uid
    values = {
        "lp": -torch.rand(n_trained, generator=gen, dtype=torch.float64) * 2,
        "old_delta": torch.randn(n_trained, generator=gen, dtype=torch.float64) * 0.3,
        "rollout_delta": torch.randn(n_trained, generator=gen, dtype=torch.float64) * 0.3,
        "ref_delta": torch.randn(n_trained, generator=gen, dtype=torch.float64) * 0.3,
        "ent": torch.rand(n_trained, generator=gen, dtype=torch.float64),
    }
    return steps, batch, values


configs = st.builds(
    LossConfig,
    policy_loss=st.sampled_from(["ppo", "gspo", "cispo"]),
    clip_low=st.sampled_from([0.1, 0.2]),
    clip_high=st.sampled_from([0.2, 0.28]),
    clip_c=st.sampled_from([None, 1.5]),
    kl_coef=st.sampled_from([0.0, 0.1]),
    kl_estimator=st.sampled_from(["k1", "k2", "k3"]),
    entropy_coef=st.sampled_from([0.0, 0.01]),
    tis=st.sampled_from(["none", "token", "sequence"]),
    icepop_low=st.sampled_from([None, 0.8]),
    icepop_high=st.sampled_from([None, 1.25]),
)


def _loss_over(batch, row_groups, values, cfg, reduction):
    """Sum of policy_loss partials over micro-batches (lists of rows); returns loss, grads, metrics."""
    batch.token_fields["w"] = loss_token_weights(batch, reduction, max_response_len=MAX_RESPONSE_LEN)
    lp = values["lp"].clone().requires_grad_(True)
    ent = values["ent"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    partials = []
    for rows in row_groups:
        sub = batch.select(rows)
        m = sub.token_fields["loss_mask"].bool()
        u = sub.token_fields["uid"][m]
        inputs = LossInputs(
            logprobs=lp[u],
            old_logprobs=lp.detach()[u] + values["old_delta"][u],
            advantages=sub.token_fields["adv"][m].double(),
            weights=sub.token_fields["w"][m],
            segment_ids=torch.as_tensor(rows, dtype=torch.long)[sub.row_of_token()[m]],
            rollout_logprobs=lp.detach()[u] + values["old_delta"][u] + values["rollout_delta"][u],
            ref_logprobs=lp.detach()[u] + values["ref_delta"][u],
            entropy=ent[u],
        )
        loss, metrics = policy_loss(inputs, cfg)
        total = total + loss
        partials.append(metrics)
    total.backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (lp, ent)]  # None: not in the loss
    return total.detach(), grads[0], grads[1], combine_metric_partials(partials)


def _random_split(draw, n_rows):
    """Random DP shards, each cut into random micro-batches, rows shuffled: a list of row lists."""
    order = draw(st.permutations(list(range(n_rows))))
    n_shards = draw(st.integers(1, 3))
    shard_of = [draw(st.integers(0, n_shards - 1)) for _ in order]
    micro = []
    for s in range(n_shards):
        rows = [r for r, sh in zip(order, shard_of) if sh == s]
        cuts = sorted(draw(st.lists(st.integers(0, len(rows)), max_size=3)))
        for a, b in zip([0] + cuts, cuts + [len(rows)]):
            micro.append(rows[a:b])
    return micro


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=stepwise_batches(), cfg=configs, reduction=st.sampled_from(REDUCTIONS), split=st.data())
def test_loss_and_gradient_do_not_depend_on_the_split(data, cfg, reduction, split):
    _, batch, values = data
    whole = _loss_over(batch, [list(range(batch.num_rows))], values, cfg, reduction)
    parts = _loss_over(batch, _random_split(split.draw, batch.num_rows), values, cfg, reduction)
    assert torch.allclose(whole[0], parts[0], atol=1e-10)
    assert torch.allclose(whole[1], parts[1], atol=1e-10)  # d loss / d logprobs
    assert torch.allclose(whole[2], parts[2], atol=1e-10)  # d loss / d entropy
    assert whole[3].keys() == parts[3].keys()
    for name in whole[3]:
        assert torch.allclose(whole[3][name], parts[3][name], atol=1e-9), name
    n_trained = int(batch.token_fields["loss_mask"].sum())
    if n_trained and reduction != "seq_mean_token_sum_norm":
        assert float(whole[3]["loss_weight_sum"]) == pytest.approx(1.0, rel=1e-5)


# ----------------------------------------------------------------------------- prefix merging


def merge_rows(batch: StepBatch) -> StepBatch:
    """Test-local prefix merge: each trajectory becomes one row = its first step's row, then for
    every later step the observation delta (that step's prompt tail, loss_mask 0) and its response."""
    lengths, plens, offs = batch.lengths.tolist(), batch.prompt_lens.tolist(), batch.offsets.tolist()
    traj = batch.row_fields["traj_index"].tolist()
    groups: list[list[int]] = []
    for r in range(batch.num_rows):
        if groups and traj[groups[-1][-1]] == traj[r] and not bool(batch.row_fields["is_padding"][r]):
            groups[-1].append(r)
        else:
            groups.append([r])
    idx, new_lengths, new_plens = [], [], []
    for rows in groups:
        first = rows[0]
        piece = list(range(offs[first], offs[first + 1]))
        for prev, r in zip(rows, rows[1:]):
            assert plens[r] >= lengths[prev], "steps are not prefix-consistent"
            piece += list(range(offs[r] + lengths[prev], offs[r + 1]))
        idx += piece
        new_lengths.append(len(piece))
        new_plens.append(plens[first])
    idx_t = torch.tensor(idx, dtype=torch.long)
    offsets = torch.zeros(len(groups) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(new_lengths), 0, out=offsets[1:])
    lasts = torch.tensor([rows[-1] for rows in groups], dtype=torch.long)
    return StepBatch(
        tokens=batch.tokens[idx_t],
        offsets=offsets,
        prompt_lens=torch.tensor(new_plens, dtype=torch.long),
        token_fields={k: v[idx_t] for k, v in batch.token_fields.items()},
        row_fields={k: v[lasts] for k, v in batch.row_fields.items()},
        trajectory_ids=[batch.trajectory_ids[r] for r in lasts.tolist()],
        stop_reasons=[batch.stop_reasons[r] for r in lasts.tolist()],
    )


def test_merge_helper_keeps_tokens_of_the_last_prompt():
    steps = [
        make_step("a", 0, [1, 2], [5, 5], [1, 0], last=False),
        make_step("a", 0, [1, 2, 5, 5, 8, 9], [6], [1]),
    ]
    merged = merge_rows(StepBatch.from_steps(steps))
    assert merged.num_rows == 1
    assert merged.tokens.tolist() == [1, 2, 5, 5, 8, 9, 6]
    assert merged.token_fields["loss_mask"].tolist() == [0, 0, 1, 0, 0, 0, 1]


token_level_configs = configs.filter(lambda c: c.policy_loss != "gspo" and c.tis != "sequence")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=stepwise_batches(),
    cfg=token_level_configs,
    reduction=st.sampled_from(sorted(MERGE_INVARIANT_REDUCTIONS)),
    split=st.data(),
)
def test_merged_and_unmerged_batches_give_the_same_loss_and_gradient(data, cfg, reduction, split):
    _, batch, values = data
    merged = merge_rows(batch)
    plain = _loss_over(batch, [list(range(batch.num_rows))], values, cfg, reduction)
    got = _loss_over(merged, _random_split(split.draw, merged.num_rows), values, cfg, reduction)
    assert torch.allclose(plain[0], got[0], atol=1e-10)
    assert torch.allclose(plain[1], got[1], atol=1e-10)
    assert torch.allclose(plain[2], got[2], atol=1e-10)


@pytest.mark.parametrize("reduction", ["step_mean", "seq_mean_token_sum_norm"])
def test_row_counting_reductions_change_under_merging(reduction):
    """Why check_loss_compatibility refuses them: a merged row counts as one sample."""
    steps = [
        make_step("a", 0, [1], [5], [1], last=False),
        make_step("a", 0, [1, 5, 7], [5, 5, 5], [1, 1, 1]),
        make_step("b", 0, [1], [5, 5], [1, 1]),
    ]
    batch = StepBatch.from_steps(steps)
    plain = _trained_weights(batch, reduction, max_response_len=MAX_RESPONSE_LEN)
    merged = _trained_weights(merge_rows(batch), reduction, max_response_len=MAX_RESPONSE_LEN)
    assert len(plain) == len(merged) == 6
    assert plain != pytest.approx(merged)
