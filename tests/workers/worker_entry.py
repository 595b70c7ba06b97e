"""Entry point of the torchrun workers (tests/workers/*_worker.py)."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

import torch


def run_worker(main: Callable[[], None]) -> None:
    """Run a worker's `main` on one torch thread (several ranks share the CPU). On an error, print
    it and leave at once with code 1: a normal exit would wait forever for the other ranks in a
    collective or in process-group teardown, and torchrun stops them when one rank fails."""
    torch.set_num_threads(1)
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
