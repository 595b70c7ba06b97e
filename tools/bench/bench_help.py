"""How long `megatron-stepwise --help` takes: this tree against another checkout, side by side.

    python tools/bench/bench_help.py [--baseline PATH_TO_OTHER_CHECKOUT] [--repeats 5]

Runs `python -m megatron_stepwise.cli --help` with each tree first on PYTHONPATH, alternating
(so machine load hits both alike), and prints the median wall times and their ratio; without
--baseline it compares against `python -c "import torch"` (what the lazy imports avoid).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wall(cmd: list[str], tree: str) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", help="another checkout of this repository (e.g. a git worktree of the old commit)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    help_cmd = [sys.executable, "-m", "megatron_stepwise.cli", "--help"]
    other = (
        (help_cmd, args.baseline, f"--help of {args.baseline}")
        if args.baseline
        else ([sys.executable, "-c", "import torch"], ROOT, "import torch")
    )
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(wall(help_cmd, ROOT))
        theirs.append(wall(other[0], other[1]))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{'--help of this tree':40s} {a:8.2f} s (median of {args.repeats})")
    print(f"{other[2]:40s} {b:8.2f} s")
    print(f"{'ratio':40s} {b / a:8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
