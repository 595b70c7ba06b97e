"""Checkpoint and resume with megatron-core `dist_checkpointing` (torch_dist format).

A checkpoint `CKPT_DIR/iter_0000042/` holds the model chunks, the optimizer, the LR scheduler,
the caller's trainer state and every rank's RNG states. Saves are atomic (`.tmp` directory,
barrier, rename, `latest` pointer) and verified (a `manifest.json` of sizes and hashes checked
before loading; a damaged latest falls back to the previous good one; a save that fails, e.g. on
a full disk, removes its partial files and leaves `latest` where it was). A resume refuses a
checkpoint written by another run. Loading never runs code from a checkpoint: its pickles are read
as data (safe_dist_load.py; docs/weights.md, 'What a checkpoint from elsewhere can and cannot do').

What each part holds and when it reloads into another layout: docs/weights.md, 'Checkpoints';
the two megatron-core 0.16 quirks on CPU / gloo handled here: 'Checkpoints: pruning and
megatron-core on CPU'.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import random
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_stepwise.mcore.runtime.runtime import current_layout
from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError, UnsafeCheckpointError
from megatron_stepwise.mcore.weights.fileops import fsync_dir, make_staging_dir, raise_together, write_atomic
from megatron_stepwise.rundir.paths import iteration_name, parse_iteration

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
_HASH = "sha256"  # hardware-accelerated on current x86 and ARM: ~1.3 GB/s here, blake2b ~0.7
_COMPLETE_MARKERS = ("metadata.json", TRAINER_STATE)


def checkpoint_name(iteration: int) -> str:
    return iteration_name(iteration)


def _iteration(path: Path) -> Optional[int]:
    return parse_iteration(path.name)


def is_complete(path: Path) -> bool:
    return path.is_dir() and _iteration(path) is not None and all((path / f).is_file() for f in _COMPLETE_MARKERS)


def list_checkpoints(ckpt_dir: PathLike) -> list[Path]:
    """Complete checkpoints in `ckpt_dir`, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=_iteration)


def find_latest(ckpt_dir: PathLike) -> Optional[Path]:
    """The checkpoint to resume from: the one `latest` names if it is complete, else the newest
    complete one (a lost or stale pointer never blocks a resume); None when there is none."""
    root = Path(ckpt_dir)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if is_complete(target):
            return target
    found = list_checkpoints(root)
    return found[-1] if found else None


# ----------------------------------------------------------------------------- manifest (rank 0)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: PathLike) -> Path:
    """Record the size and hash of every file under checkpoint directory `path` in
    `manifest.json` (written atomically; call it after every file is on disk)."""
    path = Path(path)
    skip = {MANIFEST, MANIFEST + ".tmp"}
    files = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        if rel not in skip:
            files[rel] = {"size": f.stat().st_size, _HASH: _digest(f)}
    write_atomic(path / MANIFEST, json.dumps({"format": 1, "hash": _HASH, "files": files}, indent=1, sort_keys=True))
    return path / MANIFEST


def verify_checkpoint(path: PathLike) -> tuple[Optional[str], bool]:
    """(problem, verified): problem is None when `path` is usable, else one line naming what is
    wrong (the file, expected vs got); verified is False for a checkpoint without a manifest
    (saved before manifests existed), which is usable but unchecked."""
    path = Path(path)
    if not path.is_dir():
        return "directory missing", False
    missing = [f for f in _COMPLETE_MARKERS if not (path / f).is_file()]
    if missing:
        return f"incomplete: {', '.join(missing)} missing", False
    if not (path / MANIFEST).is_file():
        return None, False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        algo = manifest.get("hash", _HASH)
        if algo != _HASH or not isinstance(files, dict):
            raise ValueError(f"unsupported hash {algo!r}" if algo != _HASH else "no file list")
        entries = [(rel, int(e["size"]), str(e[algo])) for rel, e in sorted(files.items())]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__}: {e})", False
    for rel, size, _ in entries:  # sizes first: cheap, and what a truncation changes
        try:
            got = (path / rel).stat().st_size
        except OSError:
            return f"file {rel}: missing (expected {size} bytes)", True
        if got != size:
            return f"file {rel}: expected {size} bytes, got {got}", True
    for rel, _, digest in entries:
        try:
            got = _digest(path / rel)
        except OSError as e:
            return f"file {rel}: unreadable ({e})", True
        if got != digest:
            return f"file {rel}: expected {_HASH} {digest[:16]}..., got {got[:16]}...", True
    return None, True


UNVERIFIED = f"no {MANIFEST}, so unverified (checkpoint.accept_unverified=true loads it)"


def choose_checkpoint(
    ckpt_dir: PathLike, *, accept_unverified: bool = False, failed: Optional[dict[str, str]] = None
) -> tuple[Optional[Path], bool, list[str]]:
    """(checkpoint, verified, warnings): the newest good checkpoint of `ckpt_dir` (the one
    `latest` names first), whether its manifest checked it, and one line per newer one skipped
    as corrupt, incomplete, unverified (without `accept_unverified`) or in `failed` (name ->
    why it failed to load). (None, False, []) when there is nothing to resume from; raises
    CheckpointError naming `ckpt_dir` when there are checkpoints but none is good."""
    failed = failed or {}
    root = Path(ckpt_dir)
    candidates: list[Path] = []
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if _iteration(named) is not None and named.is_dir():
            candidates.append(named)
    # Every iter_* directory, complete or not: saves are renamed into place whole, so an
    # incomplete one was damaged afterwards and is worth a warning too.
    found = [p for p in root.iterdir() if p.is_dir() and _iteration(p) is not None] if root.is_dir() else []
    found.sort(key=_iteration)
    candidates += [p for p in reversed(found) if p not in candidates]
    bad: list[str] = []
    for candidate in candidates:
        problem, verified = verify_checkpoint(candidate)
        if problem is None and not verified and not accept_unverified:
            problem = UNVERIFIED
        problem = failed.get(candidate.name, problem)
        if problem is None:
            warnings = [f"checkpoint {b} is corrupt or incomplete, skipped" for b in bad]
            # e.g. "checkpoint iter_0000006 (file common.pt: expected 4512 bytes, got 100) is ..."
            return candidate, verified, warnings
        bad.append(f"{candidate.name} ({problem})")
    if candidates:
        raise CheckpointError(
            f"no good checkpoint in {root} to resume from: {'; '.join(bad)}. Move the directory away "
            "to start afresh, or name a checkpoint with checkpoint.resume"
        )
    return None, False, []


# ----------------------------------------------------------------------------- file operations (rank 0)


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished `.tmp` checkpoint into place and point `latest` at it."""
    old = final.with_name(final.name + ".old")
    if final.exists():  # saving the same iteration again (e.g. right after a resume)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)
    write_atomic(final.parent / LATEST, final.name + "\n")


def _check_keep_last(keep_last: int) -> None:
    if keep_last < 1:  # checkpoint.keep_last's bound, for callers outside the config
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")


def prune(ckpt_dir: PathLike, keep_last: int, *, protect: Optional[Path] = None) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and leftover `.tmp`/`.old`
    directories of interrupted saves; never `protect` or what `latest` names. Returns what went."""
    _check_keep_last(keep_last)
    root = Path(ckpt_dir)
    keep = set(list_checkpoints(root)[-keep_last:])
    latest = find_latest(root)
    keep |= {p for p in (protect, latest) if p is not None}
    removed = []
    for p in root.iterdir():
        stale = p.is_dir() and p.suffix in (".tmp", ".old") and parse_iteration(p.stem) is not None
        if (is_complete(p) and p not in keep) or (stale and p != protect):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return sorted(removed)


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """This process's RNG states (python, numpy, torch CPU/CUDA, megatron's tracker)."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# ----------------------------------------------------------------------------- state dicts


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"  # Megatron-LM's naming (virtual pipeline chunks)


def _distributed_optimizers(optimizer: Any) -> list:
    """(index, optimizer) of the distributed optimizers in `optimizer` (a chained one or not)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [(i, o) for i, o in enumerate(inner) if isinstance(o, DistributedOptimizer)]


def _materialize_optimizer_state(optimizer: Any) -> None:
    """Give a fresh distributed optimizer its (dummy) Adam states before loading into it.

    Without Apex/TE (the CPU case) `DistributedOptimizer.state_dict()` reads every parameter's
    `step`, which torch's Adam creates only at its first step; megatron-core's own dummy-state
    initialiser (used for its FSDP loads) makes them, and the load then overwrites them.
    """
    for _, inner in _distributed_optimizers(optimizer):
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer: Any, loaded: Any) -> None:
    """Put the checkpoint's step count back into torch Adam's per-parameter state.

    Without Apex/TE, megatron-core's distributed optimizer keeps the step in each parameter's
    torch state; its `load_state_dict` sets one tensor shared by all parameters (which torch's
    foreach Adam would then advance once per parameter) and the dp_reshardable loader
    overwrites it with the placeholder's value. The true count is in the loaded param groups.
    """
    chained = hasattr(optimizer, "chained_optimizers") and len(optimizer.chained_optimizers) > 1
    for i, inner in _distributed_optimizers(optimizer):
        part = loaded[i] if chained else loaded
        steps = {g["step"] for g in part["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue  # Apex / TE optimizers keep the step in the param groups themselves
        step = float(steps.pop())
        for state in inner.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)


def sharded_metadata(optimizer: Any) -> dict:
    """The `metadata` megatron-core's sharded_state_dict methods take (Megatron-LM's defaults).

    The distributed optimizer's default format in 0.16 (`fully_sharded_model_space`) is
    deprecated and no longer saves; `dp_reshardable` writes each rank's buffer shards as they are.
    Its optimizer state reloads into the same TP/PP layout (tested: DP2); across a TP/PP change
    load the model only (`load_optimizer=False`). `fully_reshardable` is not offered: without
    Apex/TE (CPU) megatron-core 0.16 cannot load it (it looks for a per-parameter `step`).
    """
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer is not None and _distributed_optimizers(optimizer):
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _sharded_state_dict(chunks, optimizer, metadata: dict, *, is_loading: bool, with_rng: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_stepwise.mcore.train.model import unwrap

    # megatron-core adds process groups to the metadata it is given: hand it copies, so that
    # `metadata` stays the plain dict recorded in the checkpoint.
    # The bare GPTModel's names (no DDP / Float16Module prefixes), as Megatron-LM saves them.
    sd: dict[str, Any] = {
        _model_key(i, len(chunks)): unwrap(c).sharded_state_dict(metadata=dict(metadata)) for i, c in enumerate(chunks)
    }
    if optimizer is not None:
        # As Megatron-LM: the optimizer finds its params' sharded tensors anywhere in `sd`.
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=is_loading, metadata=dict(metadata))
    if with_rng:  # one object per global rank: rank r writes slot r; only a placeholder when loading
        sd["rng_state"] = ShardedObject(
            "rng_state", rng_state(), (dist.get_world_size(),), (dist.get_rank(),), replica_id=0
        )
    return sd


@contextmanager
def _in_process_results_queue() -> Iterator[None]:
    """See the module docstring: keep megatron's write-result queue inside this process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    yield


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # One writer process per rank: each rank's shard is small next to the fork cost on a CPU box.
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


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
    _check_keep_last(keep_last)  # before anything is written
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
    sd = _sharded_state_dict(chunks, optimizer, metadata, is_loading=False, with_rng=True)
    sd["sharded_metadata"] = metadata  # loading must build the same structure
    sd["trainer_state"] = json.loads(state_json)
    sd["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    sd["layout"] = current_layout().sizes()
    error = None
    try:
        with _in_process_results_queue():
            dist_checkpointing.save(sd, str(tmp), sharded_strategy=_save_strategy())
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
            _publish(tmp, final)
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
        f"could not save checkpoint {final.name} (iteration {int(_iteration(final))}) in checkpoint.dir "
        f"{final.parent}: {why}. Its partial files were removed and {kept}; {remedy}"
    )


def _decide(
    ckpt_dir: Optional[PathLike],
    path: Optional[PathLike],
    *,
    accept_unverified: bool = False,
    run_id: Optional[str] = None,
    failed: Optional[dict[str, str]] = None,
) -> tuple[str, Optional[str]]:
    """Rank 0: ("path", checkpoint or None) or ("error", message); warns about what it skips."""
    try:
        if path is not None:  # asked for by name: no fallback
            target, warnings = Path(path), []
            problem, verified = verify_checkpoint(target)
            if problem is None and not verified and not accept_unverified:
                problem = UNVERIFIED
            problem = (failed or {}).get(target.name, problem)
            if problem is not None:
                return "error", f"checkpoint {target} is corrupt, incomplete or unverified: {problem}"
        else:
            target, verified, warnings = choose_checkpoint(ckpt_dir, accept_unverified=accept_unverified, failed=failed)
            clash = _other_run(target, run_id)
            if clash:
                return "error", clash
    except CheckpointError as e:
        return "error", str(e)
    except OSError as e:  # every rank waits for this decision: never raise on rank 0 alone
        return "error", f"cannot read the checkpoints in {path or ckpt_dir}: {e}"
    if target is not None:
        if warnings:  # one line: what was wrong, and what is loaded instead
            log.warning("%s; falling back to %s", "; ".join(warnings), target)
        if not verified:
            log.warning(
                "checkpoint %s has no %s: loading it unverified (checkpoint.accept_unverified)", target, MANIFEST
            )
    return "path", None if target is None else str(target)


def _other_run(target: Optional[Path], run_id: Optional[str]) -> Optional[str]:
    """The error for a checkpoint another run wrote (its recorded run_id differs), else None."""
    if target is None or run_id is None:
        return None
    try:
        saved = json.loads((target / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return None  # unreadable: the load itself reports it
    theirs = saved.get("run_id") if isinstance(saved, dict) else None
    if theirs is None or theirs == run_id:
        return None  # saved before run ids were recorded, or ours
    where = f" in {saved['run_dir']}" if saved.get("run_dir") else ""
    return (
        f"checkpoint {target} was written by another run (run_id {theirs}{where}), this is run {run_id}: "
        "two runs share one checkpoint directory. Give this run its own checkpoint.dir, or start "
        "from that checkpoint deliberately with checkpoint.resume=<its path>"
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
            decision = [_decide(ckpt_dir, path, accept_unverified=accept_unverified, run_id=run_id, failed=failed)]
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
    if optimizer is not None and load_optimizer and _distributed_optimizers(optimizer):
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
        _materialize_optimizer_state(optimizer)
    sd = _sharded_state_dict(
        chunks, optimizer if load_optimizer else None, metadata, is_loading=True, with_rng=load_rng and same_layout
    )
    loaded = dist_checkpointing.load(sd, str(target), **strategies)
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(loaded[_model_key(i, len(chunks))], strict=strict)
    if optimizer is not None and load_optimizer:
        with torch.no_grad():  # the fp32 distributed optimizer copies into views of the params
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer, loaded["optimizer"])
    if scheduler is not None and common.get("scheduler") is not None:
        scheduler.load_state_dict(common["scheduler"])
    if load_rng and same_layout:
        set_rng_state(loaded["rng_state"])
    return trainer_state
