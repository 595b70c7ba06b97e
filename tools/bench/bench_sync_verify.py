"""What verifying every weight sync costs, beside the sync itself, on CPU.

    python tools/bench/bench_sync_verify.py [--quick] [--repeat 5] [--bucket-mb 64] [--modes disk,distributed]

One training process (TP1, gloo) and a Ray fleet with one embedded engine. For the tiny test
model and a SmolLM2-135M-shaped model (random init of its shapes, no download; skipped with
--quick), and on request (`--models`) a Qwen2.5-0.5B-shaped one, per sync mode, one `WeightSync` pushes `--repeat` pairs of versions after a warm-up
pair, each pair one push with `verify: off` then one with `verify: sampled` (interleaved, so the
machine's load hits both alike), then `--repeat` pushes with `verify: full`. Medians over the
repeats, and the spread (fastest to slowest) of each:
- sync s: the push with `verify: off` (conversion, transfer, the engine loading);
- verify s: `weight_sync/verify_s` of the sampled push (what the push waits for: the trainer's
  helper thread taking 256 values per tensor beside the transfer, the engine taking the same
  ones inside the update request, the trainer comparing them), its share of that push
  (`weight_sync/verify_share`) and that time per tensor (us/tensor);
- sampled / off: the sampled push's seconds over the paired push without a check, minus one
  (the whole cost as the push sees it, answer transfer included; noisier: two pushes' noise);
- full s: `weight_sync/verify_s` with `verify: full` (sha256 of every tensor on both sides).
Tensor mode holds a second copy of the model on rank 0 and in Ray's object store: it is left out
for SmolLM2 by default (`--modes` picks). No asserts: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import bench_parser, free_port

from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.mcore.weights import sync as sync_module
from megatron_stepwise.mcore.weights.sync import WeightSync
from megatron_stepwise.mcore.weights.sync_verify import judge_samples

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
    # Qwen2.5-0.5B's shapes (494M parameters, tied embeddings), random weights: how the share
    # falls as tensors grow (opt-in: ~8 GB of memory).
    "qwen2.5-0.5b": (
        M.tiny_config(
            model_type="qwen2",
            vocab_size=151936,
            hidden_size=896,
            num_layers=24,
            num_heads=14,
            num_kv_heads=2,
            ffn_hidden_size=4864,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        ),
        ("disk", "distributed"),
    ),
}
DEFAULT_MODELS = ("tiny", "smollm2-135m")


def bench_model(name: str, cfg: dict, modes: tuple, repeat: int, bucket_mb: float, workdir: Path) -> list[dict]:
    from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
    from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

    chunks = M.build_model_chunks(cfg, init=lambda c: W.init_deterministic(c, seed=0))
    params = sum(p.numel() for p in chunks[0].parameters())
    loop = asyncio.new_event_loop()
    fleet = RolloutFleet([EngineSpec(kind="local", model_config=cfg, seed=1, num_cpus=1)], ray_num_cpus=2)
    loop.run_until_complete(fleet.wait_ready())
    version = iter(range(1, 10**6))
    rows = []
    try:
        for mode in modes:
            # One syncer per mode (a distributed one keeps its group), its check switched per push.
            syncer = WeightSync(fleet, mode, cfg, loop=loop, bucket_mb=bucket_mb, sync_dir=workdir / f"{name}-sync")

            def push(verify: str) -> dict:
                syncer.verify_mode = verify
                metrics = syncer.push(chunks, next(version))
                if verify == "sampled":
                    metrics.update(PARTS.pop())
                return metrics

            pairs = [(push("off"), push("sampled")) for _ in range(repeat + 1)][1:]  # after a warm-up pair
            fulls = [push("full") for _ in range(repeat)]
            syncer.close()
            rows.append(summarise(name, params, mode, pairs, fulls))
            print_row(rows[-1])
    finally:
        loop.run_until_complete(fleet.shutdown())
        loop.close()
    return rows


PARTS: list = []  # where each sampled push's verify_s went (`_timed_judge`)


def _timed_judge(answers: list, record) -> list:
    """`judge_samples`, noting the parts of verify_s: the trainer's waits for its sampling thread,
    the engine's sampling inside the update (the slowest engine's), the comparison."""
    waited = record.seconds
    start = time.perf_counter()
    judged = judge_samples(answers, record)
    compare = time.perf_counter() - start
    engine = max((a.get("sample_s", 0.0) for a in answers), default=0.0)
    PARTS.append({"trainer_wait_s": waited, "engine_sample_s": engine, "compare_s": compare})
    return judged


def _median_and_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(name: str, params: int, mode: str, pairs: list, fulls: list) -> dict:
    sampled = [s for _, s in pairs]
    return {
        "model": name,
        "params_M": params / 1e6,
        "mode": mode,
        "tensors": sampled[-1]["weight_sync/verified_tensors"],
        "off_s": _median_and_range([off["weight_sync/seconds"] for off, _ in pairs]),
        "sampled_s": _median_and_range([s["weight_sync/seconds"] for s in sampled]),
        "sampled_verify_s": _median_and_range([s["weight_sync/verify_s"] for s in sampled]),
        "sampled_share": _median_and_range([s["weight_sync/verify_share"] for s in sampled]),
        "sampled_over_off": _median_and_range(
            [s["weight_sync/seconds"] / off["weight_sync/seconds"] - 1 for off, s in pairs]
        ),
        **{part: _median_and_range([s[part] for s in sampled]) for part in PARTS_SHOWN},
        "full_verify_s": _median_and_range([f["weight_sync/verify_s"] for f in fulls]),
        "full_share": _median_and_range([f["weight_sync/verify_share"] for f in fulls]),
    }


PARTS_SHOWN = ("trainer_wait_s", "engine_sample_s", "compare_s")

HEADER = (
    f"{'model':<14}{'mode':<13}{'tensors':>8}{'sync s':>8}{'sampled: verify s':>19}{'us/tensor':>10}"
    f"{'share (min-max)':>22}{'sampled/off-1 (min-max)':>28}{'full: verify s':>16}{'share':>8}"
)


def print_row(r: dict) -> None:
    per_tensor = r["sampled_verify_s"]["median"] / max(r["tensors"], 1) * 1e6  # grows with the count
    share, over = r["sampled_share"], r["sampled_over_off"]
    print(
        f"{r['model']:<14}{r['mode']:<13}{r['tensors']:>8.0f}{r['off_s']['median']:>8.3f}"
        f"{r['sampled_verify_s']['median']:>19.4f}{per_tensor:>10.1f}"
        f"{share['median']:>8.2%} ({share['min']:.2%}-{share['max']:.2%})"
        f"{over['median']:>+10.1%} ({over['min']:+.1%} to {over['max']:+.1%})"
        f"{r['full_verify_s']['median']:>16.4f}{r['full_share']['median']:>8.2%}",
        flush=True,
    )
    parts = ", ".join(
        f"{p} {r[p]['median'] * 1e3:.2f} ms ({r[p]['min'] * 1e3:.2f}-{r[p]['max'] * 1e3:.2f})" for p in PARTS_SHOWN
    )
    print(f"{'':<27}sampled verify_s, medians: {parts}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__, "tiny model only, one repeat")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--modes", default=None, help="comma-separated sync modes (default: per model, see above)")
    p.add_argument("--models", default=None, help=f"comma-separated, of {list(MODELS)} (default: {DEFAULT_MODELS})")
    return p.parse_args(argv)


def run(quick: bool = False) -> dict:
    """What a caller (another benchmark or a test) collects: prints the table, returns the figures."""
    return report(parse_args(["--quick"] if quick else []))


def report(args: argparse.Namespace) -> dict:
    repeat = 1 if args.quick else args.repeat
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    names = ["tiny"] if args.quick else (args.models.split(",") if args.models else list(DEFAULT_MODELS))
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known: {list(MODELS)}")
    print(
        f"weight sync verification on CPU, 1 trainer process, 1 embedded engine, bucket {args.bucket_mb} MB, "
        f"median of {repeat} (off and sampled pushes interleaved)",
        flush=True,
    )
    print(HEADER, flush=True)
    runtime.init_distributed(1, 1)
    sync_module.judge_samples = _timed_judge  # notes the parts of each sampled push's verify_s
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                cfg, modes = MODELS[name]
                modes = tuple(args.modes.split(",")) if args.modes else modes
                rows += bench_model(name, cfg, modes, repeat, args.bucket_mb, Path(tmp))
    finally:
        runtime.destroy_distributed()
    figures = {f"verify_share_{r['model']}_{r['mode']}": r["sampled_share"]["median"] for r in rows}
    return {"config": {**vars(args), "repeat": repeat}, "rows": rows, "figures": figures}


if __name__ == "__main__":
    report(parse_args())
