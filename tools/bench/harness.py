"""What the benchmark scripts share: their command line (`--quick`, `--seed`, `--out`), `run()`'s
keyword overrides, a `main` for scripts with `parse_args()` and `run()`, the JSON output, and
per-phase timing."""

from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import time
from typing import Any, Callable, Optional


def bench_parser(doc: Optional[str], quick_help: Optional[str] = None) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the help text, and `--quick`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    return p


def add_seed_and_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")


def run_args(
    parse_args: Callable[[list[str]], argparse.Namespace], quick: bool, options: dict[str, Any]
) -> argparse.Namespace:
    """The CLI's defaults (or `--quick`), with `run(quick, **options)`'s keyword overrides."""
    args = parse_args(["--quick"] if quick else [])
    for key, value in options.items():
        if not hasattr(args, key):
            raise ValueError(f"{parse_args.__module__}.run: unknown option {key!r}")
        setattr(args, key, value)
    return args


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The options a result records (all but --out)."""
    return {k: v for k, v in vars(args).items() if k != "out"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(result: Any, path: Optional[str]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {path}")


def script_main(parse_args: Callable[[], Any], run: Callable[..., Any]) -> None:
    """`python tools/bench/bench_x.py [options] [--out F]`: run() takes the options as keywords."""
    args = parse_args()
    write_json(run(**config(args)), args.out)


def median_time(fn: Callable[[], Any], repeats: int, warmup: bool = True) -> float:
    """Median wall seconds of `repeats` calls of `fn`, after an untimed warm-up call (imports,
    first allocations, a distributed group) unless `warmup` is False."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def repeat_runs(run_once: Callable[[], tuple[dict, dict, Any]], repeats: int) -> tuple[list, list, Any]:
    """`run_once()` -> (wall, cpu, result), 1 + `repeats` times, each after the previous result was
    freed, as a training loop frees the previous iteration's batches: the walls, CPUs, last result."""
    walls, cpus, result = [], [], None
    for _ in range(1 + repeats):
        result = None
        gc.collect()
        wall, cpu, result = run_once()
        walls.append(wall)
        cpus.append(cpu)
    return walls, cpus, result


def warm_median(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median per phase of the warm runs (all but the first, cold one; the cold one if alone)."""
    return {k: statistics.median(r[k] for r in runs[1:] or runs) for k in runs[0]}


class PhaseTimer:
    """Wall-clock and CPU seconds per named phase (CPU time is what one core spent on it, which
    stays meaningful when other processes share the machine)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        self.wall[name] = time.perf_counter() - t
        self.cpu[name] = time.process_time() - c
        return out
