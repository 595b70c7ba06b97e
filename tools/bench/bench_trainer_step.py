"""Trainer step on CPU: packed micro-batches vs the same rows padded to the longest row of their
micro-batch, under the real plugin (prints measured figures; never asserts).

Setup: megatron-core at world size 1 (gloo, the CPU compatibility layer), a small Qwen2-shaped
model (the `tiny` preset widened to a measurable step), megatron's Adam, and
`StepwisePlugin.train_minibatch` on one agent-shaped mini-batch: step-wise rows from
`megatron_stepwise.data.synthetic` (1-6 turns, variable prompt, observation and response lengths),
GRPO advantages, PPO loss with token-mean reduction.

The two runs differ only in padding. Both use the plugin's own micro-batch plan of the real
rows (the padded run gets it through the `plan_microbatches` hook); in the padded run every row
is extended to the longest row of its micro-batch with pad tokens whose loss_mask is 0, placed
after the row so causal attention keeps the real tokens' results, and the loss, unchanged.
On the local spec the same packed mini-batch also runs with each packed attention
(`packed_one_call` / `packed_per_row`: `model.packed_attention=one_call` / `per_row`; `packed`
and `padded` run `auto`: per_row on CPU, one_call on a GPU) and, with `--fused`, with the fused
elementwise blocks (`packed_fused`: `model.fused_elementwise=true` on `auto`; torch.compile's
first-call compilation happens in the untimed warm-up round). Every variant is its own model
with the same deterministic weights.

lr = 0 keeps the weights fixed, so every repeat computes the same thing; runs alternate
(packed, padded, packed_per_row, ...) so machine noise hits all alike. Reported: real tokens/s
(real tokens / step time) of each and their ratios, next to the ratio the token counts predict.

    python tools/bench/bench_trainer_step.py [--quick] [--fused] [--out results.json]

`--device cuda` runs the same comparison on the GPU (NCCL, bf16 weights with fp32 main
parameters, steps timed between `torch.cuda.synchronize()` calls); give it a model and a
mini-batch large enough to occupy the GPU (e.g. `--hidden 1024 --layers 8 --prompts 8 --samples 8`).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import add_seed_and_out, bench_parser, config, free_port, run_args, script_main, side_by_side  # noqa: E402

from megatron_stepwise.algo.advantages import compute_advantages  # noqa: E402
from megatron_stepwise.algo.losses import LossConfig  # noqa: E402
from megatron_stepwise.algo.planner import plan_microbatches  # noqa: E402
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps  # noqa: E402
from megatron_stepwise.hf.presets import PRESETS  # noqa: E402
from megatron_stepwise.mcore.weights import full_views as W  # noqa: E402
from megatron_stepwise.steps import Step, StepBatch  # noqa: E402

PAD_TOKEN = 0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "the tiny preset's size, a smaller mini-batch, 1 repeat")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4096, help="micro-batch token budget")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per layout after one warm-up")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: NCCL and bf16 weights (fp32 main parameters) on the GPU",
    )
    p.add_argument("--fused", action="store_true", help="also time the fused elementwise blocks (packed_fused)")
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.hidden, args.layers, args.repeats = 1, 64, 2, 1
    return args


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """The tiny preset, wider and deeper so a step is dominated by model math, not overheads."""
    cfg = dict(PRESETS["tiny"])
    cfg.update(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        max_position_embeddings=4096,
    )
    return cfg


def agent_steps(args: argparse.Namespace, vocab_size: int) -> list[Step]:
    w = AgentWorkload(
        num_prompts=args.prompts,
        samples_per_prompt=args.samples,
        turns=(1, 6),
        prompt_len=(20, 100),
        obs_len=(10, 300),
        response_len=(5, 80),
        vocab_size=vocab_size,
        success_prob=0.5,
        seed=args.seed,
    )
    return make_agent_steps(w)


def to_batch(steps: list[Step], advantages: list[torch.Tensor]) -> StepBatch:
    batch = StepBatch.from_steps(steps)
    batch.set_response_field("advantages", advantages)
    return batch


def padded_copy(steps: list[Step], advantages: list[torch.Tensor], plan) -> tuple[list[Step], list[torch.Tensor]]:
    """Every row extended (after its end) to the longest row of its micro-batch; pad tokens untrained."""
    target = [0] * len(steps)
    for micro in plan[0]:
        longest = max(steps[r].num_tokens for r in micro)
        for r in micro:
            target[r] = longest
    out_steps, out_adv = [], []
    for s, a, n in zip(steps, advantages, target):
        pad = n - s.num_tokens
        zeros = torch.zeros(pad)
        out_steps.append(
            Step(
                trajectory_id=s.trajectory_id,
                prompt_ids=s.prompt_ids,
                response_ids=torch.cat([s.response_ids, torch.full((pad,), PAD_TOKEN, dtype=torch.long)]),
                loss_mask=torch.cat([s.loss_mask, zeros.long()]),
                rollout_logprobs=None if s.rollout_logprobs is None else torch.cat([s.rollout_logprobs, zeros]),
                reward=s.reward,
                is_last_step=s.is_last_step,
                stop_reason=s.stop_reason,
                metadata=s.metadata,
            )
        )
        out_adv.append(torch.cat([a, zeros]))
    return out_steps, out_adv


def start_world_of_one() -> None:
    from megatron_stepwise.mcore.runtime.runtime import init_distributed

    # This process is its own world (the suite runs each benchmark in a fresh process).
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_distributed(1, 1, 1, seed=1234)


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    """Prints the table, returns the figures (what `tools/bench/suite.py` collects)."""
    args = run_args(parse_args, quick, options)
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("bench_trainer_step: --device cuda needs a CUDA GPU")
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    from megatron_stepwise.mcore.runtime.runtime import destroy_distributed, silence_megatron_noise

    silence_megatron_noise()
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_stepwise.algo.planner import plan_stats
    from megatron_stepwise.mcore.train.model import build_model_chunks, te_available
    from megatron_stepwise.mcore.train.plugin import StepwisePlugin

    hf = model_config(args)
    steps = agent_steps(args, hf["vocab_size"])
    advantages = compute_advantages(steps, "grpo")
    lengths = [s.num_tokens for s in steps]
    plan = plan_microbatches(lengths, dp_size=1, max_tokens=args.max_tokens)  # what the plugin plans
    pad_steps, pad_adv = padded_copy(steps, advantages, plan)
    batches = {"packed": to_batch(steps, advantages), "padded": to_batch(pad_steps, pad_adv)}
    computed = {"packed": sum(lengths), "padded": sum(s.num_tokens for s in pad_steps)}
    stats = plan_stats(lengths, plan)
    loss_cfg = LossConfig(policy_loss="ppo", reduction="token_mean")
    plugins = {
        "packed": StepwisePlugin(loss_cfg, max_tokens_per_microbatch=args.max_tokens, pad_token_id=PAD_TOKEN),
        # Same grouping; the budget only has to admit the padded micro-batches.
        "padded": StepwisePlugin(
            loss_cfg,
            max_tokens_per_microbatch=max(computed["padded"], args.max_tokens),
            pad_token_id=PAD_TOKEN,
            plan_microbatches=lambda *_a, **_k: plan,
        ),
    }
    # variant: (layout, model builder options); the local spec's attention and fused blocks
    variants = {"packed": ("packed", {}), "padded": ("padded", {})}
    if not te_available():
        variants["packed_one_call"] = ("packed", {"packed_attention": "one_call"})
        variants["packed_per_row"] = ("packed", {"packed_attention": "per_row"})
        if args.fused:
            variants["packed_fused"] = ("packed", {"fused_elementwise": True})

    start_world_of_one()
    try:
        calls = {}
        for name, (layout, build) in variants.items():
            chunks = build_model_chunks(
                hf, config_overrides={"dtype": dtype}, init=lambda c: W.init_deterministic(c, seed=args.seed), **build
            )
            # lr = 0: the optimizer does all its work but the weights stay put, so repeats are identical.
            opt = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=0.0, weight_decay=0.0, clip_grad=1.0, bf16=on_gpu, params_dtype=dtype
                ),
                chunks,
            )
            calls[name] = functools.partial(plugins[layout].train_minibatch, chunks, opt, batches[layout])
        n_params = sum(p.numel() for p in chunks[0].parameters())
        # the first (untimed) round warms up allocators, megatron's buffers and torch.compile
        timings = side_by_side(calls, args.repeats, sync=torch.cuda.synchronize if on_gpu else None)
        times = {name: t.seconds for name, t in timings.items()}
        losses = {name: t.result["loss"] for name, t in timings.items()}
    finally:
        destroy_distributed()

    real = sum(lengths)
    trained = sum(s.num_trainable for s in steps)
    res = {}
    for name, (layout, _) in variants.items():
        sec = statistics.median(times[name])
        res[name] = {
            "step_s": sec,
            "all_step_s": times[name],
            "computed_tokens": computed[layout],
            "real_tokens_per_s": real / sec,
            "computed_tokens_per_s": computed[layout] / sec,
            "loss": losses[name],
        }
    speedup = res["packed"]["real_tokens_per_s"] / res["padded"]["real_tokens_per_s"]
    predicted = computed["padded"] / computed["packed"]

    spec = "Transformer Engine" if te_available() else "local"
    where = f"{torch.cuda.get_device_name()}, bf16, {spec} spec" if on_gpu else "CPU, 1 thread"
    print(
        f"trainer step ({where}, world size 1): Qwen2-shaped h={args.hidden} layers={args.layers} "
        f"vocab={hf['vocab_size']} ({n_params / 1e6:.2f}M params), one mini-batch of {len(steps)} step rows "
        f"({args.prompts} prompts x {args.samples} samples, 1-6 turns), {real:,} real tokens, {trained:,} trained, "
        f"{len(plan[0])} micro-batches (budget {args.max_tokens:,} tokens), median of {args.repeats}"
    )
    print(f"{'variant':<15}{'computed tok':>14}{'step s':>9}{'real tok/s':>12}{'computed tok/s':>16}{'loss':>14}")
    for name, r in res.items():
        print(
            f"{name:<15}{r['computed_tokens']:>14,}{r['step_s']:>9.3f}{r['real_tokens_per_s']:>12,.0f}"
            f"{r['computed_tokens_per_s']:>16,.0f}{r['loss']:>14.6f}"
        )
    print(
        f"packed / padded real tokens/s = {speedup:.2f}x   (padded / packed computed tokens = {predicted:.2f}x; "
        f"loss difference {abs(res['packed']['loss'] - res['padded']['loss']):.1e}: same math, pads untrained)"
    )
    # one-call / per-row and fused / unfused, both as real tokens/s of the packed step
    pairs = {
        "one_call_over_per_row": ("packed_one_call", "packed_per_row"),
        "fused_over_unfused": ("packed_fused", "packed"),
    }
    ratios = {}
    for key, (new, old) in pairs.items():
        if new in res and old in res:
            ratios[f"{key}_tokens_per_s"] = res[old]["step_s"] / res[new]["step_s"]
            print(
                f"{key.replace('_', ' ')} real tokens/s = {ratios[f'{key}_tokens_per_s']:.2f}x   "
                f"(loss difference {abs(res[new]['loss'] - res[old]['loss']):.1e})"
            )
    return {
        "config": config(args),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "model": {"hf_config": hf, "params": n_params},
        "minibatch": {
            "rows": len(steps),
            "real_tokens": real,
            "trained_tokens": trained,
            "micro_batches": len(plan[0]),
            "padded_efficiency_of_plan": stats.padded_efficiency,
        },
        "layouts": res,
        "packed_over_padded_tokens_per_s": speedup,
        "padded_over_packed_computed_tokens": predicted,
        **ratios,
    }


if __name__ == "__main__":
    script_main(parse_args, run)
