"""Sandboxed tool calls per second against `rollout.env_concurrency` (no asserts; prints figures).

The `math_tool` environment's `step` with one `python` tool call runs the call's code in the
sandbox (a new confined process: namespaces, Landlock, seccomp, limits; docs/security.md). Here
`--calls` such steps go through the agent loop's `EnvCaller` (the environment-call pool with
deadlines) at each concurrency, side by side in one run, with the machine's core count: the
rate should grow with the concurrency until the cores are busy.

    python tools/bench/bench_env_calls.py             # 64 calls at 1, 2, 4, 8, 16
    python tools/bench/bench_env_calls.py --quick     # 16 calls at 1, 2, 4
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness import add_seed_and_out, bench_parser, config, run_args, script_main  # noqa: E402

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(i * i for i in range(20000)))"}}\n</tool_call>'


async def _calls_per_second(n: int, concurrency: int) -> float:
    from megatron_stepwise.envs.math_tool import MathToolEnv
    from megatron_stepwise.rollout.agent.env_calls import EnvCaller

    caller = EnvCaller(concurrency, timeout_s=60.0)
    envs = [MathToolEnv() for _ in range(n)]
    for env in envs:
        env.reset({"prompt_id": "p", "question": "What is 1 + 1?", "answer": "2"})
    start = time.perf_counter()
    outs = await asyncio.gather(*(caller.call(env.step, CALL, name="env.step") for env in envs))
    elapsed = time.perf_counter() - start
    bad = [o for o in outs if "Error" in str(o[0])]
    if bad:
        raise RuntimeError(f"a sandboxed call failed: {bad[0]!r:.300}")
    return n / elapsed


def run(quick: bool = False, **options) -> dict[str, Any]:
    args = run_args(parse_args, quick, options)
    levels = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16]
    asyncio.run(_calls_per_second(2, 2))  # warm-up: imports, the sandbox's first start
    rates = {c: asyncio.run(_calls_per_second(args.calls, c)) for c in levels}
    print(f"math_tool sandboxed python calls, {args.calls} per level, {os.cpu_count()} cores")
    for c, rate in rates.items():
        print(f"  env_concurrency {c:>2}: {rate:6.1f} calls/s  ({rate / rates[1]:.2f}x of 1)")
    return {"config": config(args), "cores": os.cpu_count(), "calls_per_s": {str(c): r for c, r in rates.items()}}


def parse_args(argv: Optional[list[str]] = None):
    p = bench_parser(__doc__, "16 calls, concurrency 1-4")
    p.add_argument("--calls", type=int, default=64)
    add_seed_and_out(p)
    args = p.parse_args(argv)
    if args.quick:
        args.calls = 16
    return args


if __name__ == "__main__":
    script_main(parse_args, run)
