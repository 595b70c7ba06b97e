"""Every path of a run directory, spelled once (the layout table: docs/runs.md).

`RunDir(root)` has one property or method per artifact a run (or a command reading it) writes;
the code that writes or reads one asks it for the path instead of joining names of its own.
`checkpoints` and `weights` may live elsewhere (`checkpoint.dir`, `weight_sync.dir`): the config
passes them in (`ExperimentConfig.rundir`). Per-iteration artifacts (checkpoints, dumps, pages,
replay reports) are named `iteration_name(k)`: `iter_` and the iteration in at least 7 digits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# names under the root (the layout table of docs/runs.md lists each)
CONFIG = "config.yaml"
RUN_RECORD = "run.json"
LOG = "train.log"
LOCK = "trainer.lock"
RUN_ID = "run_id"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
WANDB = "wandb"  # W&B makes it itself, given the root
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
WEIGHTS = "weights"
HF_EXPORT = "hf"
EVAL = "eval"
DUMPS = "rollouts"
BANK = "rollout_bank"
VIEWS = "view"
REPLAYS = "replay"

_ITERATION = re.compile(r"^iter_(\d{7,})$")


def iteration_name(iteration: int) -> str:
    """`iter_0000042`: the name of iteration 42's checkpoint, dump, page and replay report."""
    return f"iter_{int(iteration):07d}"


def parse_iteration(name: str) -> Optional[int]:
    """The iteration an `iteration_name` (without its suffix) stands for; None for any other name."""
    m = _ITERATION.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunDir:
    """A run directory's paths; nothing is created or read by building one."""

    root: Path  # a str or os.PathLike is taken too (made a Path)
    checkpoint_dir: Optional[Path] = None  # checkpoint.dir when it is set
    weight_sync_dir: Optional[Path] = None  # weight_sync.dir when it is set

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        for name in ("checkpoint_dir", "weight_sync_dir"):  # unset (None or ""): under the root
            value = getattr(self, name)
            object.__setattr__(self, name, Path(value) if value else None)

    # --- what the run is: written by rank 0 at each start (rundir/record.py, rundir/lifecycle.py)
    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def run_record(self) -> Path:
        return self.root / RUN_RECORD

    @property
    def log(self) -> Path:
        return self.root / LOG

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def run_id(self) -> Path:
        return self.root / RUN_ID

    # --- how it went: metrics and loggers (metrics/core.py), curves (`plot`), evaluations (`eval`)
    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def wandb(self) -> Path:
        return self.root / WANDB

    @property
    def curves(self) -> Path:
        return self.root / CURVES

    @property
    def evals(self) -> Path:
        return self.root / EVAL

    def eval_result(self, name: str) -> Path:
        """An evaluation's JSON: `final` (end of training) or the evaluated policy's name."""
        return self.evals / f"{name}.json"

    def eval_export(self, iteration: int) -> Path:
        """The HF directory `eval --checkpoint` converts a checkpoint to."""
        return self.evals / f"{iteration_name(iteration)}_hf"

    # --- weights: checkpoints, the weight-sync directory, the final HF export
    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir or self.root / CHECKPOINTS

    def checkpoint(self, iteration: int) -> Path:
        return self.checkpoints / iteration_name(iteration)

    @property
    def weights(self) -> Path:
        return self.weight_sync_dir or self.root / WEIGHTS

    @property
    def hf_export(self) -> Path:
        return self.root / HF_EXPORT

    # --- rollouts: the async bank, the dumps and what `view` and `replay` make of them
    @property
    def rollout_bank(self) -> Path:
        return self.root / BANK

    @property
    def dumps(self) -> Path:
        return self.root / DUMPS

    def dump(self, iteration: int) -> Path:
        return self.dumps / f"{iteration_name(iteration)}.parquet"

    def dumped_iterations(self) -> list[int]:
        found = (parse_iteration(p.stem) for p in self.dumps.glob("iter_*.parquet"))
        return sorted(k for k in found if k is not None)

    @property
    def views(self) -> Path:
        return self.root / VIEWS

    def view(self, iteration: int) -> Path:
        return self.views / f"{iteration_name(iteration)}.html"

    @staticmethod
    def view_pages(page: Path) -> Path:
        """The folder of a paged view's numbered pages, beside its index `page` (any path)."""
        return page.with_name(page.stem + "_pages")

    @property
    def replays(self) -> Path:
        return self.root / REPLAYS

    def replay_report(self, iteration: int) -> Path:
        return self.replays / f"{iteration_name(iteration)}.json"
