"""Checkpoint and resume with megatron-core `dist_checkpointing` (torch_dist format).

A checkpoint `CKPT_DIR/iter_0000042/` holds the model chunks, the optimizer, the LR scheduler,
the caller's trainer state and every rank's RNG states. Saves are atomic (`.tmp` directory,
barrier, rename, `latest` pointer) and verified (a `manifest.json` of sizes and hashes checked
before loading; a damaged latest falls back to the previous good one; a save that fails, e.g. on
a full disk, removes its partial files and leaves `latest` where it was). A resume refuses a
checkpoint written by another run. Loading never runs code from a checkpoint: its pickles are read
as data (safe_dist_load.py; docs/weights.md, 'What a checkpoint from elsewhere can and cannot do').

This module saves and loads, collectively; the directory's files (names, `latest`, manifest,
publish, prune) are checkpoint_dir.py's, which checkpoint a resume loads is checkpoint_choice.py's,
and what is saved of the model, optimizer and RNG is sharded_state.py's. What each part holds and
when it reloads into another layout: docs/weights.md, 'Checkpoints'.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_stepwise.mcore.runtime.runtime import current_layout
from megatron_stepwise.mcore.weights.checkpoint_choice import resume_decision
from megatron_stepwise.mcore.weights.checkpoint_dir import (
    TRAINER_STATE,
    PathLike,
    check_keep_last,
    checkpoint_iteration,
    checkpoint_name,
    find_latest,
    prune,
    publish,
    write_manifest,
)
from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError, UnsafeCheckpointError
from megatron_stepwise.mcore.weights.fileops import make_staging_dir, raise_together
from megatron_stepwise.mcore.weights.sharded_state import (
    build_sharded_state_dict,
    distributed_optimizers,
    in_process_results_queue,
    materialize_optimizer_state,
    model_key,
    restore_adam_steps,
    save_strategy,
    set_rng_state,
    sharded_metadata,
)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- save / load


def save_checkpoint(
    chunks: list, optimizer: Any, scheduler: Any, trainer_state: dict, ckpt_dir: PathLike, keep_last: int
) -> Path:
    """Save everything needed to resume; collective over all ranks; returns the checkpoint path.

    trainer_state: JSON-serialisable dict with at least an int `iteration` (it names the
    checkpoint). optimizer / scheduler may be None.
    """
    from megatron.core import dist_checkpointing

    if "iteration" not in trainer_state or not isinstance(trainer_state["iteration"], int):
        raise CheckpointError(f"trainer_state needs an int 'iteration', got {trainer_state.get('iteration')!r}")
    check_keep_last(keep_last)  # before anything is written
    try:
        state_json = json.dumps(trainer_state, indent=2, sort_keys=True)
    except TypeError as e:
        raise CheckpointError(f"trainer_state is not JSON-serialisable: {e}") from None
    root = Path(ckpt_dir)
    final = root / checkpoint_name(trainer_state["iteration"])
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    make_staging_dir(tmp, "checkpoint directory", CheckpointError)

    metadata = sharded_metadata(optimizer)
    sd = build_sharded_state_dict(chunks, optimizer, metadata, is_loading=False, with_rng=True)
    sd["sharded_metadata"] = metadata  # loading must build the same structure
    sd["trainer_state"] = json.loads(state_json)
    sd["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    sd["layout"] = current_layout().sizes()
    error = None
    try:
        with in_process_results_queue():
            dist_checkpointing.save(sd, str(tmp), sharded_strategy=save_strategy())
        if rank == 0:
            (tmp / TRAINER_STATE).write_text(state_json)
    except (OSError, CheckpointException) as e:  # a full or failing disk, seen by every rank or rank 0 alone
        error = _save_failure(e, final)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # every rank's files are on disk, or every rank knows why not
    error = next((e for e in errors if e), None)
    if error is None and rank == 0:
        try:
            write_manifest(tmp)  # the last file of the save: it commits with the rename below
            publish(tmp, final)
            prune(root, keep_last, protect=final)
        except OSError as e:
            error = _save_failure(e, final)
    if error is not None and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the half-written save: its space back, `latest` untouched
    raise_together(error, CheckpointError)
    return final


def _save_failure(e: BaseException, final: Path) -> str:
    """One line for a save that failed: which iteration, where, why, and what is kept."""
    # megatron-core's writer re-raises an OSError as RuntimeError("Worker failure: [Errno 28] ..."),
    # and torch.save on a full disk as a zip-writer error: the text is what survives.
    no_space = (
        getattr(e, "errno", None) == errno.ENOSPC
        or os.strerror(errno.ENOSPC) in str(e)
        or _nearly_full(final.parent)  # torch's zip writer says only "unexpected pos 704 vs 598"
    )
    cause = _first_failure(e)
    first_line = (str(cause).strip().splitlines() or [""])[0][:200]
    why = os.strerror(errno.ENOSPC) if no_space else f"{type(cause).__name__}: {first_line}"
    previous = find_latest(final.parent)
    kept = (
        f"the latest checkpoint is still {previous.name}" if previous is not None else "there is no earlier checkpoint"
    )
    remedy = (
        "free space there or set checkpoint.dir to a larger disk, then resume"
        if no_space
        else "fix the directory, then resume"
    )
    return (
        f"could not save checkpoint {final.name} (iteration {int(checkpoint_iteration(final))}) in checkpoint.dir "
        f"{final.parent}: {why}. Its partial files were removed and {kept}; {remedy}"
    )


def load_checkpoint(
    chunks: list,
    optimizer: Any = None,
    scheduler: Any = None,
    ckpt_dir: Optional[PathLike] = None,
    *,
    path: Optional[PathLike] = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    config_hash: Optional[str] = None,
    strict: bool = True,
    accept_unverified: bool = False,
    run_id: Optional[str] = None,
) -> Optional[dict]:
    """Restore the newest checkpoint of `ckpt_dir` (or `path`); returns its trainer state, or
    None when there is nothing to resume from. Collective over all ranks.

    config_hash: when given, a checkpoint saved with a different `trainer_state['config_hash']`
    is refused. run_id (rank 0's): from `ckpt_dir`, a checkpoint another run wrote is refused.
    accept_unverified: load a checkpoint without a manifest. A checkpoint that fails to load on
    any rank is skipped for the previous one. RNG states are restored only if the parallel
    layout is unchanged (a resharded resume gets a fresh RNG stream, as with Megatron-LM).
    """
    if path is None and ckpt_dir is None:
        raise CheckpointError("load_checkpoint needs ckpt_dir or path")
    failed: dict[str, str] = {}
    while True:
        decision: list = [None]
        if dist.get_rank() == 0:  # one decision for everyone, even if files change meanwhile
            decision = [
                resume_decision(ckpt_dir, path, accept_unverified=accept_unverified, run_id=run_id, failed=failed)
            ]
        dist.broadcast_object_list(decision, src=0)
        kind, value = decision[0]
        if kind == "error":
            raise CheckpointError(value)
        if value is None:
            return None
        target = Path(value)
        error, state = None, None
        try:
            state = _load(
                target,
                chunks,
                optimizer,
                scheduler,
                load_optimizer=load_optimizer,
                load_rng=load_rng,
                config_hash=config_hash,
                strict=strict,
            )
        except UnsafeCheckpointError as e:
            error = (True, str(e))
        except CheckpointError:
            raise  # it loads, but not into this run (config, layout): the previous one would not either
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - damaged in a way the manifest did not see
            cause = _first_failure(e)
            if isinstance(cause, UnsafeCheckpointError):
                error = (True, str(cause))
            else:
                first_line = (str(cause).strip().splitlines() or [""])[0][:200]
                error = (False, f"failed to load ({type(cause).__name__}: {first_line})")
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)  # every rank moves on together, even those that loaded
        unsafe = [e[1] for e in errors if e and e[0]]
        if unsafe:  # code posing as a checkpoint: stop, on every rank, rather than look for an older one
            raise UnsafeCheckpointError(unsafe[0])
        problems = [e[1] for e in errors if e]
        if not problems:
            return state
        failed[target.name] = problems[0]
        log.warning("checkpoint %s %s; trying the previous one", target, problems[0])


def _nearly_full(directory: Path, margin: int = 1 << 20) -> bool:
    """Whether the disk under `directory` has less than `margin` bytes left (asked right after a
    failed save, before its partial files are removed)."""
    try:
        return shutil.disk_usage(directory).free < margin
    except OSError:
        return False


def _first_failure(e: BaseException) -> BaseException:
    """The error itself, or for torch.distributed.checkpoint's CheckpointException (which gathers
    every rank's failure) the first rank's."""
    if isinstance(e, CheckpointException) and e.failures:
        return next(iter(e.failures.values()))[0]
    return e


def _load(
    target: Path,
    chunks: list,
    optimizer: Any,
    scheduler: Any,
    *,
    load_optimizer: bool,
    load_rng: bool,
    config_hash: Optional[str],
    strict: bool,
) -> dict:
    from megatron.core import dist_checkpointing

    from megatron_stepwise.mcore.train.model import unwrap
    from megatron_stepwise.mcore.weights.safe_dist_load import load_strategies

    strategies = load_strategies()  # every pickle in the checkpoint read as data, never run as code
    common = strategies["common_strategy"].load_common(str(target))
    trainer_state = common["trainer_state"]
    if config_hash is not None and trainer_state.get("config_hash") != config_hash:
        raise CheckpointError(
            f"checkpoint {target} was saved with config_hash={trainer_state.get('config_hash')!r}, "
            f"the current config has {config_hash!r}"
        )
    saved_layout, layout = common.get("layout") or {}, current_layout().sizes()
    same_layout = saved_layout == layout
    if optimizer is not None and load_optimizer and distributed_optimizers(optimizer):
        moved = [
            f"{k} {saved_layout.get(k)} -> {layout[k]}"
            for k in ("tp", "pp", "cp")
            if saved_layout.get(k, 1) != layout[k]
        ]
        if moved:
            # megatron-core's dp_reshardable optimizer state follows DP changes only; without this
            # check its loader fails with a KeyError on the first missing bucket.
            raise CheckpointError(
                f"checkpoint {target} holds distributed-optimizer state for another model-parallel layout "
                f"({', '.join(moved)}); it resumes only at the same tensor/pipeline/context parallel sizes. "
                "Resume with those sizes, or load the model weights alone with fresh optimizer moments "
                "(checkpoint.load_optimizer=false)"
            )
    metadata = common.get("sharded_metadata") or sharded_metadata(optimizer)
    if optimizer is not None and load_optimizer:
        materialize_optimizer_state(optimizer)
    sd = build_sharded_state_dict(
        chunks, optimizer if load_optimizer else None, metadata, is_loading=True, with_rng=load_rng and same_layout
    )
    loaded = dist_checkpointing.load(sd, str(target), **strategies)
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(loaded[model_key(i, len(chunks))], strict=strict)
    if optimizer is not None and load_optimizer:
        with torch.no_grad():  # the fp32 distributed optimizer copies into views of the params
            optimizer.load_state_dict(loaded["optimizer"])
        restore_adam_steps(optimizer, loaded["optimizer"])
    if scheduler is not None and common.get("scheduler") is not None:
        scheduler.load_state_dict(common["scheduler"])
    if load_rng and same_layout:
        set_rng_state(loaded["rng_state"])
    return trainer_state
