"""The errors of checkpoint saving and loading (one line each, naming the file or directory)."""

from __future__ import annotations

from megatron_stepwise.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked (named in the message)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file whose pickle asks for a class a checkpoint never holds (code, not data)."""
