"""Where the engine-vs-trainer bf16 log-prob gap comes from (prints measured figures; never asserts).

Same weights everywhere: megatron's random initialisation of the model shape, exported with
`export_hf` (fp32 and bf16). Measured on the trained tokens of synthetic agent step rows:

- the real pair: the trainer (`StepwisePlugin.compute_logprobs_flat`, megatron-core, THD-packed
  micro-batches) and the engine (HF transformers, one unpadded sdpa forward per row, fp32
  log-softmax), in fp32 (bf16-valued weights: the floor) and in bf16;
- the trainer as it was before `HFRoundedRMSNorm` (torch.nn.RMSNorm's rounding), the same run;
- each side's distance from the exact function (the fp32 reference on the bf16-valued weights);
- the engine against itself under benign changes: its rows batched with padding, eager attention;
- one factor at a time in bf16 (`bf16_reference.Precision`), the rest fp32, against the exact
  function: the weight rounding itself, projections, attention, RMSNorm, RoPE, activations, the
  output layer, the log-softmax; and the order of accumulation under bf16 (fused vs separate
  q/k/v, SDPA vs eager attention).

    python tools/bench/bench_bf16_gap.py [--model qwen2.5-0.5b | --hf-dir DIR] [--norm-noise 0.1]
                                         [--device cpu|cuda] [--out F]

`--quick` runs a tiny model (seconds; the unit test's shape).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bf16_reference import ALL_BF16, Precision, bf16_valued, reference_logprobs  # noqa: E402
from flops import QWEN2_CONFIGS  # noqa: E402
from harness import add_seed_and_out, bench_parser, config, cuda_skip, run_args, script_main  # noqa: E402

from megatron_stepwise.algo.losses import LossConfig  # noqa: E402
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps  # noqa: E402
from megatron_stepwise.hf.arch import GPTArch, arch_from_hf  # noqa: E402
from megatron_stepwise.hf.presets import tiny_config  # noqa: E402

FP32 = Precision()
# One part in bf16 at a time, against the exact function (FP32): (name, what is switched on).
FACTORS: list[tuple[str, Precision]] = [
    ("log-softmax in bf16 (logits fp32)", FP32.with_(log_softmax=True)),
    ("output layer (tied head) in bf16, fp32 log-softmax", FP32.with_(head=True)),
    ("q/k/v/o and MLP projections in bf16", FP32.with_(linear=True)),
    ("attention (SDPA) in bf16", FP32.with_(attention=True)),
    ("RMSNorm in bf16 (HF's: fp32 inside, two roundings)", FP32.with_(norm="bf16")),
    ("RMSNorm in bf16 without the upcast", FP32.with_(norm="bf16-naive")),
    ("RoPE in bf16", FP32.with_(rope=True)),
    ("residual stream and SwiGLU product in bf16", FP32.with_(activations=True)),
    ("all of it in bf16 except the log-softmax (a bf16 model)", ALL_BF16),
]
# Under bf16, one change of accumulation order (against ALL_BF16).
ORDERS: list[tuple[str, Precision]] = [
    ("one fused q-k-v projection (megatron) vs three (HF)", ALL_BF16.with_(fused_qkv=True)),
    ("eager attention vs SDPA", ALL_BF16.with_(eager_attention=True)),
    ("projections' inner sums in two fp32 halves (a GPU GEMM's split-K)", ALL_BF16.with_(split_k=True)),
    ("RMSNorm rounded once (torch's, the trainer's) vs twice (HF's)", ALL_BF16.with_(norm="bf16-fused")),
]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__, "tiny model, few short rows (seconds)")
    p.add_argument("--model", default="qwen2.5-0.5b", choices=[*QWEN2_CONFIGS, "tiny"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--hf-dir", help="a real model's HF directory (its weights and config) instead of --model's random init"
    )
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--obs-len", type=int, default=300, help="longest observation (tokens)")
    p.add_argument("--batch-rows", type=int, default=4, help="rows per padded forward of the batched engine")
    p.add_argument("--micro-tokens", type=int, default=4096)
    p.add_argument(
        "--norm-noise",
        type=float,
        default=0.0,
        help="RMSNorm weights 1 + NOISE * N(0, 1) instead of megatron's 1 (trained models' are not 1)",
    )
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.obs_len = "tiny", 100
    return args


def model_config(args: argparse.Namespace) -> dict:
    if args.hf_dir:
        from megatron_stepwise.mcore.weights.convert import load_hf_config

        return load_hf_config(args.hf_dir)
    if args.model == "tiny":
        return tiny_config(num_layers=2, vocab_size=512, tie_word_embeddings=True)
    return QWEN2_CONFIGS[args.model]


def make_rows(hf: dict, args: argparse.Namespace):
    from megatron_stepwise.steps import StepBatch

    w = AgentWorkload(
        num_prompts=args.prompts,
        samples_per_prompt=args.samples,
        turns=(1, args.max_turns),
        prompt_len=(50, 300),
        obs_len=(20, args.obs_len),
        response_len=(20, 200),
        vocab_size=hf["vocab_size"],
        success_prob=0.5,
        seed=args.seed,
    )
    return StepBatch.from_steps(make_agent_steps(w))


def row_bounds(batch) -> list[tuple[int, int]]:
    offsets = batch.offsets.tolist()
    return list(zip(offsets[:-1], offsets[1:]))


def perturb_norms(chunks: list, noise: float, seed: int) -> None:
    """Norm weights of 1 + noise * N(0, 1): at megatron's initial 1 the roundings of HF's and
    torch's RMSNorm coincide, at a trained model's weights they do not."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if "norm" in name and param.dim() == 1:
                    param.mul_(1 + noise * torch.randn(param.shape, generator=gen).to(param))


@contextlib.contextmanager
def torch_rounded_norm():
    """The trainer as before `HFRoundedRMSNorm`: torch.nn.RMSNorm's one rounding (the "before"
    of that change, measured in the same run)."""
    from megatron_stepwise.mcore.train.hf_rms_norm import HFRoundedRMSNorm

    own = HFRoundedRMSNorm.forward
    HFRoundedRMSNorm.forward = torch.nn.RMSNorm.forward
    try:
        yield
    finally:
        HFRoundedRMSNorm.forward = own


def trainer_logprobs(arch: GPTArch, hf_dir: Path, batch, dtype: torch.dtype, micro_tokens: int) -> torch.Tensor:
    from megatron_stepwise.mcore.train.model import model_chunks_from_arch
    from megatron_stepwise.mcore.train.plugin import StepwisePlugin
    from megatron_stepwise.mcore.weights.convert import import_hf

    chunks = model_chunks_from_arch(arch, config_overrides={"dtype": dtype})
    import_hf(chunks, hf_dir)
    plugin = StepwisePlugin(
        LossConfig(policy_loss="ppo", reduction="token_mean"), max_tokens_per_microbatch=micro_tokens
    )
    return plugin.compute_logprobs_flat(chunks, batch)


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[1:, None])[:, 0].cpu()


@torch.no_grad()
def engine_logprobs(model, batch, device: str, batch_rows: int = 1) -> torch.Tensor:
    """HF forwards, flat like the batch's tokens; `batch_rows` > 1: rows right-padded into batches
    of that many (an attention mask, other matmul shapes), a benign change for the same model."""
    flat = torch.zeros(batch.tokens.numel(), dtype=torch.float32)
    bounds = row_bounds(batch)
    for g in range(0, len(bounds), batch_rows):
        group = bounds[g : g + batch_rows]
        longest = max(e - s for s, e in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros(len(group), longest, dtype=torch.long)
        for i, (s, e) in enumerate(group):
            ids[i, : e - s], mask[i, : e - s] = batch.tokens[s:e], 1
        extra = {"attention_mask": mask.to(device)} if batch_rows > 1 else {}
        logits = model(input_ids=ids.to(device), **extra).logits
        for i, (s, e) in enumerate(group):
            flat[s + 1 : e] = _next_token_logprobs(logits[i, : e - s], ids[i, : e - s].to(device))
    return flat


def load_engine(hf_dir: Path, dtype: torch.dtype, device: str, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


def reference_flat(state, arch: GPTArch, batch, trained: torch.Tensor, p: Precision, device: str) -> torch.Tensor:
    flat = torch.zeros(batch.tokens.numel(), dtype=torch.float32)
    for s, e in row_bounds(batch):
        scored = trained[s:e].clone()
        scored[0] = False
        if scored.any():
            ids = batch.tokens[s:e].to(device)
            flat[s:e][scored] = reference_logprobs(state, arch, ids, p, scored.to(device)).cpu()
    return flat


def gap(a: torch.Tensor, b: torch.Tensor, trained: torch.Tensor) -> dict[str, float]:
    d = (a - b)[trained].abs().double()
    return {"max": float(d.max()), "p99": float(d.quantile(0.99)), "mean": float(d.mean())}


def load_state(hf_dir: Path, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update({k: t.float().to(device) for k, t in load_file(str(f)).items()})
    return state


def measure(hf: dict, arch: GPTArch, args: argparse.Namespace, tmp: Path) -> tuple[dict, dict, Any, torch.Tensor]:
    """Every log-prob vector the table compares, by name, and the seconds each took."""
    from megatron_stepwise.mcore.train.model import model_chunks_from_arch
    from megatron_stepwise.mcore.weights.convert import export_hf, import_hf

    batch = make_rows(hf, args)
    trained = batch.token_fields["loss_mask"] != 0
    dir32, dir16 = tmp / "fp32", tmp / "bf16"
    chunks = model_chunks_from_arch(arch, config_overrides={"dtype": torch.float32})
    if args.hf_dir:
        import_hf(chunks, args.hf_dir)
    if args.norm_noise:
        perturb_norms(chunks, args.norm_noise, args.seed)
    export_hf(chunks, dir32, hf)
    export_hf(chunks, dir16, hf, dtype=torch.bfloat16)
    del chunks
    logp: dict[str, torch.Tensor] = {}
    secs: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., torch.Tensor], *fn_args: Any) -> None:
        t = time.perf_counter()
        logp[name] = fn(*fn_args)
        secs[name] = time.perf_counter() - t
        print(f"  {name}: {secs[name]:.1f}s", flush=True)

    dev, micro = args.device, args.micro_tokens
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        timed(f"trainer {tag}", trainer_logprobs, arch, dir16, batch, dtype, micro)
        timed(f"engine {tag}", engine_logprobs, load_engine(dir16, dtype, dev), batch, dev)
    with torch_rounded_norm():
        timed("trainer bf16, torch's RMSNorm", trainer_logprobs, arch, dir16, batch, torch.bfloat16, micro)
    engine = load_engine(dir16, torch.bfloat16, dev)
    timed("engine bf16 batched", engine_logprobs, engine, batch, dev, args.batch_rows)
    del engine
    timed("engine bf16 eager", engine_logprobs, load_engine(dir16, torch.bfloat16, dev, attn="eager"), batch, dev)
    original = load_state(dir32, dev)
    state = bf16_valued(original)
    timed("reference fp32", reference_flat, state, arch, batch, trained, FP32, dev)
    timed("reference fp32 weights", reference_flat, original, arch, batch, trained, FP32, dev)
    del original
    for name, p in FACTORS + ORDERS:
        timed(name, reference_flat, state, arch, batch, trained, p, dev)
    return logp, secs, batch, trained


def comparisons() -> list[tuple[str, str, str, str]]:
    """(section, label, a, b): the table's rows."""
    real = [
        ("(a) floor", "trainer fp32 vs engine fp32 (bf16-valued weights)", "trainer fp32", "engine fp32"),
        ("check", "our fp32 reference vs engine fp32", "reference fp32", "engine fp32"),
        ("gap", "trainer bf16 vs engine bf16", "trainer bf16", "engine bf16"),
        (
            "gap, before the fix",
            "trainer bf16 (torch's RMSNorm) vs engine bf16",
            "trainer bf16, torch's RMSNorm",
            "engine bf16",
        ),
        ("gap", "trainer bf16 vs exact (fp32 reference)", "trainer bf16", "reference fp32"),
        ("gap", "engine bf16 vs exact (fp32 reference)", "engine bf16", "reference fp32"),
        (
            "(g) engine floor",
            "engine bf16: one row per forward vs rows batched with padding",
            "engine bf16",
            "engine bf16 batched",
        ),
        ("(g) engine floor", "engine bf16: sdpa vs eager attention", "engine bf16", "engine bf16 eager"),
        (
            "(b) weights",
            "fp32 weights vs bf16-rounded weights, fp32 compute",
            "reference fp32 weights",
            "reference fp32",
        ),
    ]
    factors = [("factor alone vs exact", name, name, "reference fp32") for name, _ in FACTORS]
    orders = [("(e) bf16 order", name, name, ALL_BF16_NAME) for name, _ in ORDERS]
    return real + factors + orders


ALL_BF16_NAME = next(name for name, p in FACTORS if p == ALL_BF16)


def run(quick: bool = False, **options: Any) -> dict[str, Any]:
    args = run_args(parse_args, quick, options)
    if skipped := cuda_skip("bench_bf16_gap", args.device):
        return skipped
    from bench_trainer_step import start_world_of_one

    from megatron_stepwise.mcore.runtime.runtime import destroy_distributed, silence_megatron_noise

    silence_megatron_noise()
    hf = model_config(args)
    start_world_of_one()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            logp, secs, batch, trained = measure(hf, arch_from_hf(hf), args, Path(tmp))
    finally:
        destroy_distributed()
    rows = [
        {"section": sec, "compared": label, "a": a, "b": b, **gap(logp[a], logp[b], trained)}
        for sec, label, a, b in comparisons()
    ]
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    norms = f", RMSNorm weights times 1 + {args.norm_noise} N(0, 1)" if args.norm_noise else ""
    n_trained = int(trained.sum())
    print(
        f"\nbf16 log-prob gap, {args.hf_dir or args.model + ' (random init)'}{norms}, {where}: {len(row_bounds(batch))} step rows, "
        f"{batch.tokens.numel():,} tokens, {n_trained:,} trained; log-probs "
        f"{float(logp['reference fp32'][trained].mean()):.2f} +- {float(logp['reference fp32'][trained].std()):.2f}"
    )
    print(f"  {'':<22}{'compared':<66}{'max':>10}{'p99':>10}{'mean':>10}")
    for r in rows:
        print(f"  {r['section']:<22}{r['compared']:<66}{r['max']:>10.2e}{r['p99']:>10.2e}{r['mean']:>10.2e}")
    return {
        "config": config(args),
        "device": where,
        "rows": len(row_bounds(batch)),
        "tokens": int(batch.tokens.numel()),
        "trained_tokens": n_trained,
        "table": rows,
        "seconds": secs,
    }


if __name__ == "__main__":
    script_main(parse_args, run)
