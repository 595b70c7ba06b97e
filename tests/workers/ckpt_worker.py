"""torchrun worker for tests/integration/test_checkpoint.py (2 processes, TP2 by default).

--mode save: three optimizer steps, a checkpoint after each (keep_last=2); record params,
  optimizer/scheduler state and the next RNG draws; then a 4th step whose save is killed
  (SIGKILL on rank 0) after writing part of its files.
--mode load: fresh processes with different initial weights load the latest checkpoint and
  record the same things; then save iteration 4 for real; then reload iteration 3 resharded
  (TP2 <-> TP1 x DP2; params only comparable, RNG not restored).
--tp 1 --distopt 1: the same at DP2 with megatron's distributed optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from worker_entry import run_worker

from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.weights import dist_checkpoint as C
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.mcore.weights.checkpoint_dir import LATEST, verify_checkpoint
from megatron_stepwise.mcore.weights.checkpoint_errors import CheckpointError


def build(tp: int, init_seed: int, distopt: bool = False):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    runtime.init_distributed(tp, 1, seed=5)
    chunks = M.build_model_chunks(
        M.tiny_config(num_layers=2),
        use_distributed_optimizer=distopt,
        init=lambda c: W.init_deterministic(c, seed=init_seed),
    )
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        min_lr=1e-3,
        weight_decay=0.01,
        params_dtype=torch.float32,
        use_distributed_optimizer=distopt,
    )
    optimizer = get_megatron_optimizer(config, chunks)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    return chunks, optimizer, scheduler


def fake_step(chunks, optimizer, scheduler, it: int) -> None:
    """An optimizer step with layout-independent gradients (so replicated params stay equal)."""
    from megatron_stepwise.mcore.train.model import unwrap

    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in W.canonical_params(chunk):
            full = W.deterministic_full_tensor(name + ".grad", W.full_shape(param, name), seed=it)
            param.main_grad.copy_(W.shard_full(full, param, name, model))
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(1)
    # Move every RNG away from its seeded state, differently per rank, so that equal draws after
    # a resume can only come from restored states.
    from megatron.core import tensor_parallel

    n = it + 3 * dist.get_rank()
    [random.random() for _ in range(n)], np.random.rand(n), torch.rand(n)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        torch.rand(n)


def adam_state(optimizer) -> list:
    """This rank's Adam moments and steps, parameter by parameter (copies: steps mutate them)."""
    out = []
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                out.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inner.state[p].items()})
    return out


def snapshot(chunks, optimizer, scheduler) -> dict:
    """What must survive a checkpoint: params, optimizer and scheduler state, the next RNG draws."""
    from megatron.core import tensor_parallel

    state = {
        "params": W.full_state(chunks),
        "optimizer": adam_state(optimizer),
        "scheduler": scheduler.state_dict(),
        "python": random.random(),
        "numpy": float(np.random.rand()),
        "torch": torch.rand(3),
    }
    with tensor_parallel.get_cuda_rng_tracker().fork():
        state["tracker"] = torch.rand(3)
    return state


def listing(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


def crash_during_next_save() -> None:
    """The next dist_checkpointing.save writes part of its files on rank 0, then rank 0 is
    SIGKILLed (torchrun then tears the job down)."""
    from megatron.core import dist_checkpointing

    def partial_save(sd, path, **_):
        if dist.get_rank() == 0:
            Path(path, "common.pt").write_bytes(b"\x80\x02partial")
            Path(path, "__0_0.distcp").write_bytes(os.urandom(4096))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)

    dist_checkpointing.save = partial_save


def trainer_state(it: int) -> dict:
    return {"iteration": it, "data_position": 8 * it, "weight_version": it, "config_hash": "cfg-1"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "load"], required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--distopt", type=int, default=0)
    args = p.parse_args()
    ckpt, out = Path(args.ckpt), Path(args.out)
    rank = int(os.environ["RANK"])

    if args.mode == "save":
        chunks, optimizer, scheduler = build(args.tp, init_seed=1, distopt=bool(args.distopt))
        saved = []
        for it in (1, 2, 3):
            fake_step(chunks, optimizer, scheduler, it)
            saved.append(C.save_checkpoint(chunks, optimizer, scheduler, trainer_state(it), ckpt, keep_last=2).name)
        record = snapshot(chunks, optimizer, scheduler)
        record["saved"] = saved
        record["listing"] = listing(ckpt)
        torch.save(record, out / f"saved-rank{rank}.pt")
        dist.barrier()
        fake_step(chunks, optimizer, scheduler, 4)
        torch.save(W.full_state(chunks), out / f"saved-rank{rank}-step4.pt")
        crash_during_next_save()
        C.save_checkpoint(chunks, optimizer, scheduler, trainer_state(4), ckpt, keep_last=2)
        return

    chunks, optimizer, scheduler = build(args.tp, init_seed=2, distopt=bool(args.distopt))
    record = {"listing_before": listing(ckpt), "verified": verify_checkpoint(ckpt / "iter_0000003")}
    record["trainer_state"] = C.load_checkpoint(chunks, optimizer, scheduler, ckpt, config_hash="cfg-1")
    record.update(snapshot(chunks, optimizer, scheduler))
    try:
        C.load_checkpoint(chunks, optimizer, scheduler, ckpt, config_hash="cfg-2")
    except CheckpointError as e:
        record["hash_error"] = str(e)
    fake_step(chunks, optimizer, scheduler, 4)
    record["params_step4"] = W.full_state(chunks)  # must equal the uninterrupted run's
    C.save_checkpoint(chunks, optimizer, scheduler, trainer_state(4), ckpt, keep_last=2)
    record["listing_after"] = listing(ckpt)
    record["latest_after"] = (ckpt / LATEST).read_text().strip()

    # Resharded: the other layout (TP2 <-> TP1 x DP2) in the same processes, new model-parallel
    # groups. A distributed optimizer's dp_reshardable state cannot follow a TP change: model only.
    other_tp = 1 if args.tp == 2 else 2
    chunks, optimizer, scheduler = build(other_tp, init_seed=3, distopt=bool(args.distopt))
    ts = C.load_checkpoint(chunks, optimizer, scheduler, path=ckpt / "iter_0000003", load_optimizer=not args.distopt)
    record["resharded"] = {"trainer_state": ts, "params": W.full_state(chunks), "torch": torch.rand(3)}
    torch.save(record, out / f"loaded-rank{rank}.pt")
    (out / f"loaded-rank{rank}.json").write_text(json.dumps(record["trainer_state"]))
    runtime.destroy_distributed()


if __name__ == "__main__":
    run_worker(main)
