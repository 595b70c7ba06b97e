"""`megatron-stepwise bench`: the benchmark suite of a source checkout (`tools/bench/suite.py`).

The suite and its benchmarks live in `tools/bench/` next to the package (they are not installed with
it); this subcommand runs them with the same options as `python tools/bench/suite.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

SUITE = Path(__file__).resolve().parents[2] / "tools" / "bench" / "suite.py"


def _load_suite():
    name = "megatron_stepwise_bench_suite"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SUITE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    return sys.modules[name]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmark suite (tools/bench/suite.py): tables, JSON and a markdown summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if SUITE.exists():
        _load_suite().add_arguments(p)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if not SUITE.exists():
        print(
            f"error: the benchmark suite is not here ({SUITE}): `megatron-stepwise bench` needs a source "
            "checkout of megatron-stepwise (the benchmarks live in its tools/bench/ directory)",
            file=sys.stderr,
        )
        return 2
    suite = _load_suite()
    suite.run_suite(args)
    return 0
