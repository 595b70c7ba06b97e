"""The trainer's checkpoints: the model, optimizer and scheduler through megatron-core
dist_checkpointing (atomic, keep-last-K, resumable across layouts; see megatron/checkpoint.py),
plus explicit named stateful parts (the trainer state, the prompt dataset's position, the async
source's pending prompts): anything with `state_dict()` / `load_state_dict(state)`.

Resuming restores RNG states and every part, and the engines then get the restored weights, so
a resumed run repeats an uninterrupted one. Every save records the run's id (`run_id`, kept in
`<run_dir>/run_id`) and run directory, so a run never resumes from another run's checkpoints in a
shared `checkpoint.dir`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

import torch.distributed as dist

from megatron_stepwise.megatron.checkpoint import load_checkpoint, save_checkpoint

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainerState:
    """Where the run is: completed iterations and the weight version the fleet has."""

    iteration: int = 0
    weight_version: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "weight_version": self.weight_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.weight_version = int(state["weight_version"])


RUN_ID_FILE = "run_id"


def run_id(run_dir: str) -> str:
    """This run's id: made on its first start, kept in `<run_dir>/run_id` (rank 0, under the run lock)."""
    path = Path(run_dir) / RUN_ID_FILE
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex[:16]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new + "\n")
    os.replace(tmp, path)
    return new


def config_hash(cfg) -> str:
    """What a resumed run must share with the saved one (not iterations, logging, layout)."""
    d = cfg.to_dict()
    keep = {k: d[k] for k in ("model", "env", "data", "algo")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Checkpointer:
    """Saves and resumes `chunks`, `optimizer`, `scheduler` and the named `parts`.

    `parts` must include "trainer" (a `TrainerState`): its iteration names the checkpoint.
    """

    def __init__(self, cfg, *, chunks: list, optimizer: Any, scheduler: Any, parts: Mapping[str, Stateful]):
        if "trainer" not in parts:
            raise ValueError("Checkpointer parts need a 'trainer' TrainerState")
        self.ckpt = cfg.checkpoint
        self.ckpt_dir = cfg.checkpoint_dir
        self.config_hash = config_hash(cfg)
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.run_id = run_id(cfg.run_dir) if dist.get_rank() == 0 else None  # rank 0 decides and saves
        self.chunks, self.optimizer, self.scheduler = chunks, optimizer, scheduler
        self.parts = dict(parts)

    def resume(self) -> bool:
        """Restore the newest checkpoint (`checkpoint.resume`: auto | never | a path); collective."""
        mode = self.ckpt.resume
        if mode == "never":
            return False
        state = load_checkpoint(
            self.chunks, self.optimizer, self.scheduler,
            ckpt_dir=self.ckpt_dir if mode == "auto" else None,
            path=None if mode == "auto" else mode,
            config_hash=self.config_hash,
            load_optimizer=self.ckpt.load_optimizer,
            accept_unverified=self.ckpt.accept_unverified,
            run_id=self.run_id,
        )
        if state is None:
            return False
        saved = state["parts"] if "parts" in state else _flat_format_parts(state)
        for name, part in self.parts.items():
            part.load_state_dict(saved.get(name) or {})
        trainer = self.parts["trainer"]
        if dist.get_rank() == 0:
            log.info("resumed from iteration %d (weight version %d)", trainer.iteration, trainer.weight_version)
        return True

    def save(self) -> Optional[Path]:
        """Collective over all ranks; rank 0's parts are the ones saved."""
        state = {
            "iteration": self.parts["trainer"].iteration,
            "config_hash": self.config_hash,
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "parts": {name: part.state_dict() for name, part in self.parts.items()},
        }
        return save_checkpoint(self.chunks, self.optimizer, self.scheduler, state, self.ckpt_dir, self.ckpt.keep_last)


def _flat_format_parts(state: dict[str, Any]) -> dict[str, Any]:
    """Checkpoints written before parts were named kept them flat; read them the same way."""
    return {
        "trainer": {"iteration": state["iteration"], "weight_version": state["weight_version"]},
        "dataset": state.get("dataset"),
        "rollouts": {"pending": state.get("async_pending") or []},
    }
