"""torchrun worker for tests/integration/test_megatron_parallel.py: one parallel layout, every check.

Builds the tiny model with layout-independent weights, then on the fixed mini-batch (and its
merged form): plugin log-probs (and, at PP1, megatron's own full-logits reference), one
`train_minibatch` step (metrics, gradients, parameters after the step), the merged batch's
metrics and gradients through the low-level `forward_step` + `get_forward_backward_func` path,
and the bad-input errors; with gateway=1, the gateway's recorded steps merged and unmerged
(gateway_training.py). Stage results are saved by DP rank 0 / TP rank 0 of every stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

# Siblings by bare name: Python puts this script's directory (tests/) on sys.path.
import megatron_cases as cases
import torch
import torch.distributed as dist
from gateway_training import train_gateway_steps
from oracles import megatron_lm_logged_metrics
from worker_entry import run_worker

from megatron_stepwise.algo.losses import LossConfig
from megatron_stepwise.algo.shards import HostLoopMismatchError, UnsupportedLayoutError
from megatron_stepwise.hf.arch import ModelConfigError
from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.steps import Step, StepwiseBatchError, TrajectoryID

SEED = 7


RUN_DEFAULTS = {
    "tp": 1,
    "pp": 1,
    "vpp": 1,
    "cp": 1,
    "ep": 1,
    "moe": 0,
    "budget": 64,
    "sp": 1,
    "distopt": 0,
    "per_token_loss": 0,
    "tied": 0,
    "bf16": 0,
    "vocab": 256,
    "gateway": 0,
    "one_call": 0,
}


def parse():
    """`--layout NAME:key=value,...` (repeatable): layouts run one after another in this launch,
    re-creating megatron's parallel state on the same process group. Keys: RUN_DEFAULTS
    (bf16=1: bf16 weights and compute, fp32 main params and gradient reduction, as on GPU;
    one_call=1: the local spec's one-call packed attention instead of auto's per-row on CPU;
    gateway=1: also train the steps of `--gateway-steps` merged and unmerged, gateway_training.py)."""
    p = argparse.ArgumentParser()
    p.add_argument("--layout", action="append", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--gateway-steps", help="the gateway's recorded steps (torch.save'd by the test)")
    args = p.parse_args()
    runs = []
    for spec in args.layout:
        name, _, opts = spec.partition(":")
        run = dict(RUN_DEFAULTS, name=name)
        for item in filter(None, opts.split(",")):
            key, _, value = item.partition("=")
            if key not in RUN_DEFAULTS:
                raise SystemExit(f"unknown run option {key!r} in {spec!r}")
            run[key] = int(value)
        if run["gateway"] and not args.gateway_steps:
            raise SystemExit(f"layout {name!r} has gateway=1 but no --gateway-steps was given")
        run["gateway_steps"] = args.gateway_steps
        runs.append(argparse.Namespace(**run))
    return args.out, runs


LOSS = LossConfig(
    policy_loss="ppo",
    clip_low=0.2,
    clip_high=0.28,
    reduction="trajectory_mean",  # weights that depend on the whole mini-batch, merge-invariant
    kl_coef=0.05,
    kl_estimator="k3",
    entropy_coef=0.01,
    tis="token",
    tis_cap=2.0,
)


# MoE layouts also train the router losses, with coefficients large enough that a wrong scale
# under some split would show in the gradients.
MOE_LOSS = dataclasses.replace(LOSS, router_aux_coef=0.1, router_z_coef=0.01)


def loss_of(args):
    return MOE_LOSS if args.moe else LOSS


def make_plugin(args):
    # logprob_chunk_tokens=7: several chunks per micro-batch, exercising the chunked path.
    return StepwisePlugin(loss_of(args), max_tokens_per_microbatch=args.budget, logprob_chunk_tokens=7)


def attach_old_and_ref(plugin, chunks, batch):
    flat = plugin.compute_logprobs_flat(chunks, batch)
    mask = batch.token_fields["loss_mask"].float()
    batch.token_fields["old_logprobs"] = (flat + batch.token_fields["old_noise"]) * mask
    batch.token_fields["ref_logprobs"] = (flat + batch.token_fields["ref_noise"]) * mask
    return flat


def megatron_full_logits_logprobs(chunks, batch):
    """Reference at PP1: megatron's own forward with the output layer, full logits gathered over
    TP (vocabulary padding dropped), log_softmax, gather the next token."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megatron_stepwise.mcore.train.packing import pack_rows

    model = chunks[0]
    model.eval()
    cfg = M.unwrap(model).config
    align = model.config.tensor_model_parallel_size if cfg.sequence_parallel else 1
    out = torch.zeros(batch.tokens.numel())
    with torch.no_grad():
        for r in range(batch.num_rows):
            mb = pack_rows(batch, [r], align=align)
            logits = model(
                mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params(torch.device("cpu"))
            )
            logits = gather_from_tensor_model_parallel_region(logits)[0]  # [S, V padded]
            logits = logits[:, : M.unwrap(model).unpadded_vocab_size]  # the real vocabulary
            logp = torch.log_softmax(logits.float(), dim=-1)
            out[mb.token_index] = logp[mb.pred_index, mb.targets]
    model.train()
    return out


def run_bad_inputs(args, chunks, optimizer, layout):
    """Each bad input must raise a clear error on every rank, before any collective."""
    plugin = make_plugin(args)
    msgs = {}

    def expect(name, fn, exc):
        try:
            fn()
        except exc as e:
            msgs[name] = str(e)
        else:
            msgs[name] = "NO ERROR"

    tid = TrajectoryID("bad", 0)

    def batch_of(steps):
        b = plugin.as_batch(steps)
        b.token_fields["advantages"] = b.token_fields["loss_mask"].float()
        return b

    long_step = Step(tid, list(range(1, args.budget)), [5, 6, 7], [1, 1, 1], is_last_step=True)
    expect("over_budget", lambda: plugin.train_minibatch(chunks, optimizer, batch_of([long_step])), StepwiseBatchError)
    untrained = [
        Step(tid, [1, 2, 3], [4, 5], [0, 0], is_last_step=False),
        Step(tid, [1, 2, 3, 4, 5, 9], [6], [0], is_last_step=True),
    ]
    expect("no_trainable", lambda: plugin.train_minibatch(chunks, optimizer, batch_of(untrained)), StepwiseBatchError)
    oov = [
        Step(tid, [1, 2, 3], [4, 5], [1, 1], is_last_step=False),
        Step(tid, [1, 2], [300, 5], [1, 1], is_last_step=True),
    ]
    expect("token_out_of_vocab", lambda: plugin.train_minibatch(chunks, optimizer, batch_of(oov)), StepwiseBatchError)
    # LOSS has tis='token': the engine's log-prob of every trained token is needed, and step 1 has none.
    no_logprobs = [
        Step(tid, [1, 2, 3], [4, 5], [1, 1], rollout_logprobs=[-0.5, -1.0], is_last_step=False),
        Step(tid, [1, 2, 3, 4, 5, 9], [6, 7], [1, 1], is_last_step=True),
    ]
    expect(
        "no_rollout_logprobs",
        lambda: plugin.train_minibatch(chunks, optimizer, batch_of(no_logprobs)),
        StepwiseBatchError,
    )
    stage = 0 if args.vpp > 1 else None  # under virtual pipeline parallelism a chunk names its stage
    expect(
        "tokenizer_vocab",
        lambda: M.build_gpt_model(M.tiny_config(), tokenizer_vocab_size=300, vp_stage=stage),
        ModelConfigError,
    )
    expect(
        "heads_not_divisible",
        lambda: M.build_gpt_model(
            M.tiny_config(hidden_size=48, num_heads=3, num_kv_heads=3, ffn_hidden_size=128), vp_stage=stage
        ),
        ModelConfigError,
    )
    run_fixed_count_checks(args, chunks, plugin, batch_of, expect, msgs)
    # All ranks reach this point (no rank hangs in a collective the others skipped).
    alive = torch.ones(1)
    dist.all_reduce(alive)
    msgs["alive_ranks"] = int(alive.item())
    return msgs


def run_fixed_count_checks(args, chunks, plugin, batch_of, expect, msgs):
    """Host loops that run a fixed number of micro-batches (Megatron-LM's pretrain)."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        init_num_microbatches_calculator,
        unset_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp = ps.get_data_parallel_world_size()
    # 2 x dp rows, each filling most of a micro-batch: 2 micro-batches per DP rank.
    long_rows = [
        Step(
            TrajectoryID(f"f{i}", 0),
            list(range(1, args.budget // 2 + 4)),
            [5, 6, 7],
            [1, 1, 1],
            rollout_logprobs=[-0.5] * 3,
            is_last_step=True,
        )
        for i in range(2 * dp)
    ]
    batch = batch_of(long_rows)
    expect(
        "fixed_count_too_few",
        lambda: plugin.prepare_minibatch(chunks, batch, num_microbatches=1),
        HostLoopMismatchError,
    )
    padded = plugin.prepare_minibatch(chunks, batch, num_microbatches=4)
    msgs["fixed_count_padded"] = [padded.num_microbatches, sum(len(mb.rows) == 0 for mb in padded.microbatches)]
    expect(
        "schedule_plan",
        lambda: plugin.forward_step(padded.data_iterator(), chunks[0], return_schedule_plan=True),
        UnsupportedLayoutError,
    )
    # megatron's calculator says 3 micro-batches per step (Megatron-LM sets it from the global batch size).
    init_num_microbatches_calculator(dist.get_rank(), None, 3 * dp, 1, dp)
    try:
        expect("host_count_mismatch", lambda: plugin.prepare_minibatch(chunks, batch), HostLoopMismatchError)
        if args.vpp > 1:  # the interleaved schedule runs micro-batches in groups of PP
            expect(
                "vpp_count_not_multiple",
                lambda: plugin.prepare_minibatch(chunks, batch, num_microbatches=3),
                HostLoopMismatchError,
            )
        else:
            msgs["host_count_match"] = plugin.prepare_minibatch(chunks, batch, num_microbatches=3).num_microbatches
        if ps.get_pipeline_model_parallel_world_size() == 1:
            # A loop that skips prepare_minibatch's check: forward_step catches it at the first micro-batch.
            inputs = plugin._prepare(chunks, batch, mode="train")

            def run():
                get_forward_backward_func()(
                    forward_step_func=plugin.forward_step,
                    data_iterator=inputs.data_iterator(),
                    model=chunks,
                    num_microbatches=3,
                    seq_length=inputs.seq_length,
                    micro_batch_size=1,
                    forward_only=False,
                )

            expect("forward_step_count", run, HostLoopMismatchError)
    finally:
        unset_num_microbatches_calculator()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        cfg = M.unwrap(chunks[0]).config
        cfg.variable_seq_lengths = False
        try:
            expect("pp_fixed_shapes", lambda: plugin.prepare_minibatch(chunks, batch), UnsupportedLayoutError)
        finally:
            cfg.variable_seq_lengths = True


def megatron_loop_backward(plugin, chunks, optimizer, batch):
    """Forward and backward of `batch` at the initial weights the way a user's own megatron loop
    drives the plugin (`prepare_minibatch`, `forward_step`, megatron's schedule), no optimizer
    step; returns the prepared inputs, the reduced metrics and what Megatron-LM's train_step would
    log from the same loss dicts (gradients stay in the buffers)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    W.init_deterministic(chunks, seed=SEED)
    inputs = plugin.prepare_minibatch(chunks, batch)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()  # a megatron loop does this every iteration (drops param.grad aliases)
    losses = get_forward_backward_func()(
        forward_step_func=plugin.forward_step,
        data_iterator=inputs.data_iterator(),
        model=chunks,
        num_microbatches=inputs.num_microbatches,
        seq_length=inputs.seq_length,
        micro_batch_size=1,
        forward_only=False,
    )
    return inputs, plugin.reduce_metrics(losses), megatron_lm_logged_metrics(losses)


def run_layout(args, out_dir):
    layout = runtime.init_distributed(
        args.tp, args.pp, args.cp, virtual_pipeline=args.vpp, expert_parallel=args.ep, seed=SEED
    )
    moe = {"model_type": "qwen3_moe"} if args.moe else {}  # 4 experts, top-2, QK norm
    cfg = M.tiny_config(tie_word_embeddings=bool(args.tied), vocab_size=args.vocab, **moe)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    overrides = {
        "sequence_parallel": bool(args.sp) and args.tp > 1,
        "calculate_per_token_loss": bool(args.per_token_loss),
        "dtype": dtype,
    }
    chunks = M.build_model_chunks(
        cfg,
        config_overrides=overrides,
        use_distributed_optimizer=bool(args.distopt),
        init=lambda c: W.init_deterministic(c, seed=SEED),
        packed_attention="one_call" if args.one_call else "auto",
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.01,
            clip_grad=1.0,
            adam_eps=1e-4,  # Adam's first step is ~lr*sign(g): a larger eps keeps it smooth in g
            use_distributed_optimizer=bool(args.distopt),
            bf16=bool(args.bf16),
            params_dtype=dtype,
        ),
        chunks,
    )
    plugin = make_plugin(args)
    steps, extras = cases.make_steps(vocab=cfg["vocab_size"])
    batch = cases.to_batch(steps, extras)
    merged = cases.to_batch(*cases.merge_for_test(steps, extras))
    result = {"init_params": W.full_state(chunks)}
    # What the bf16 layouts must really run: bf16 weights, fp32 gradient buffers and main params.
    param = next(M.unwrap(chunks[0]).parameters())
    result["dtypes"] = {
        "param": str(param.dtype),
        "main_grad": str(param.main_grad.dtype),
        "optimizers": sorted({type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])}),
    }

    result["logprobs"] = attach_old_and_ref(plugin, chunks, batch)
    result["merged_logprobs"] = attach_old_and_ref(plugin, chunks, merged)
    if args.pp == 1 and args.cp == 1:
        result["megatron_reference_logprobs"] = megatron_full_logits_logprobs(chunks, batch)

    # A shard decided for this rank's DP rank by one process (as the trainer's driver does) scores
    # its rows exactly as the whole mini-batch does, reduced over its replica only.
    shard = plugin.plan_shards(chunks, batch)[layout.dp_rank]
    whole = plugin.compute_logprobs_flat(chunks, batch)
    mine = plugin.compute_logprobs_flat(chunks, shard)
    gap = (mine - whole[shard.minibatch_token_index(torch.arange(shard.batch.tokens.numel()), batch)]).abs().max()
    gap = gap.reshape(1).to(runtime.comm_device())
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    result["shard_logprobs_gap"] = float(gap)

    result["metrics"] = plugin.train_minibatch(chunks, optimizer, batch)
    if not args.distopt:
        result["grads"] = W.full_state(chunks, grads=True)
    result["params_after_step"] = W.full_state(chunks)

    # The merged batch at the initial weights, through the low-level megatron-loop API.
    _, result["merged_metrics"], result["merged_megatron_lm_logged"] = megatron_loop_backward(
        plugin, chunks, optimizer, merged
    )
    if not args.distopt:
        result["merged_grads"] = W.full_state(chunks, grads=True)

    # Every rank gets one extra, empty micro-batch: it must change nothing (loss, metrics, grads).
    from megatron_stepwise.algo.planner import plan_microbatches

    def plan_with_empty(lengths, **kw):
        return [micro + [[]] for micro in plan_microbatches(lengths, **kw)]

    padded_plugin = StepwisePlugin(
        loss_of(args), max_tokens_per_microbatch=args.budget, plan_microbatches=plan_with_empty
    )
    inputs, result["empty_mb_metrics"], _ = megatron_loop_backward(padded_plugin, chunks, optimizer, batch)
    assert inputs.microbatches[-1].num_trained == 0
    result["empty_mb_count"] = inputs.num_microbatches
    if not args.distopt:
        result["empty_mb_grads"] = W.full_state(chunks, grads=True)

    result["bad_inputs"] = run_bad_inputs(args, chunks, optimizer, layout)
    if args.gateway:  # the gateway's steps, on a model of their tokenizer's vocabulary
        result["gateway"] = train_gateway_steps(args.gateway_steps, overrides, SEED)
    os.makedirs(out_dir, exist_ok=True)
    if layout.dp_rank == 0 and layout.tp_rank == 0 and layout.cp_rank == 0:
        torch.save(result, os.path.join(out_dir, f"stage{layout.pp_rank}.pt"))
    if layout.rank == 0:
        with open(os.path.join(out_dir, "bad_inputs.json"), "w") as f:
            json.dump(result["bad_inputs"], f)
    dist.barrier()


def main():
    out, runs = parse()
    for args in runs:
        run_layout(args, os.path.join(out, args.name))
    runtime.destroy_distributed()


if __name__ == "__main__":
    run_worker(main)
