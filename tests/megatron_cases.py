"""The fixed step-wise mini-batch of the Megatron invariance tests (same on every rank/layout).

Three prompts x two samples; trajectories of 1 to 4 steps whose prompts re-tokenise the whole
history (so consecutive steps merge), uneven lengths, responses ending in an appended token
with loss_mask 0, and two padding rows. Per-token extras (advantages, rollout log-probs and
the noise added to recomputed log-probs) are response-aligned so that a merged row carries
exactly the same values at the same tokens. The advantages are a turn-level estimator's
(`turn_rloo` on per-turn rewards), so the turns of one trajectory train on different values,
plus an on-policy distillation term (0.5 x teacher minus rollout log-prob, a synthetic teacher),
so every token of a turn trains on its own value too.
"""

from __future__ import annotations

import torch

from megatron_stepwise.algo.advantages import compute_advantages
from megatron_stepwise.algo.distill import with_distillation
from megatron_stepwise.steps import Step, StepBatch, TrajectoryID, make_padding_step


def make_steps(vocab: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.Generator().manual_seed(seed + 1)  # its own stream: the batch's shape stays as it was

    def ints(n, lo=1):
        return torch.randint(lo, vocab, (n,), generator=g)

    steps, extras = [], []
    turns_by_traj = [1, 3, 4, 2, 1, 3]
    for t, turns in enumerate(turns_by_traj):
        tid = TrajectoryID(f"prompt{t // 2}", t % 2)
        adv = float(torch.randn((), generator=g))
        prompt = ints(int(torch.randint(4, 14, (), generator=g)))
        for k in range(turns):
            n_resp = int(torch.randint(3, 12, (), generator=g))
            response = ints(n_resp)
            mask = torch.ones(n_resp, dtype=torch.long)
            mask[-1] = 0  # an EOS appended after the fact: never trained
            if k == 1:
                mask[0] = 0  # a masked token inside a response
            steps.append(
                Step(
                    trajectory_id=tid,
                    prompt_ids=prompt.clone(),
                    response_ids=response,
                    loss_mask=mask,
                    rollout_logprobs=-(0.1 + 3 * torch.rand(n_resp, generator=g)) * mask,
                    reward=adv,
                    is_last_step=k == turns - 1,
                    turn_reward=0.25 * (k + 1) * (-1) ** t,
                    teacher_logprobs=-(0.1 + 3 * torch.rand(n_resp, generator=teacher)),
                )
            )
            extras.append(
                {
                    "advantages": adv * mask.float(),
                    "old_noise": 0.3 * torch.randn(n_resp, generator=g) * mask,
                    "ref_noise": 0.2 * torch.randn(n_resp, generator=g) * mask,
                }
            )
            obs = ints(int(torch.randint(2, 9, (), generator=g)))
            prompt = torch.cat([prompt, response, obs])
    for i in range(2):
        steps.append(make_padding_step(i))
        extras.append({k: torch.zeros(0) for k in ("advantages", "old_noise", "ref_noise")})
    advantages = with_distillation(steps, compute_advantages(steps, "turn_rloo"), 0.5, alone=False)
    for e, a in zip(extras, advantages):
        e["advantages"] = a
    return steps, extras


def merge_for_test(steps, extras):
    """The package's `merge_steps`, plus the same merge applied to the response-aligned extras
    (the obs gap gets zeros), checked against the package's rows token for token."""
    from megatron_stepwise.algo.merge import merge_steps

    merged, _ = merge_steps(steps)
    out_extras = []
    i = 0
    for row in merged:
        e = {k: v.clone() for k, v in extras[i].items()}
        tokens = torch.cat([steps[i].prompt_ids, steps[i].response_ids])
        i += 1
        while tokens.numel() < row.num_tokens:
            gap = steps[i].prompt_ids.numel() - tokens.numel()
            e = {k: torch.cat([e[k], torch.zeros(gap), extras[i][k]]) for k in e}
            tokens = torch.cat([steps[i].prompt_ids, steps[i].response_ids])
            i += 1
        assert torch.equal(tokens, torch.cat([row.prompt_ids, row.response_ids])), "merge_steps changed tokens"
        assert all(v.numel() == row.response_ids.numel() for v in e.values())
        out_extras.append(e)
    assert i == len(steps)
    return merged, out_extras


def to_batch(steps, extras) -> StepBatch:
    batch = StepBatch.from_steps(steps)
    for name in ("advantages", "old_noise", "ref_noise"):
        batch.set_response_field(name, [e[name] for e in extras])
    return batch


def hf_reference_logprobs(cfg: dict, full: dict, batch: StepBatch) -> torch.Tensor:
    """Plain reference: the HF model on each row, full logits, log_softmax, gather the next
    token. Flat [T] aligned with the batch, 0 where loss_mask is 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_stepwise.hf.arch import arch_from_hf
    from megatron_stepwise.mcore.weights.hf_mapping import canonical_to_hf
    from megatron_stepwise.rollout.engines.embedded.hf_model import load_named_tensors

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **fields, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    state = canonical_to_hf(full, arch_from_hf(cfg))  # checkpoint names (MoE experts one by one)
    assert load_named_tensors(model, state) == len(state)
    out = torch.zeros(batch.tokens.numel())
    mask = batch.token_fields["loss_mask"] != 0
    with torch.no_grad():
        for r in range(batch.num_rows):
            s = batch.row_slice(r)
            ids = batch.tokens[s]
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)
            lp = torch.zeros(ids.numel())
            lp[1:] = logp[:-1].gather(1, ids[1:, None])[:, 0]
            out[s] = lp * mask[s]
    return out
