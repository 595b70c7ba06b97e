"""What the benchmark scripts share, so each measures the same way: their command line (`--quick`,
`--seed`, `--out`), `run()`'s keyword overrides, a `main` for scripts with `parse_args()` and
`run()`, the JSON output; timing (warm-up, repeats, median and spread; A and B side by side,
interleaved so machine noise hits both; per-phase wall and CPU); a timed training run of the CLI;
the skip a GPU benchmark reports on a machine without one."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[2]


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


@dataclass
class Timing:
    """Wall seconds of the timed calls (warm-up calls left out) and the last call's return value."""

    seconds: list[float] = field(default_factory=list)
    result: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median: how much the machine moved the figure."""
        return (max(self.seconds) - min(self.seconds)) / self.median if self.median else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "spread": self.spread, "seconds": list(self.seconds)}


def side_by_side(
    calls: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1, sync: Optional[Callable[[], None]] = None
) -> dict[str, Timing]:
    """Each call's Timing over `repeats` rounds after `warmup` untimed rounds; a round runs every
    call once, in turn, so load on a shared machine hits all of them alike. `sync` (e.g.
    `torch.cuda.synchronize`) brackets each timed call so host time is the device's time."""
    timings = {name: Timing() for name in calls}
    for i in range(warmup + repeats):
        for name, fn in calls.items():
            if sync:
                sync()
            start = time.perf_counter()
            timings[name].result = fn()
            if sync:
                sync()
            if i >= warmup:
                timings[name].seconds.append(time.perf_counter() - start)
    return timings


def time_repeats(
    fn: Callable[[], Any], repeats: int, warmup: int = 1, sync: Optional[Callable[[], None]] = None
) -> Timing:
    """`fn`'s Timing over `repeats` calls after `warmup` untimed ones (imports, first allocations,
    a distributed group)."""
    return side_by_side({"fn": fn}, repeats, warmup, sync)["fn"]


def median_time(fn: Callable[[], Any], repeats: int, warmup: bool = True) -> float:
    """Median wall seconds of `repeats` calls of `fn`, after an untimed warm-up call unless `warmup`
    is False."""
    return time_repeats(fn, repeats, warmup=int(warmup)).median


def print_timings(timings: dict[str, Timing], baseline: Optional[str] = None, width: int = 40) -> None:
    """One line per timing (median, spread, count), and each one's speed-up over `baseline`."""
    for name, t in timings.items():
        print(f"{name:{width}s} {t.median:8.2f} s (median of {len(t.seconds)}, spread {t.spread:.0%})")
    if baseline is not None:
        base = timings[baseline].median
        for name, t in timings.items():
            if name != baseline:
                print(f"{'ratio ' + baseline + ' / ' + name:{width}s} {base / t.median:8.1f}x")


def train_run(
    config: Path | str,
    run_dir: Path | str,
    overrides: list[str],
    what: str,
    env: Optional[dict[str, str]] = None,
    echo: Optional[str] = None,
) -> tuple[list[dict[str, Any]], float]:
    """`megatron-stepwise train config` into a fresh `run_dir` (never resuming), timed: its
    metrics.jsonl rows and the wall seconds. `env` adds to this process's environment; `echo`
    prints the command under that label first. A failed run exits naming `what` with its output."""
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "megatron_stepwise.cli",
        "train",
        str(REPO / config),
        *overrides,
        f"logging.run_dir={run_dir}",
        "checkpoint.resume=never",
    ]
    if echo:
        print(f"[{echo}] {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{what} failed with exit code {proc.returncode}")
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()], wall


def cuda_skip(name: str, device: str) -> Optional[dict[str, str]]:
    """{'skipped': reason}, printed, when `device` is cuda and there is no CUDA GPU; else None."""
    import torch

    if device != "cuda" or torch.cuda.is_available():
        return None
    reason = "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    print(f"{name}: skipped: {reason}")
    return {"skipped": reason}


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
