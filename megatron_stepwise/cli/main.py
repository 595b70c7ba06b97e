"""`megatron-stepwise` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from megatron_stepwise.errors import UserError

# name -> (where its `register(subparsers)` is, its one-line help). Only the command being run
# is imported, so `megatron-stepwise --help` lists them all without importing torch.
COMMANDS = {
    "train": ("megatron_stepwise.cli.train:register", "run an RL experiment (self-launches torchrun when needed)"),
    "eval": ("megatron_stepwise.cli.eval:register", "evaluate a checkpoint or an HF directory on the eval sets"),
    "rollout": ("megatron_stepwise.cli.rollout:register", "print a few trajectories turn by turn (no training)"),
    "validate": (
        "megatron_stepwise.cli.config:register_validate",
        "check an experiment config without running anything",
    ),
    "config": (
        "megatron_stepwise.cli.config:register_config",
        "config key reference, metrics reference and resolved configs",
    ),
    "demo": ("megatron_stepwise.cli.demo:register", "run the step-wise batch pipeline on a synthetic agent batch"),
    "plot": ("megatron_stepwise.cli.plot:register", "render reward, eval, length and timing curves of a run to PNG"),
    "serve": ("megatron_stepwise.cli.serve:register", "serve the embedded CPU engine over SGLang's HTTP API"),
    "bench": ("megatron_stepwise.cli.bench:register", "run the benchmark suite (tools/bench/suite.py)"),
    "replay": (
        "megatron_stepwise.cli.replay:register",
        "re-run a dumped iteration's optimizer steps from its checkpoint, at any layout",
    ),
    "view": ("megatron_stepwise.cli.view:register", "write an HTML page of a dumped iteration's trajectories"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="megatron-stepwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (target, help_text) in COMMANDS.items():
        if name == command:
            _load(target)(sub)
        else:  # listed with its help; its module is imported only when it runs
            sub.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    import_from_launch_dir()
    try:
        return int(args.func(args) or 0)
    except UserError as e:  # bad input, whichever command met it: what was wrong, no traceback
        return end_with_user_error(e)
    except KeyboardInterrupt:  # Ctrl-C outside a training rank (which names its checkpoint itself)
        print(f"interrupted: megatron-stepwise {args.command} stopped", file=sys.stderr)
        return 130


def import_from_launch_dir() -> None:
    """Modules a config names (`env.agent`, `env.name`, `env.reward_fn`, `trainer.imports`) import
    from the directory the command runs in, as relative file paths resolve there and as with
    `python -m`: on sys.path here, and on PYTHONPATH for the processes this one starts (torchrun's
    ranks, Ray's engines and agent workers). Last, so installed packages keep their precedence."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([*parts, here])


EXIT_USER_ERROR = 2


def end_with_user_error(error: UserError) -> int:
    """Write the line a command ends with on bad input, the message with the rank under torchrun,
    in one write (the ranks share stderr); return the exit code."""
    rank = os.environ.get("RANK", "0")
    line = f"error: {error}" if rank == "0" else f"error (rank {rank}): {error}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return EXIT_USER_ERROR


def _load(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


if __name__ == "__main__":
    sys.exit(main())
