"""`megatron-stepwise view RUN_DIR [--iteration K]`: one self-contained HTML page of a dumped iteration.

Writes `RUN_DIR/view/iter_K.html` (or `--out`): the iteration's trajectories with filters, each
turn's prompt delta and response with tokens coloured by role, advantage and log-prob gap on
hover, and the run's curves (viewer/). It opens from disk; nothing is served or fetched.
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("view", help="write an HTML page of a dumped iteration's trajectories")
    p.add_argument("run_dir", help="the run directory (holds rollouts/ and metrics.jsonl)")
    p.add_argument("--iteration", type=int, default=None, help="the dumped iteration (default: the last one)")
    p.add_argument("--out", default=None, help="HTML path (default RUN_DIR/view/iter_K.html)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from megatron_stepwise.loop.dumps import DumpError
    from megatron_stepwise.viewer.page import write_page

    try:
        path = write_page(args.run_dir, args.iteration, args.out)
    except DumpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
