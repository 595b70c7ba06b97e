"""Registering `StepwisePlugin` into a training loop written the megatron-core way.

The loop below is the shape of an existing megatron-core user loop (model provider, DDP,
`get_megatron_optimizer`, `get_forward_backward_func()`); the plugin supplies only
`forward_step` and the data iterator of packed step-wise micro-batches, plus old-policy
log-probs. Rollouts are replaced by synthetic multi-turn steps with random rewards.

    python examples/megatron_loop.py                                   # 1 process
    torchrun --nproc-per-node 2 examples/megatron_loop.py --tp 2       # or --pp 2, or DP 2

On a machine without a GPU this runs on gloo with the CPU compatibility layer.
"""

from __future__ import annotations

import argparse

import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_stepwise.algo.advantages import compute_advantages
from megatron_stepwise.algo.losses import LossConfig
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps
from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train.model import build_gpt_model, tiny_config, wrap_ddp
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.steps import StepBatch


def rollout(iteration: int, vocab: int) -> list:
    """Stand-in for the rollout fleet: 4 prompts x 4 samples, 1-3 turns each."""
    w = AgentWorkload(
        num_prompts=4,
        samples_per_prompt=4,
        turns=(1, 3),
        prompt_len=(8, 24),
        obs_len=(4, 12),
        response_len=(4, 16),
        vocab_size=vocab,
        seed=iteration,
    )
    return make_agent_steps(w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256, help="token budget of one micro-batch")
    args = p.parse_args()

    # --- the user's existing setup ------------------------------------------------------
    layout = runtime.init_distributed(args.tp, args.pp, seed=1234)
    hf_config = tiny_config()
    model = wrap_ddp(build_gpt_model(hf_config))  # the user's model_provider + DDP wrapping
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [model])
    forward_backward_func = get_forward_backward_func()

    # --- registering the plugin --------------------------------------------------------------
    plugin = StepwisePlugin(
        LossConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.28, reduction="token_mean"),
        max_tokens_per_microbatch=args.max_tokens,
    )

    for iteration in range(args.iterations):
        steps = rollout(iteration, hf_config["vocab_size"])  # identical on every rank
        batch = StepBatch.from_steps(steps)
        batch.set_response_field("advantages", compute_advantages(steps, "grpo"))
        batch.token_fields["old_logprobs"] = plugin.compute_logprobs_flat([model], batch)

        # --- the loop body, as before, with the plugin's forward_step and data iterator ----
        inputs = plugin.prepare_minibatch([model], batch)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward_func(
            forward_step_func=plugin.forward_step,
            data_iterator=inputs.data_iterator(),
            model=[model],
            num_microbatches=inputs.num_microbatches,
            seq_length=inputs.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        update_successful, grad_norm, _ = optimizer.step()
        metrics = plugin.reduce_metrics(losses)  # summed over micro-batches and DP ranks
        if layout.rank == 0:
            print(
                f"iteration {iteration}: loss {metrics['loss']:+.5f}  entropy {metrics['entropy']:.3f}  "
                f"clipfrac {metrics['clipfrac_low'] + metrics['clipfrac_high']:.3f}  "
                f"grad_norm {float(grad_norm):.4f}  trained tokens {int(metrics['tokens/trained'])}/"
                f"{int(metrics['tokens/total'])}  micro-batches/rank {inputs.num_microbatches}  "
                f"updated {bool(update_successful)}",
                flush=True,
            )
    # `plugin.train_minibatch(chunks, optimizer, batch)` does the loop body above in one call.
    runtime.destroy_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
