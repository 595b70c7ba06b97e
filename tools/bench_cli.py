"""What the benchmark scripts share: a `main` for scripts with `parse_args()` and `run()`, the
JSON output, and per-phase timing."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional


def write_json(result: Any, path: Optional[str]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {path}")


def script_main(parse_args: Callable[[], Any], run: Callable[..., Any]) -> None:
    """`python tools/bench_x.py [options] [--out F]`: run() takes the options as keywords."""
    args = parse_args()
    result = run(**{k: v for k, v in vars(args).items() if k not in ("quick", "out")}, quick=args.quick)
    write_json(result, args.out)


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
