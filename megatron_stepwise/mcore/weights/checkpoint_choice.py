"""Which checkpoint a resume loads: the newest one that verifies (the one `latest` names first),
skipping damaged, unverified or failed ones with a warning, and refusing one another run wrote.
Rank 0 decides; `load_checkpoint` (dist_checkpoint.py) broadcasts the decision.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from megatron_stepwise.mcore.weights.checkpoint_dir import (
    MANIFEST,
    MAX_SMALL_FILE_BYTES,
    TRAINER_STATE,
    PathLike,
    checkpoint_iteration,
    read_pointer,
    verify_checkpoint,
)
from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError
from megatron_stepwise.rundir.file_reads import read_regular

log = logging.getLogger(__name__)

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
    named = read_pointer(root)
    if named is not None and checkpoint_iteration(named) is not None and named.is_dir():
        candidates.append(named)
    # Every iter_* directory, complete or not: saves are renamed into place whole, so an
    # incomplete one was damaged afterwards and is worth a warning too.
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_iteration(p) is not None] if root.is_dir() else []
    found.sort(key=checkpoint_iteration)
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


def resume_decision(
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
        saved = json.loads(read_regular(target / TRAINER_STATE, MAX_SMALL_FILE_BYTES))
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
