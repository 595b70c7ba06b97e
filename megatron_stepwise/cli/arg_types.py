"""argparse `type=` functions shared by the commands: a bad value is argparse's one-line error."""

from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= `minimum` ("must be >= 1, got 0")."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in "invalid ... value"
    return parse
