"""Engine-style forward vs the trainer's log-probs on the same weights (prints measured figures;
never asserts).

The trainer side is `StepwisePlugin.compute_logprobs_flat`: megatron-core at world size 1, the
step rows packed into THD micro-batches (`PackedSeqParams`), log-probs of the trained tokens only.
The engine side is what a rollout engine computes: Hugging Face transformers' model loaded from
the trainer's own export (`export_hf`), one unpadded sequence per step row, full logits,
`log_softmax` in fp32, the log-prob of each next token. Both run in each dtype in turn (bf16:
the export in bf16, both models in bf16; fp32: the same bf16-valued weights imported into an
fp32 megatron model and loaded into an fp32 HF model), on the same rows. Weights are megatron's
random initialisation (nothing is downloaded), so the log-probs' spread is small; it is printed
next to the differences.

    python tools/bench/bench_engine_agreement.py [--model qwen2.5-0.5b] [--device cuda] [--out F]

`--device cpu --model tiny` runs the same code on the CPU (a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flops import QWEN2_CONFIGS  # noqa: E402
from harness import add_seed_and_out, bench_parser, config, cuda_skip, run_args, script_main  # noqa: E402

from megatron_stepwise.algo.losses import LossConfig  # noqa: E402
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps  # noqa: E402
from megatron_stepwise.hf.presets import tiny_config  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "fewer, shorter rows")
    p.add_argument("--model", default="qwen2.5-0.5b", choices=[*QWEN2_CONFIGS, "tiny"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--micro-tokens", type=int, default=4096)
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples = 2, 2
    return args


def engine_logprobs(model, batch, device: str) -> torch.Tensor:
    """Per row, one unpadded forward of the HF model: log p(token i | tokens < i) in fp32, flat
    like the batch's tokens (0 at each row's first token)."""
    flat = torch.zeros(batch.tokens.numel(), dtype=torch.float32)
    offsets = batch.offsets.tolist()
    with torch.no_grad():
        for start, end in zip(offsets[:-1], offsets[1:]):
            ids = batch.tokens[start:end].to(device)
            logits = model(input_ids=ids[None]).logits[0].float()
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
            flat[start + 1 : end] = logp.cpu()
    return flat


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    args = run_args(parse_args, quick, options)
    if skipped := cuda_skip("bench_engine_agreement", args.device):
        return skipped
    from megatron_stepwise.mcore.runtime.runtime import destroy_distributed, silence_megatron_noise

    silence_megatron_noise()
    from bench_trainer_step import start_world_of_one
    from transformers import AutoModelForCausalLM

    from megatron_stepwise.mcore.train.model import build_model_chunks, te_available
    from megatron_stepwise.mcore.train.plugin import StepwisePlugin
    from megatron_stepwise.mcore.weights.convert import export_hf, import_hf
    from megatron_stepwise.steps import StepBatch

    hf = tiny_config() if args.model == "tiny" else QWEN2_CONFIGS[args.model]
    w = AgentWorkload(
        num_prompts=args.prompts,
        samples_per_prompt=args.samples,
        turns=(1, 3),
        prompt_len=(100, 600),
        obs_len=(50, 1000),
        response_len=(20, 400),
        vocab_size=hf["vocab_size"],
        success_prob=0.5,
        seed=args.seed,
    )
    steps = make_agent_steps(w)
    batch = StepBatch.from_steps(steps)
    trained = batch.token_fields["loss_mask"] != 0
    plugin = StepwisePlugin(
        LossConfig(policy_loss="ppo", reduction="token_mean"), max_tokens_per_microbatch=args.micro_tokens
    )
    device = args.device
    results: dict[str, Any] = {}
    start_world_of_one()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            export_dir = Path(tmp) / "hf"
            for name in ("bf16", "fp32"):
                dtype = DTYPES[name]
                chunks = build_model_chunks(hf, config_overrides={"dtype": dtype})
                if name == "bf16":
                    export_hf(chunks, export_dir, hf)  # the trainer's weights, as an engine loads them
                else:
                    import_hf(chunks, export_dir)  # the same (bf16-valued) weights in fp32
                t = time.perf_counter()
                trainer = plugin.compute_logprobs_flat(chunks, batch)
                trainer_s = time.perf_counter() - t
                del chunks
                model = (
                    AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=dtype, attn_implementation="sdpa")
                    .to(device)
                    .eval()
                )
                t = time.perf_counter()
                engine = engine_logprobs(model, batch, device)
                engine_s = time.perf_counter() - t
                del model
                if device == "cuda":
                    torch.cuda.empty_cache()
                diff = (trainer - engine)[trained].abs()
                results[name] = {
                    "max_abs_diff": float(diff.max()),
                    "mean_abs_diff": float(diff.mean()),
                    "p99_abs_diff": float(diff.quantile(0.99)) if diff.numel() else 0.0,
                    "logprob_mean": float(engine[trained].mean()),
                    "logprob_std": float(engine[trained].std()),
                    "finite": bool(torch.isfinite(trainer[trained]).all()),
                    "trainer_s": trainer_s,
                    "engine_s": engine_s,
                }
    finally:
        destroy_distributed()

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run)"
    spec = "Transformer Engine" if te_available() else "local"
    n_trained = int(trained.sum())
    print(
        f"Engine (HF transformers, one unpadded forward per row, sdpa) vs trainer (megatron-core, {spec} spec, "
        f"THD-packed micro-batches of <= {args.micro_tokens} tokens): {where}, {args.model} random init, "
        f"{len(steps)} step rows, {batch.tokens.numel():,} tokens, {n_trained:,} trained"
    )
    print(
        f"  {'dtype':<6}{'max |dlogp|':>13}{'p99':>11}{'mean':>11}{'logp mean':>11}{'logp std':>10}"
        f"{'trainer s':>11}{'engine s':>10}"
    )
    for name, r in results.items():
        print(
            f"  {name:<6}{r['max_abs_diff']:>13.2e}{r['p99_abs_diff']:>11.2e}{r['mean_abs_diff']:>11.2e}"
            f"{r['logprob_mean']:>11.3f}{r['logprob_std']:>10.3f}{r['trainer_s']:>11.2f}{r['engine_s']:>10.2f}"
        )
    return {
        "config": config(args),
        "device": where,
        "transformer_engine": te_available(),
        "rows": len(steps),
        "tokens": int(batch.tokens.numel()),
        "trained_tokens": n_trained,
        "dtypes": results,
    }


if __name__ == "__main__":
    script_main(parse_args, run)
