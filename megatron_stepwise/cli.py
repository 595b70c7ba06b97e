"""`megatron-stepwise` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-stepwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _subcommands():
        register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _subcommands():
    """Each subcommand lives next to what it runs and registers its own parser."""
    from megatron_stepwise import bench_cmd, demo, eval_cmd, plot, rollout_cmd, train_cmd
    from megatron_stepwise.config import commands as config_commands
    from megatron_stepwise.rollout import server

    return [
        train_cmd.register,
        demo.register,
        plot.register,
        config_commands.register_validate,
        config_commands.register_config,
        server.register,
        bench_cmd.register,
        eval_cmd.register,
        rollout_cmd.register,
    ]


if __name__ == "__main__":
    sys.exit(main())
