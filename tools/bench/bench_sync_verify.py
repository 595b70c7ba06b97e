"""What verifying every weight sync costs, beside the sync itself, on CPU.

    python tools/bench/bench_sync_verify.py [--quick] [--repeat 3] [--bucket-mb 64] [--modes disk,distributed]

One training process (TP1, gloo) and a Ray fleet with one embedded engine. For the tiny test
model and a SmolLM2-135M-shaped model (random init of its shapes, no download; skipped with
--quick), per sync mode, the median over `--repeat` pushes of:
- sync s: `WeightSync.push` with `verify: off` (conversion, transfer, the engine loading);
- verify s: `weight_sync/verify_s` of a push with `verify: sampled` (what the push waits for:
  the trainer's helper thread taking 256 values per tensor beside the transfer, then the round
  trip in which the engine takes and compares the same ones), and its share of that push
  (`weight_sync/verify_share`), and that time per tensor (us/tensor);
- full s: the same with `verify: full` (sha256 of every tensor on both sides).
Tensor mode holds a second copy of the model on rank 0 and in Ray's object store: it is left out
for SmolLM2 by default (`--modes` picks). No asserts: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

import torch
from harness import bench_parser, free_port

from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.mcore.weights.sync import WeightSync

MODELS = {
    "tiny": (M.tiny_config(), ("disk", "tensor", "distributed")),
    # SmolLM2-135M-Instruct's shapes (134.5M parameters, tied embeddings), random weights.
    "smollm2-135m": (
        M.tiny_config(
            model_type="llama",
            vocab_size=49152,
            hidden_size=576,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            ffn_hidden_size=1536,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        ),
        ("disk", "distributed"),
    ),
}


def bench_model(name: str, cfg: dict, modes: tuple, repeat: int, bucket_mb: float, workdir: Path) -> list[dict]:
    from megatron_stepwise.rollout.fleet import EngineSpec, RolloutFleet

    chunks = M.build_model_chunks(cfg, init=lambda c: W.init_deterministic(c, seed=0))
    params = sum(p.numel() for p in chunks[0].parameters())
    loop = asyncio.new_event_loop()
    fleet = RolloutFleet([EngineSpec(kind="local", model_config=cfg, seed=1, num_cpus=1)], ray_num_cpus=2)
    loop.run_until_complete(fleet.wait_ready())
    version = iter(range(1, 10**6))
    rows = []
    try:
        for mode in modes:
            row = {"model": name, "params_M": params / 1e6, "mode": mode}
            for verify in ("off", "sampled", "full"):
                syncer = WeightSync(
                    fleet, mode, cfg, loop=loop, bucket_mb=bucket_mb, sync_dir=workdir / f"{name}-sync", verify=verify
                )
                pushes = [syncer.push(chunks, next(version)) for _ in range(repeat + 1)][1:]  # after a warm-up
                syncer.close()
                row[f"{verify}_s"] = statistics.median(m["weight_sync/seconds"] for m in pushes)
                if verify != "off":
                    row[f"{verify}_verify_s"] = statistics.median(m["weight_sync/verify_s"] for m in pushes)
                    row[f"{verify}_share"] = statistics.median(m["weight_sync/verify_share"] for m in pushes)
                    row["tensors"] = pushes[-1]["weight_sync/verified_tensors"]
            rows.append(row)
            print_row(row)
    finally:
        loop.run_until_complete(fleet.shutdown())
        loop.close()
    return rows


HEADER = (
    f"{'model':<14}{'mode':<13}{'tensors':>8}{'sync s':>9}{'sampled: verify s':>19}{'us/tensor':>10}{'share':>8}"
    f"{'full: verify s':>16}{'share':>8}"
)


def print_row(r: dict) -> None:
    per_tensor = r["sampled_verify_s"] / max(r["tensors"], 1) * 1e6  # the check's cost grows with the count
    print(
        f"{r['model']:<14}{r['mode']:<13}{r['tensors']:>8.0f}{r['off_s']:>9.3f}{r['sampled_verify_s']:>19.4f}"
        f"{per_tensor:>10.1f}{r['sampled_share']:>8.2%}{r['full_verify_s']:>16.4f}{r['full_share']:>8.2%}",
        flush=True,
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__, "tiny model only, one repeat")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--modes", default=None, help="comma-separated sync modes (default: per model, see above)")
    p.add_argument("--models", default=None, help=f"comma-separated, of {list(MODELS)} (default: all)")
    return p.parse_args(argv)


def run(quick: bool = False) -> dict:
    """What a caller (another benchmark or a test) collects: prints the table, returns the figures."""
    return report(parse_args(["--quick"] if quick else []))


def report(args: argparse.Namespace) -> dict:
    repeat = 1 if args.quick else args.repeat
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    names = ["tiny"] if args.quick else (args.models.split(",") if args.models else list(MODELS))
    print(
        f"weight sync verification on CPU, 1 trainer process, 1 embedded engine, bucket {args.bucket_mb} MB, "
        f"median of {repeat}",
        flush=True,
    )
    print(HEADER, flush=True)
    runtime.init_distributed(1, 1)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                cfg, modes = MODELS[name]
                modes = tuple(args.modes.split(",")) if args.modes else modes
                rows += bench_model(name, cfg, modes, repeat, args.bucket_mb, Path(tmp))
    finally:
        runtime.destroy_distributed()
    figures = {f"verify_share_{r['model']}_{r['mode']}": r["sampled_share"] for r in rows}
    return {"config": {**vars(args), "repeat": repeat}, "rows": rows, "figures": figures}


if __name__ == "__main__":
    report(parse_args())
