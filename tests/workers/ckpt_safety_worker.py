"""torchrun worker for tests/integration/test_checkpoint_safety.py (2 processes, DP2, distributed
optimizer): real megatron-core checkpoints of a tiny model, then the attacks and the disk-full save.

--mode poison: save iterations 1-4 (rank 1's RNG state of iteration 3 and the scheduler state of
  iteration 4 carry a pickle whose `__reduce__` writes --marker), load iteration 2 cleanly, then
  replace iteration 2's `.metadata` with such a pickle and rewrite its manifest, and load each
  poisoned checkpoint. Each rank writes what happened to <out>/poison-rank<r>.json.
--mode diskfull: --ckpt is on a small tmpfs. Save iteration 1, fill the disk, save iteration 2;
  record the error, what is on disk, and what a resume then loads (<out>/diskfull-rank<r>.json).
"""

from __future__ import annotations

import argparse
import builtins
import errno
import json
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from ckpt_worker import build, fake_step, trainer_state
from worker_entry import run_worker

from megatron_stepwise.mcore.weights import dist_checkpoint as C
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.mcore.weights import sharded_state as S
from megatron_stepwise.mcore.weights.checkpoint_dir import LATEST, TRAINER_STATE, checkpoint_name, write_manifest
from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError


class Poison:
    """Unpickling this runs code: it writes `marker` (what an attacker's checkpoint would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


class PoisonedScheduler:
    """A scheduler whose state (saved in common.pt) carries the poison."""

    def __init__(self, real, marker: str):
        self.real, self.marker = real, marker

    def state_dict(self):
        return {**self.real.state_dict(), "poison": Poison(self.marker)}

    def load_state_dict(self, state):
        self.real.load_state_dict({k: v for k, v in state.items() if k != "poison"})


def attempt(fn) -> dict:
    try:
        return {"ok": fn()}
    except CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}


def poison(args, rank: int) -> dict:
    ckpt, marker = Path(args.ckpt), args.marker
    chunks, optimizer, scheduler = build(1, init_seed=1, distopt=True)
    for it in (1, 2):
        fake_step(chunks, optimizer, scheduler, it)
        C.save_checkpoint(chunks, optimizer, scheduler, trainer_state(it), ckpt, keep_last=10)
    saved_params = W.full_state(chunks)
    real_rng = S.rng_state
    if rank == 1:  # iteration 3: rank 1's RNG state (a byte item of its .distcp file) is poisoned
        S.rng_state = lambda: {**real_rng(), "poison": Poison(marker)}
    C.save_checkpoint(chunks, optimizer, scheduler, trainer_state(3), ckpt, keep_last=10)
    S.rng_state = real_rng
    C.save_checkpoint(chunks, optimizer, PoisonedScheduler(scheduler, marker), trainer_state(4), ckpt, keep_last=10)
    # megatron-core's save compares the ranks' common state by unpickling it in memory, which runs
    # the poison here: only what happens after this point is about loading.
    dist.barrier()
    record = {"marker_after_saves": os.path.exists(marker)}
    dist.barrier()
    if rank == 0 and os.path.exists(marker):
        os.remove(marker)
    dist.barrier()

    fresh, fresh_opt, fresh_sched = build(1, init_seed=2, distopt=True)
    record["clean"] = attempt(lambda: C.load_checkpoint(fresh, fresh_opt, fresh_sched, path=ckpt / "iter_0000002"))
    record["clean_params_equal"] = all(torch.equal(v, W.full_state(fresh)[k]) for k, v in saved_params.items())
    if rank == 0:  # the attack: a new .metadata and a manifest that matches it
        (ckpt / "iter_0000002" / ".metadata").write_bytes(pickle.dumps(Poison(marker)))
        write_manifest(ckpt / "iter_0000002")
    dist.barrier()
    for name, it in (("metadata", 2), ("rng_bytes", 3), ("common", 4)):
        record[name] = attempt(
            lambda: C.load_checkpoint(fresh, fresh_opt, fresh_sched, path=ckpt / checkpoint_name(it))
        )
    # A resume from the directory (latest = iteration 4, poisoned) stops rather than falls back.
    record["resume"] = attempt(lambda: C.load_checkpoint(fresh, fresh_opt, fresh_sched, ckpt))
    record["marker_exists"] = os.path.exists(marker)
    return record


def diskfull(args, rank: int) -> dict:
    ckpt = Path(args.ckpt)
    chunks, optimizer, scheduler = build(1, init_seed=1, distopt=True)
    fake_step(chunks, optimizer, scheduler, 1)
    C.save_checkpoint(chunks, optimizer, scheduler, trainer_state(1), ckpt, keep_last=2)
    fake_step(chunks, optimizer, scheduler, 2)
    save = lambda it: str(C.save_checkpoint(chunks, optimizer, scheduler, trainer_state(it), ckpt, 2))  # noqa: E731
    # Injected: rank 0 alone meets ENOSPC writing trainer_state.json (the others have finished).
    real_write = Path.write_text
    if rank == 0:
        Path.write_text = lambda self, *a, **k: (
            (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self)))
            if self.name == TRAINER_STATE
            else real_write(self, *a, **k)
        )
    record = {"injected": attempt(lambda: save(2))}
    Path.write_text = real_write
    record["injected_listing"] = sorted(p.name for p in ckpt.iterdir())
    if args.fill:  # a real full disk: --ckpt is on a small tmpfs; leave room for a third of a checkpoint
        one = sum(f.stat().st_size for f in (ckpt / "iter_0000001").rglob("*") if f.is_file())
        if rank == 0:
            free = os.statvfs(ckpt).f_bavail * os.statvfs(ckpt).f_frsize
            with open(ckpt.parent / "filler", "wb") as f:
                f.write(b"\0" * max(0, free - one // 3))
        dist.barrier()
        record["full"] = attempt(lambda: save(2))
        record["full_listing"] = sorted(p.name for p in ckpt.iterdir())
    record["latest"] = (ckpt / LATEST).read_text().strip()
    fresh, fresh_opt, fresh_sched = build(1, init_seed=2, distopt=True)
    record["resume"] = attempt(lambda: C.load_checkpoint(fresh, fresh_opt, fresh_sched, ckpt))
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["poison", "diskfull"], required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--marker", default="")
    p.add_argument("--fill", type=int, default=0, help="diskfull: fill the disk of --ckpt (a small tmpfs)")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    record = poison(args, rank) if args.mode == "poison" else diskfull(args, rank)
    Path(args.out, f"{args.mode}-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    run_worker(main)
