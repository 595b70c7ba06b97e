"""torchrun worker for tests/integration/test_router_losses.py: the plugin's MoE router losses against a
plain re-computation.

On the tiny Qwen3-MoE and the fixed invariance mini-batch: the gradient the router losses add
(plugin with coefficients minus plugin without, same forward) must equal the gradient of the
losses written out directly: every data row run alone through the model, its router logits and
routing map captured by hooks, the balance and z terms summed in plain torch. The reported
metrics must equal the re-computation's values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import megatron_cases as cases
import megatron_worker as mw
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.router import TopKRouter
from worker_entry import run_worker

from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.train.packing import pack_rows
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.mcore.weights import full_views as W

AUX, Z = 0.1, 0.01


def plugin_grads(chunks, batch, aux, z, budget):
    """Forward and backward through the plugin and megatron's schedule; the summed gradients and
    the router metrics."""
    plugin = StepwisePlugin(
        dataclasses.replace(mw.LOSS, router_aux_coef=aux, router_z_coef=z), max_tokens_per_microbatch=budget
    )
    inputs = plugin.prepare_minibatch(chunks, batch)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=plugin.forward_step,
        data_iterator=inputs.data_iterator(),
        model=chunks,
        num_microbatches=inputs.num_microbatches,
        seq_length=inputs.seq_length,
        micro_batch_size=1,
        forward_only=False,
    )
    return W.full_state(chunks, grads=True), plugin.router_losses.reduce(M.unwrap(chunks[0]).config)


def direct_router_losses(chunks, batch):
    """Gradient (into the grad buffers) and values of the router losses, row by row."""
    gpt = M.unwrap(chunks[0])
    captured = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: captured.append((mod, mod.gating(inp[0]), out[1])))
        for m in gpt.modules()
        if isinstance(m, TopKRouter)
    ]
    rows = [r for r in range(batch.num_rows) if not batch.row_fields["is_padding"][r]]
    n_tokens = int(batch.lengths[rows].sum())
    for chunk in chunks:
        chunk.zero_grad_buffer()
    balance, zloss, load = {}, {}, {}
    total = 0.0
    for r in rows:
        captured.clear()
        mb = pack_rows(batch, [r])
        gpt(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params(torch.device("cpu")))
        for router, logits, routing_map in captured:
            layer, experts, k = router.layer_number, router.config.num_moe_experts, router.topk
            logits = logits.reshape(-1, experts).float()
            t = logits.size(0)
            counts = routing_map.reshape(-1, experts).sum(0).double()
            probs = torch.softmax(logits, -1).sum(0)
            b = experts / (k * t * t) * (counts.float() * probs).sum() / len(rows)
            zz = (torch.logsumexp(logits, -1) ** 2).sum() / n_tokens
            total = total + AUX * b + Z * zz
            balance[layer] = balance.get(layer, 0.0) + float(b)
            zloss[layer] = zloss.get(layer, 0.0) + float(zz)
            load[layer] = load.get(layer, 0) + counts
    total.backward()
    for h in hooks:
        h.remove()
    ratios = torch.stack([c / c.mean() for c in load.values()])
    values = {
        "moe/aux_loss": sum(balance.values()) / len(balance),
        "moe/z_loss": sum(zloss.values()) / len(zloss),
        "moe/expert_load_max": float(ratios.max()),
        "moe/expert_load_min": float(ratios.min()),
    }
    return W.full_state(chunks, grads=True), values


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=int, default=64)
    args = p.parse_args()
    runtime.init_distributed(1, 1, 1, seed=mw.SEED)
    cfg = M.tiny_config(model_type="qwen3_moe")
    chunks = M.build_model_chunks(cfg, init=lambda c: W.init_deterministic(c, seed=mw.SEED))
    steps, extras = cases.make_steps(vocab=cfg["vocab_size"])
    batch = cases.to_batch(steps, extras)
    mw.attach_old_and_ref(StepwisePlugin(mw.LOSS, max_tokens_per_microbatch=args.budget), chunks, batch)
    with_losses, metrics = plugin_grads(chunks, batch, AUX, Z, args.budget)
    without, metrics_off = plugin_grads(chunks, batch, 0.0, 0.0, args.budget)
    direct, values = direct_router_losses(chunks, batch)
    os.makedirs(args.out, exist_ok=True)
    torch.save(
        {
            "added": {k: with_losses[k] - without[k] for k in with_losses},
            "direct": direct,
            "metrics": metrics,
            "metrics_without_coefficients": metrics_off,
            "direct_values": values,
        },
        os.path.join(args.out, "router_losses.pt"),
    )
    runtime.destroy_distributed()


if __name__ == "__main__":
    run_worker(main)
