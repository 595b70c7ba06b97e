"""How long `megatron-stepwise --help` takes: this tree against another checkout, side by side.

    python tools/bench/bench_help.py [--baseline PATH_TO_OTHER_CHECKOUT] [--repeats 5]

Runs `python -m megatron_stepwise.cli --help` with each tree first on PYTHONPATH, alternating
(so machine load hits both alike), and prints the median wall times, their spread and their ratio; without
--baseline it compares against `python -c "import torch"` (what the lazy imports avoid).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from harness import REPO, print_timings, side_by_side

ROOT = str(REPO)


def run_in(cmd: list[str], tree: str):
    """A call that runs `cmd` with `tree` first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=tree)
    return lambda: subprocess.run(
        cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


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
    ours = "--help of this tree"
    timings = side_by_side({ours: run_in(help_cmd, ROOT), other[2]: run_in(other[0], other[1])}, args.repeats, warmup=0)
    print_timings(timings, baseline=other[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
