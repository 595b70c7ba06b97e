"""`UserError`: the base of every error that means "fix your input", not "the program failed";
`RunFailure`: what the machines gave out on (named), where a rerun of the same command resumes.

A config key, a dataset, a checkpoint or dump that is refused, a model source, a layout the plugin
cannot train, a busy run directory: the message names what was wrong and how to fix it. The
command line ends any of them with that one line and exit code 2 (cli/main.py); anything else is
a failure of the program and keeps its traceback. Each subclass keeps its historical base too
(`ValueError`, `RuntimeError`, ...), so `except ValueError` around it still works.

A `RunFailure` (workers that keep dying, a lost node) ends `train` with its one line and exit
code 1: no traceback, since the message says all a traceback would.

The ground floor: this module imports nothing of the package.
"""


class UserError(Exception):
    """Bad input (config, data, checkpoint, dump, model source, command-line value): the message
    names it and the fix."""


class RunFailure(RuntimeError):
    """The run's machinery gave out (an agent worker that keeps dying): the message names what;
    the last checkpoint stands and the same command resumes from it."""
