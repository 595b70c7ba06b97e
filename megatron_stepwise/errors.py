"""`UserError`: the base of every error that means "fix your input", not "the program failed".

A config key, a dataset, a checkpoint or dump that is refused, a model source, a layout the plugin
cannot train, a busy run directory: the message names what was wrong and how to fix it. The
command line ends any of them with that one line and exit code 2 (cli/main.py); anything else is
a failure of the program and keeps its traceback. Each subclass keeps its historical base too
(`ValueError`, `RuntimeError`, ...), so `except ValueError` around it still works.

The ground floor: this module imports nothing of the package.
"""


class UserError(Exception):
    """Bad input (config, data, checkpoint, dump, model source, command-line value): the message
    names it and the fix."""
