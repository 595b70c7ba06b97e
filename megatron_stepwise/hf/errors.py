"""The error of a model source that cannot be used (hub.py, gguf.py); its message names the config key."""

from megatron_stepwise.errors import UserError


class ModelSourceError(UserError, ValueError):
    """A model config, tokenizer or checkpoint that cannot be found; the message names the config key."""
