"""The trainer's checkpoints: the model, optimizer and scheduler through megatron-core
dist_checkpointing (atomic, keep-last-K, resumable across layouts; see mcore/weights/dist_checkpoint.py),
plus explicit named stateful parts (the trainer state, the prompt dataset's position, the async
source's pending prompts): anything with `state_dict()` / `load_state_dict(state)`, and optionally
`after_save()`, called once the checkpoint is complete.

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
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol

import torch.distributed as dist

from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError
from megatron_stepwise.mcore.weights.dist_checkpoint import load_checkpoint, save_checkpoint
from megatron_stepwise.rundir import paths
from megatron_stepwise.rundir.record import config_diff

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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


def run_id(run_dir: str) -> str:
    """This run's id: made on its first start, kept in `<run_dir>/run_id` (rank 0, under the run lock)."""
    path = paths.RunDir(run_dir).run_id
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


# What a resumed run must share with the saved one: the model, the task and its data, the
# algorithm. Everything else (optim, rollout, trainer.iterations, logging, checkpoint, parallel,
# launch, eval, ...) may change on a resume; the changes are logged (docs/runs.md).
HASHED_SECTIONS = ("model", "env", "data", "algo")


def config_hash(cfg) -> str:
    """Hash of the HASHED_SECTIONS of the resolved config."""
    d = cfg.to_dict()
    keep = {k: d[k] for k in HASHED_SECTIONS}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _override(key: str, value: object) -> str:
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def check_same_config(saved_state: dict[str, Any], cfg, current_hash: str, where: str) -> list[str]:
    """Raise CheckpointError naming the differing keys and the two remedies when the checkpoint
    was saved with other HASHED_SECTIONS; else the other keys that changed ("key: old -> new")."""
    saved = saved_state.get("config")
    diff = config_diff(saved, cfg.to_dict()) if isinstance(saved, dict) else []
    fixed = [d for d in diff if d[0].split(".")[0] in HASHED_SECTIONS]
    free = [f"{k}: {a!r} -> {b!r}" for k, a, b in diff if k.split(".")[0] not in HASHED_SECTIONS]
    if saved_state.get("config_hash") in (None, current_hash):
        return free
    if fixed:
        keys = "\n".join(f"  {k}: {a!r} in the checkpoint, {b!r} now" for k, a, b in fixed)
        restore = " ".join(_override(k, a) for k, a, _ in fixed)
    else:  # a checkpoint from before configs were saved in it
        keys = "  (this checkpoint does not record its config: compare with the run's config.yaml / run.json)"
        restore = "<the saved values>"
    raise CheckpointError(
        f"checkpoint {where} was saved with another config: a resume must keep {', '.join(HASHED_SECTIONS)} "
        f"unchanged (config_hash {saved_state.get('config_hash')} saved, {current_hash} now), and these differ:\n"
        f"{keys}\n"
        + (f"(also changed, which a resume may change: {'; '.join(free)})\n" if free else "")
        + f"Either resume with the saved values ({restore}), or start a new run: checkpoint.resume=never "
        "(here, replacing this run's checkpoints) or another logging.run_dir"
    )


class Checkpointer:
    """Saves and resumes `chunks`, `optimizer`, `scheduler` and the named `parts`.

    `parts` must include "trainer" (a `TrainerState`): its iteration names the checkpoint.
    """

    def __init__(
        self,
        cfg,
        *,
        chunks: list,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        parts: Mapping[str, Stateful],
    ):
        if "trainer" not in parts:
            raise ValueError("Checkpointer parts need a 'trainer' TrainerState")
        self.ckpt = cfg.checkpoint
        self.ckpt_dir = cfg.checkpoint_dir
        self.cfg = cfg
        self.config_hash = config_hash(cfg)
        self.run_dir = os.path.abspath(cfg.run_dir)
        # rank 0 makes the id; every rank holds it, so the checkpoint's common state agrees across ranks
        shared = [run_id(cfg.run_dir) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        self.run_id = shared[0]
        self.chunks, self.optimizer, self.scheduler = chunks, optimizer, scheduler
        self.parts = dict(parts)

    def resume(self) -> bool:
        """Restore the newest checkpoint (`checkpoint.resume`: auto | never | a path); collective."""
        mode = self.ckpt.resume
        if mode == "never":
            return False
        state = load_checkpoint(
            self.chunks,
            self.optimizer,
            self.scheduler,
            ckpt_dir=self.ckpt_dir if mode == "auto" else None,
            path=None if mode == "auto" else mode,
            load_optimizer=self.ckpt.load_optimizer,
            accept_unverified=self.ckpt.accept_unverified,
            run_id=self.run_id,
        )
        if state is None:
            return False
        changed = check_same_config(state, self.cfg, self.config_hash, self.ckpt_dir if mode == "auto" else mode)
        if changed and dist.get_rank() == 0:
            log.info("resuming with changed settings (a resume may change these): %s", "; ".join(changed))
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
            "config": self.cfg.to_dict(),  # a resume with another config names the keys that differ
            "parts": {name: part.state_dict() for name, part in self.parts.items()},
        }
        path = save_checkpoint(self.chunks, self.optimizer, self.scheduler, state, self.ckpt_dir, self.ckpt.keep_last)
        for part in self.parts.values():  # e.g. the rollout bank prunes what this checkpoint covers
            after_save = getattr(part, "after_save", None)
            if after_save is not None:
                after_save()
        return path


def _flat_format_parts(state: dict[str, Any]) -> dict[str, Any]:
    """Checkpoints written before parts were named kept them flat; read them the same way."""
    return {
        "trainer": {"iteration": state["iteration"], "weight_version": state["weight_version"]},
        "dataset": state.get("dataset"),
        "rollouts": {"pending": state.get("async_pending") or []},
    }
