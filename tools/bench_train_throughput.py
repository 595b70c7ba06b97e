"""Training throughput of `StepwisePlugin.train_minibatch`: tokens/s and MFU.

Synthetic multi-turn agent steps (random weights, random tokens) are packed into micro-batches
of `--max-tokens` tokens and trained for `--iterations` optimizer steps; the first is warm-up.
FLOPs count what the step computes: 6 x (non-embedding matmul parameters) x tokens, causal
attention 6 x layers x (heads x head_dim) x sum(L^2), and the output layer only at trained
positions, 6 x vocab x hidden x trained tokens. MFU = achieved FLOP/s / (`--peak-tflops` x GPUs).

    python tools/bench_train_throughput.py --model tiny                       # CPU smoke run
    torchrun --nproc-per-node 8 tools/bench_train_throughput.py --model qwen2.5-0.5b \
        --tp 1 --max-tokens 4096 --peak-tflops 989                            # H100 bf16 dense

On GPU this uses the TE spec and bf16 when available. Untested on GPU so far.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

MODELS = {
    "tiny": None,  # model.tiny_config()
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, hidden_act="silu"),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, hidden_act="silu"),
}


def train_flops(arch, batch) -> float:
    h, ffn, layers = arch.hidden_size, arch.ffn_hidden_size, arch.num_layers
    d_attn, d_kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = h * (d_attn + 2 * d_kv) + d_attn * h + 3 * h * ffn  # qkv, proj, SwiGLU (gate, up, down)
    tokens = int(batch.lengths.sum())
    trained = int((batch.token_fields["loss_mask"] != 0).sum())
    sq = float((batch.lengths.double() ** 2).sum())
    return 6.0 * layers * per_layer * tokens + 6.0 * layers * d_attn * sq + 6.0 * arch.vocab_size * h * trained


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=8, help="prompts per mini-batch (x4 samples, 1-4 turns)")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak for MFU (0: skip)")
    args = p.parse_args()

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_stepwise.algo.advantages import compute_advantages
    from megatron_stepwise.algo.losses import LossConfig
    from megatron_stepwise.megatron import runtime
    from megatron_stepwise.megatron.model import arch_from_hf, build_model_chunks, tiny_config, unwrap
    from megatron_stepwise.megatron.packing import set_response_field
    from megatron_stepwise.megatron.plugin import StepwisePlugin
    from megatron_stepwise.synthetic import AgentWorkload, make_agent_steps
    from megatron_stepwise.types import StepBatch

    layout = runtime.init_distributed(args.tp, args.pp)
    hf = MODELS[args.model] or tiny_config()
    arch = arch_from_hf(hf)
    chunks = build_model_chunks(hf)
    bf16 = chunks[0].config.bf16
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=bf16, clip_grad=1.0), chunks)
    plugin = StepwisePlugin(LossConfig(), max_tokens_per_microbatch=args.max_tokens)
    scale = max(1, args.max_tokens // 16)
    workload = AgentWorkload(num_prompts=args.prompts, samples_per_prompt=4, turns=(1, 4),
                             prompt_len=(scale // 4, scale), obs_len=(scale // 8, scale // 2),
                             response_len=(scale // 8, scale // 2), vocab_size=arch.vocab_size)

    times, flops, tokens = [], 0.0, 0
    for it in range(args.iterations):
        steps = make_agent_steps(dataclasses.replace(workload, seed=it))
        batch = StepBatch.from_steps(steps)
        if int(batch.lengths.max()) > args.max_tokens:
            raise SystemExit(f"a synthetic step has {int(batch.lengths.max())} tokens > --max-tokens {args.max_tokens}")
        set_response_field(batch, "advantages", compute_advantages(steps, "grpo"))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        metrics = plugin.train_minibatch(chunks, optimizer, batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if it > 0:  # the first iteration is warm-up
            times.append(time.perf_counter() - t)
            flops += train_flops(arch, batch)
            tokens += int(batch.lengths.sum())
    if layout.rank == 0 and times:
        elapsed = sum(times)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        n_dev = layout.world_size
        attn = type(unwrap(chunks[0]).decoder.layers[0].self_attention.core_attention).__name__
        line = (f"{args.model} on {n_dev} x {device} (TP{layout.tp} PP{layout.pp} DP{layout.dp}, "
                f"{'bf16' if bf16 else 'fp32'}, attention {attn}): "
                f"{tokens / elapsed:,.0f} tokens/s ({tokens / elapsed / n_dev:,.0f} per device), "
                f"{flops / elapsed / 1e12:.2f} TFLOP/s, micro-batches/rank {metrics['num_microbatches']:.0f}")
        if args.peak_tflops > 0:
            line += f", MFU {flops / elapsed / (args.peak_tflops * 1e12 * n_dev):.1%}"
        print(line, flush=True)
    runtime.destroy_distributed()


if __name__ == "__main__":
    main()
