"""`megatron-stepwise rollout CONFIG -n K`: a few trajectories, turn by turn, without training.

For checking a new environment, reward function or dataset before a run: K prompts of the
training set are rolled out by one embedded engine in this process (`--hf DIR` weights, else
`model.hf_checkpoint`, else a random init) with the configured agent loop, and each
trajectory is printed: the first prompt, then per turn the reply, the environment's reward, and
the observation the next prompt adds; then its reward and stop reason (an env_error shows the
environment's traceback). Nothing is written.
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from megatron_stepwise.cli.config import add_config_arguments

    p = sub.add_parser("rollout", help="print a few trajectories turn by turn (no training)")
    add_config_arguments(p)
    p.add_argument("-n", "--prompts", type=int, default=2, help="prompts to roll out (default 2)")
    p.add_argument("--samples", type=int, default=1, help="trajectories per prompt (default 1)")
    p.add_argument("--hf", help="an HF model directory whose weights the engine serves")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import asyncio

    from megatron_stepwise.cli.config import load_or_report

    args.world_size = 1
    cfg = load_or_report(args)
    if cfg is None:
        return 2
    if args.prompts < 1 or args.samples < 1:
        print("error: -n and --samples must be >= 1", file=sys.stderr)
        return 2
    from megatron_stepwise.compose import components
    from megatron_stepwise.loop.evaluation import standalone_engine
    from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig

    try:
        tokenizer = components.load_tokenizer(cfg)
        engine = standalone_engine(cfg, tokenizer, components.policy_model(cfg, tokenizer).hf_config, args.hf)
        samples = components.build_dataset(cfg).next(min(args.prompts, cfg.data.prompts_per_iteration))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = cfg.rollout
    loop_cfg = AgentLoopConfig.from_section(
        r, n_samples_per_prompt=args.samples, sampling=r.sampling.params(r.max_new_tokens)
    )
    spec = components.env_spec(cfg)
    if cfg.env.own_agent:  # your agent through the gateway: each call a turn, prefix breaks shown as such
        agent = components.build_agent_rollout(cfg, engine, tokenizer, n_samples_per_prompt=args.samples)
    else:
        agent = AgentLoop(engine, tokenizer, lambda: spec.factory(**cfg.env.options), loop_cfg)
    try:
        groups = asyncio.run(agent.rollout_groups(samples, seed=cfg.trainer.seed))
    finally:
        agent.close()
    sys.stdout.write(render_trajectories(groups, tokenizer))
    return 0


def render_trajectories(groups, tokenizer) -> str:
    """Each trajectory of the rollout's groups as text: first prompt, then reply / reward /
    observation per turn."""

    def text(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    out = []
    for trajectory in (t for group in groups for t in group.trajectories):
        out.append(f"=== trajectory {trajectory[0].trajectory_id} ===")
        prev = None
        for step in trajectory:
            if prev is None:
                out.append(f"[prompt, {step.prompt_ids.numel()} tokens]\n{text(step.prompt_ids.tolist())}")
            else:
                head = prev.prompt_ids.numel() + prev.response_ids.numel()
                ids = step.prompt_ids.tolist()
                extends = ids[:head] == prev.prompt_ids.tolist() + prev.response_ids.tolist()
                label = (
                    f"[observation, {len(ids) - head} tokens]"
                    if extends
                    else f"[next prompt, re-tokenised (it does not extend the last one), {len(ids)} tokens]"
                )
                out.append(f"{label}\n{text(ids[head:] if extends else ids)}")
            turn = step.metadata.get("turn", "?")
            reward = step.metadata.get("env_reward")
            out.append(
                f"[turn {turn} reply, {step.response_ids.numel()} tokens"
                f"{'' if reward is None else f', env reward {reward:g}'}]\n{text(step.response_ids.tolist())}"
            )
            prev = step
        last = trajectory[-1]
        out.append(f"--> reward {last.reward:g}, stop_reason {last.stop_reason}")
        if last.metadata.get("error"):
            out.append(f"    error: {last.metadata['error']}\n{last.metadata.get('error_traceback', '')}")
        out.append("")
    return "\n".join(out) + "\n"
