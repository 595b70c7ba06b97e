"""Teacher scoring on the embedded engine: requests batched into padded forwards vs one at a time.

The workload is one OPD iteration of the SmolLM2 calculator recipe: 36 trajectories, each one
scoring request of a ~170-token row (prompt + turns), its lengths drawn between 0.6x and 1.4x
`--tokens`, scored from its first response on. Side by side in one process, alternating, after a
warm-up: `sequential` (each request awaited before the next: one forward per row, what the
engine did before requests were batched) and `batched` (all sent together, as the agent loop's
finished trajectories send them: the engine's `ScoreBatcher` packs the waiting ones into padded
forwards). Reported: scored tokens per second and per CPU second of this process, forwards run,
and the largest difference between the two modes' log-probs.

    python tools/bench/bench_teacher_scoring.py                 # SmolLM2-135M-Instruct
    python tools/bench/bench_teacher_scoring.py --model tiny --quick
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import torch


def _rows(n: int, tokens: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(int(0.6 * tokens), int(1.4 * tokens))
        ids = [rng.randrange(1, vocab - 1) for _ in range(length)]
        rows.append((ids, rng.randint(length // 3, length // 2)))  # a prompt, then the turns scored
    return rows


async def _sequential(engine, rows):
    return [await engine.score(ids, start, 0.6) for ids, start in rows]


async def _batched(engine, rows):
    return await asyncio.gather(*(engine.score(ids, start, 0.6) for ids, start in rows))


def _measure(engine, rows, mode) -> dict:
    before = engine.scores.forwards
    wall, cpu = time.perf_counter(), time.process_time()
    out = asyncio.run((_batched if mode == "batched" else _sequential)(engine, rows))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    scored = sum(len(ids) - start for ids, start in rows)
    return {"out": out, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": scored / wall, "tokens_per_cpu_s": scored / cpu,
            "forwards": engine.scores.forwards - before}  # fmt: skip


def _engine(model: str, tmp: str):
    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine

    if model == "tiny":
        from megatron_stepwise.rollout.engines.embedded.hf_model import tiny_qwen2_config

        return LocalEngine(tiny_qwen2_config(512), eos_token_ids=[], torch_threads=1), "tiny preset (vocab 512)"
    from bench_prefix_cache import smollm2_dir

    path = smollm2_dir(tmp)
    return LocalEngine(path, weights=path, eos_token_ids=[], torch_threads=1), "SmolLM2-135M-Instruct (fp32)"


def run(model: str = "smollm2", quick: bool = False, repeats: int = 3, tokens: int = 170) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        engine, name = _engine(model, tmp)
        rows = _rows(8 if quick else 36, 40 if quick else tokens, int(engine.config.vocab_size))
        _measure(engine, rows[:4], "batched")  # warm-up
        results: dict[str, list[dict]] = {"sequential": [], "batched": []}
        for _ in range(1 if quick else repeats):
            for mode in results:
                results[mode].append(_measure(engine, rows, mode))
    gap = max(
        float((torch.tensor(a) - torch.tensor(b)).abs().max())
        for a, b in zip(results["sequential"][-1]["out"], results["batched"][-1]["out"])
    )
    best = {mode: max(runs, key=lambda r: r["tokens_per_cpu_s"]) for mode, runs in results.items()}
    report = {
        "model": name,
        "rows": len(rows),
        "scored_tokens": sum(len(ids) - start for ids, start in rows),
        "results": {m: {k: v for k, v in r.items() if k != "out"} for m, r in best.items()},
        "max_logprob_gap": gap,
        "speedup_per_cpu_s": best["batched"]["tokens_per_cpu_s"] / best["sequential"]["tokens_per_cpu_s"],
    }
    print(f"teacher scoring, {name}: {report['rows']} rows, {report['scored_tokens']} scored tokens")
    for mode, r in report["results"].items():
        print(
            f"  {mode:>10}: {r['forwards']:>3} forwards, {r['tokens_per_s']:8.0f} tokens/s, {r['tokens_per_cpu_s']:8.0f} tokens/CPU s"
        )
    print(
        f"  batched / sequential, tokens per CPU second: {report['speedup_per_cpu_s']:.2f}x; max log-prob gap {gap:.1e}"
    )
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    p.add_argument("--quick", action="store_true", help="8 short rows, one repeat (tests)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=170, help="mean row length")
    args = p.parse_args()
    torch.set_num_threads(1)
    run(args.model, args.quick, args.repeats, args.tokens)


if __name__ == "__main__":
    main()
