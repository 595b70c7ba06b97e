"""`megatron-stepwise` commands: `main` parses, each module registers one command."""

from megatron_stepwise.cli.main import main

__all__ = ["main"]
