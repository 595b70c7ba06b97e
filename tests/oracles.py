"""Plain reference computations the tests compare the optimised paths against."""

from __future__ import annotations

import torch


def reference_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain full-vocabulary computation: logits [N, V] -> (logp, entropy) of `targets` [N]."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each output token given everything before it, in one unpadded
    pass of an HF causal LM (T = 0, greedy, uses the raw logits)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    scaled = logits / temperature if temperature > 0 else logits
    logp = torch.log_softmax(scaled, -1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def megatron_lm_logged_metrics(losses: list) -> dict:
    """What Megatron-LM's `train_step` (core_v0.16.1) makes of a schedule's loss dicts before it
    prints them and sends them to TensorBoard/W&B, rewritten from its description: on the last
    pipeline stage, a 2-element value is summed over micro-batches, all-reduced over DP x CP and
    divided; a 1-element value is averaged over micro-batches (no reduction over ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    out = {}
    for key in losses[0]:
        vals = [x[key].view(-1) for x in losses]
        if vals[0].numel() == 2:
            total = torch.vstack(vals).sum(dim=0)
            dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
            out[key] = float(total[0] / total[1])
        else:
            out[key] = float(torch.cat(vals).mean())
    return out


def per_turn_index_normalised(rewards: torch.Tensor, lengths: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """The naive turn-level estimator (MT-GRPO style, verl RFC 7244), kept as a test oracle: each
    turn's reward minus the leave-one-out mean of the same turn index's rewards over the group's
    other trajectories that reached it, summed from the turn on. The number of baseline terms
    depends on the trajectory's own stopping turn, so it is biased when the policy stops.
    rewards float64 [n, turns] (0 past the length), lengths long [n], group long [n] -> [n, turns]."""
    n, turns = rewards.shape
    alive = (torch.arange(turns)[None, :] < lengths[:, None]).double()
    groups = int(group.max()) + 1
    sums = torch.zeros(groups, turns, dtype=torch.float64).index_add_(0, group, rewards * alive)
    counts = torch.zeros(groups, turns, dtype=torch.float64).index_add_(0, group, alive)
    others = (counts[group] - alive).clamp(min=1)
    centred = (rewards - (sums[group] - rewards * alive) / others) * alive
    return centred.flip(1).cumsum(1).flip(1)
