"""Host-side cost of the algo stage for one mini-batch: advantages, reduction weights, loss.

    python tools/bench/bench_algo.py [--prompts 64] [--samples 8] [--turns 5] [--prompt-len 1000] [--resp-len 200]

Prints the median wall time of each stage over a few repeats (CPU, one thread).
"""

from __future__ import annotations

import argparse

import torch
from harness import median_time

from megatron_stepwise import (
    LossConfig,
    LossInputs,
    Step,
    StepBatch,
    TrajectoryID,
    compute_advantages,
    loss_token_weights,
    policy_loss,
)


def make_steps(prompts: int, samples: int, turns: int, prompt_len: int, resp_len: int) -> list[Step]:
    gen = torch.Generator().manual_seed(0)
    steps = []
    for p in range(prompts):
        for k in range(samples):
            reward = float(torch.rand((), generator=gen) < 0.5)
            for t in range(turns):
                mask = (torch.rand(resp_len, generator=gen) < 0.95).long()
                steps.append(
                    Step(
                        TrajectoryID(f"p{p}", k),
                        torch.zeros(prompt_len + t * resp_len, dtype=torch.long),
                        torch.ones(resp_len, dtype=torch.long),
                        mask,
                        reward=reward,
                        is_last_step=t == turns - 1,
                    )
                )
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--resp-len", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)

    steps = make_steps(args.prompts, args.samples, args.turns, args.prompt_len, args.resp_len)
    batch = StepBatch.from_steps(steps)
    mask = batch.token_fields["loss_mask"].bool()
    n = int(mask.sum())
    lp = -torch.rand(n)
    inputs = LossInputs(
        logprobs=lp.requires_grad_(True),
        old_logprobs=lp.detach() + 0.01 * torch.randn(n),
        advantages=torch.randn(n),
        weights=torch.full((n,), 1.0 / n),
        segment_ids=batch.row_of_token()[mask],
        rollout_logprobs=lp.detach() + 0.01 * torch.randn(n),
        ref_logprobs=lp.detach() + 0.01 * torch.randn(n),
    )
    cfg = LossConfig(tis="token", icepop_low=0.5, icepop_high=2.0, kl_coef=0.01, clip_c=3.0)

    def loss_fwd_bwd():
        loss, _ = policy_loss(inputs, cfg)
        loss.backward()

    print(f"{len(steps)} steps, {batch.tokens.numel()} tokens, {n} trained tokens")
    for name, fn in [
        ("compute_advantages (grpo)", lambda: compute_advantages(steps, "grpo")),
        ("loss_token_weights (trajectory_mean)", lambda: loss_token_weights(batch, "trajectory_mean")),
        ("policy_loss fwd+bwd (ppo, TIS, IcePop, KL)", loss_fwd_bwd),
    ]:
        print(f"  {name:45s} {1e3 * median_time(fn, args.repeats, warmup=False):9.2f} ms")


if __name__ == "__main__":
    main()
