"""torchrun worker for tests/integration/test_routing_replay.py: rollout routing replay end to end.

The tiny Qwen3-MoE is built in megatron (routing replay enabled in its config), its weights go
to an embedded engine whose routers are slightly perturbed (`LocalEngine(router_noise=...)`),
and the engine samples two-turn trajectories (the second prompt extends the first turn's ids
with an observation, so the steps merge). The trainer then scores the sampled tokens with
replay on and off, merged and unmerged, and records which experts its routers used.
Every rank builds the same engine and the same steps; rank 0 writes the results.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os

import megatron_worker as mw
import torch
import torch.distributed as dist
from worker_entry import run_worker

from megatron_stepwise.algo.merge import merge_steps
from megatron_stepwise.algo.shards import LOGPROBS
from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.train import routing_replay
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.mcore.train.routers import local_tokens
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.mcore.weights.hf_mapping import canonical_to_hf
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.hf_model import load_named_tensors
from megatron_stepwise.rollout.engines.protocol import SamplingParams
from megatron_stepwise.rollout.engines.routed_experts import pad_to_tokens
from megatron_stepwise.steps import Step, StepBatch, TrajectoryID

PROMPTS = [[5, 17, 33, 2, 9], [41, 7, 7, 120, 64, 3, 88], [200, 13]]
OBSERVATIONS = [[11, 12, 13], [99, 98], [150, 151, 152, 153]]


def rollout(cfg: dict, state: dict, noise: float, mode: str = "select") -> list[Step]:
    """Two turns per trajectory on the perturbed engine; one Step per turn."""
    engine = LocalEngine(cfg, seed=3, eos_token_ids=[], router_noise=noise, router_noise_mode=mode)
    load_named_tensors(engine.model, state)
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=12 + 2 * i, sampling_seed=100 + i) for i in range(3)]

    async def run():
        first = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(PROMPTS, sampling)))
        second_prompts = [p + r.output_ids + o for p, r, o in zip(PROMPTS, first, OBSERVATIONS)]
        second = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(second_prompts, sampling)))
        await engine.close()
        return [(PROMPTS, first), (second_prompts, second)]

    turns = asyncio.run(run())
    steps = []
    for t in range(3):
        for turn, (prompts, results) in enumerate(turns):
            prompt, res = prompts[t], results[t]
            steps.append(
                Step(
                    trajectory_id=TrajectoryID(f"p{t}", 0),
                    prompt_ids=prompt,
                    response_ids=res.output_ids,
                    loss_mask=[1] * len(res.output_ids),
                    rollout_logprobs=res.logprobs,
                    is_last_step=turn == 1,
                    routed_experts=pad_to_tokens(res.routed_experts, len(prompt) + len(res.output_ids)),
                )
            )
    return steps


def gap(plugin, chunks, batch: StepBatch) -> dict:
    flat = plugin.compute_logprobs_flat(chunks, batch)
    mask = batch.token_fields["loss_mask"] != 0
    diff = (flat - batch.token_fields["rollout_logprobs"])[mask].abs().double()
    return {"mean": float(diff.mean()), "max": float(diff.max()), "n": int(mask.sum())}


def train_gap(plugin, chunks, batch: StepBatch) -> dict:
    """One forward and backward in training mode (megatron's schedule): the loss's own
    train-vs-rollout gap metric, and whether the routers got a finite, non-zero gradient."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch.set_response_field("advantages", [torch.ones(int(n)) for n in batch.response_lens])
    inputs = plugin.prepare_minibatch(chunks, batch)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=plugin.forward_step,
        data_iterator=inputs.data_iterator(),
        model=chunks,
        num_microbatches=inputs.num_microbatches,
        seq_length=inputs.seq_length,
        micro_batch_size=1,
        forward_only=False,
    )
    metrics = plugin.reduce_metrics(losses)
    plugin.router_losses.clear()
    grads = W.full_state(chunks, grads=True)
    router = torch.stack([g.abs().sum() for k, g in grads.items() if k.endswith("mlp.router.weight")])
    return {
        "gap": metrics["logprob_gap/train_vs_rollout"],
        "router_grad_ok": bool(torch.isfinite(router).all()) and bool((router > 0).all()),
    }


def chosen_experts(plugin, chunks, batch: StepBatch) -> dict:
    """Run the micro-batches through megatron's (forward-only) schedule, recording the experts each
    router used; count the positions (x layers) whose engine experts are known and where the
    trainer's differ. Summed over ranks (each holds its own micro-batches, layers, CP/SP slices)."""
    routers = []
    for chunk in chunks:
        routers += routing_replay.record_routing(M.unwrap(chunk))
    seen = []  # (router, the experts it used) for every router forward, in order
    hooks = [
        r.register_forward_hook(lambda mod, inp, out: seen.append((mod, mod.router_replay.recorded_topk_idx)))
        for r in routers
    ]
    inputs = plugin.prepare_minibatch(chunks, batch, mode=LOGPROBS)
    with torch.no_grad():
        plugin._run_schedule(chunks, inputs, forward_only=True)
    config = M.unwrap(chunks[0]).config
    known = differ = 0
    per_router: dict = {}
    for router, idx in seen:
        per_router.setdefault(router, []).append(idx)
    for router, forwards in per_router.items():
        assert len(forwards) == len(inputs.microbatches)
        for mb, idx in zip(inputs.microbatches, forwards):
            engine = local_tokens(mb.routed_experts, config)[:, router.layer_number - 1].long()
            want, got = engine.sort(-1).values, idx.sort(-1).values
            rows = (want >= 0).all(-1)
            known += int(rows.sum())
            differ += int((got[rows] != want[rows]).any(-1).sum())
    for hook in hooks:
        hook.remove()
    for r in routers:
        r.router_replay.record = False
    counts = torch.tensor([known, differ], dtype=torch.float64)
    if dist.get_world_size() > 1:
        buf = counts.to(runtime.comm_device())
        dist.all_reduce(buf)
        counts = buf.cpu()
    return {"known": int(counts[0]), "differ": int(counts[1])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--router-scale", type=float, default=1.0, help="scale the routers' initial weights (sharpness)")
    args = p.parse_args()
    runtime.init_distributed(args.tp, args.pp, args.cp, expert_parallel=args.ep, seed=mw.SEED)
    cfg = M.tiny_config(model_type="qwen3_moe")

    def init(bare):
        W.init_deterministic(bare, seed=mw.SEED)
        with torch.no_grad():
            for chunk in bare:
                for name, param in chunk.named_parameters():
                    if name.endswith("mlp.router.weight"):
                        param.mul_(args.router_scale)

    chunks = M.build_model_chunks(cfg, init=init, config_overrides={"moe_enable_routing_replay": True})
    gpt = M.unwrap(chunks[0])
    full = W.full_state(chunks)
    if args.pp > 1:  # each pipeline stage holds its own layers: every rank gets them all
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, full)
        full = {k: v for part in parts for k, v in part.items()}
    state = canonical_to_hf(full, M.arch_from_hf(cfg))
    # with the router losses on: they count the replayed dispatch
    plugin = StepwisePlugin(dataclasses.replace(mw.MOE_LOSS, kl_coef=0.0), max_tokens_per_microbatch=args.budget)
    results = {"noise": args.noise}
    steps = rollout(cfg, state, args.noise)
    merged, stats = merge_steps(steps)
    results["merged_rows"] = stats.rows_after
    batches = {
        "unmerged": StepBatch.from_steps(steps),
        "merged": StepBatch.from_steps(merged),
        # the gate weight perturbed for the gating values too: replay removes only the flips
        "weights_noise": StepBatch.from_steps(rollout(cfg, state, args.noise, "weights")),
    }
    for name, batch in batches.items():
        for replay in (True, False):
            gpt.config.moe_enable_routing_replay = replay
            key = f"{name}/{'replay' if replay else 'no_replay'}"
            results[key] = {"gap": gap(plugin, chunks, batch), "experts": chosen_experts(plugin, chunks, batch)}
            if name == "merged":
                results[key]["train"] = train_gap(plugin, chunks, batch)
    # Control: an unperturbed engine agrees with the trainer without replay.
    gpt.config.moe_enable_routing_replay = False
    exact = StepBatch.from_steps(rollout(cfg, state, 0.0))
    results["unperturbed/no_replay"] = {
        "gap": gap(plugin, chunks, exact),
        "experts": chosen_experts(plugin, chunks, exact),
    }
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "routing_replay.json"), "w") as f:
            json.dump(results, f, indent=1)
    runtime.destroy_distributed()


if __name__ == "__main__":
    run_worker(main)
