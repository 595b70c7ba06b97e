"""The error of a model source that cannot be used (hub.py, gguf.py); its message names the config key."""


class ModelSourceError(ValueError):
    """A model config, tokenizer or checkpoint that cannot be found; the message names the config key."""
