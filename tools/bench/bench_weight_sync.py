"""Throughput of Megatron -> HF weight conversion and of each weight-sync transport, on CPU.

    python tools/bench/bench_weight_sync.py [--quick] [--repeat 3] [--bucket-mb 64]
                                            [--models qwen2.5-0.5b qwen2.5-1.5b] [--out F]

One training process (TP1, gloo) and a Ray fleet with one embedded engine. For the tiny test
model and a ~100M-parameter Qwen2-shaped model (skipped with --quick), prints the median over
`--repeat` runs of:
- convert: gather + Megatron -> HF conversion of every bucket, nothing sent;
- export: `export_hf` to a local directory (conversion + safetensors write);
- disk / tensor / distributed: a full `WeightSync.push` (conversion + transfer + the engine
  loading the weights), i.e. what a training step pays.
MB/s counts the HF bytes (fp32). Each measurement follows one untimed warm-up run. No asserts:
numbers depend on the machine (and on what else runs on it). `--models` also takes the Qwen2.5
shapes of flops.py (random weights): what `tools/gpu_check.sh` pushes, from a trainer on the GPU
(the process group is NCCL there) to an embedded engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import torch
from flops import QWEN2_CONFIGS
from harness import add_seed_and_out, bench_parser, free_port, median_time, write_json

from megatron_stepwise.hf.arch import model_spec
from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.weights import convert
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.mcore.weights.sync import WeightSync

MODELS = {
    "tiny": M.tiny_config(),
    # ~100M parameters: 2 x 24.6M embeddings + 8 layers x 6.3M.
    "qwen2-100m": M.tiny_config(
        vocab_size=32000, hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, ffn_hidden_size=2048
    ),
    **QWEN2_CONFIGS,
}
DEFAULT_MODELS = ["tiny", "qwen2-100m"]


def bench_model(name: str, cfg: dict, repeat: int, bucket_mb: float, workdir: Path) -> dict:
    from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

    model = model_spec(cfg)  # parsed once for the whole benchmark
    chunks = M.model_chunks_from_arch(model.arch, init=lambda c: W.init_deterministic(c, seed=0))
    n_params = sum(p.numel() for p in chunks[0].parameters())
    nbytes = sum(t.numel() * t.element_size() for b in convert.stream_hf_buckets(chunks, model.arch) for _, t in b)

    row = {"model": name, "params_M": n_params / 1e6, "MB": nbytes / 2**20}
    row["convert"] = median_time(
        lambda: [None for _ in convert.stream_hf_buckets(chunks, model.arch, bucket_mb=bucket_mb)], repeat
    )
    counter = iter(range(10**6))
    row["export"] = median_time(
        lambda: convert.export_model(chunks, workdir / f"{name}-export-{next(counter)}", model, bucket_mb=bucket_mb),
        repeat,
    )

    loop = asyncio.new_event_loop()
    fleet = RolloutFleet([EngineSpec(kind="local", model_config=cfg, seed=1, num_cpus=1)], ray_num_cpus=2)
    loop.run_until_complete(fleet.wait_ready())
    version = iter(range(1, 10**6))
    try:
        for mode in ("disk", "tensor", "distributed"):
            syncer = WeightSync(fleet, mode, cfg, loop=loop, bucket_mb=bucket_mb, sync_dir=workdir / f"{name}-sync")
            row[mode] = median_time(lambda: syncer.push(chunks, next(version)), repeat)
            syncer.close()
    finally:
        loop.run_until_complete(fleet.shutdown())
        loop.close()
    return row


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__, "tiny model only, one repeat")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=DEFAULT_MODELS)
    add_seed_and_out(p)
    return p.parse_args(argv)


def run(quick: bool = False) -> dict:
    """What `tools/bench/suite.py` collects: prints the table, returns the figures."""
    return report(parse_args(["--quick"] if quick else []))


def report(args: argparse.Namespace) -> dict:
    repeat = 1 if args.quick else args.repeat
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    runtime.init_distributed(1, 1)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in ["tiny"] if args.quick else args.models:
                rows.append(bench_model(name, MODELS[name], repeat, args.bucket_mb, Path(tmp)))
    finally:
        runtime.destroy_distributed()

    phases = ["convert", "export", "disk", "tensor", "distributed"]
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"\nweight sync, trainer on {where}, 1 process, 1 embedded engine, bucket {args.bucket_mb} MB, median of {repeat}"
    )
    print(f"{'model':<12}{'params':>9}{'MB':>8}" + "".join(f"{ph + ' s':>15}{'MB/s':>8}" for ph in phases))
    for r in rows:
        cells = "".join(f"{r[ph]:>15.3f}{r['MB'] / r[ph]:>8.1f}" for ph in phases)
        print(f"{r['model']:<12}{r['params_M']:>8.1f}M{r['MB']:>8.1f}{cells}")
    print(
        "ratios to convert (time):",
        "; ".join(
            f"{r['model']}: " + ", ".join(f"{ph} {r[ph] / r['convert']:.1f}x" for ph in phases[1:]) for r in rows
        ),
    )
    figures = {f"{ph}_MB_per_s_{r['model']}": r["MB"] / r[ph] for r in rows for ph in phases}
    result = {"config": {**vars(args), "repeat": repeat}, "rows": rows, "figures": figures}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    report(parse_args())
