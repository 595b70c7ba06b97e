"""torchrun worker for tests/integration/test_sync.py (2 processes): train/inference consistency.

For each model of --models in turn (one launch serves them all: the processes' imports and Ray's
start are paid once), rank 0 starts a Ray fleet with one embedded engine of that model (random
init of its own). For each layout
(TP2, PP2, TP1 x DP2, re-initialised in the same processes) and each sync mode (tensor, disk,
distributed), the policy gets new layout-independent weights, `WeightSync.push` sends them as a
new version, the engine generates greedily from a prompt, and the plugin's `compute_logprobs`
scores the same tokens. After the tensor-mode push the engine also samples at T = 0.6 with
top-p 0.9 and top-k 20, scored by a plugin at T = 0.6 and, as the control, at T = 1. Every push
is verified on the engine (weight_sync.verify, its metrics saved), inside the update request: a spy
counts the fleet's separate verify requests (none in sampled mode). In each layout and mode one more
push has one element of a tensor (held by the second stage at PP2) changed at a sampled position
after the trainer sampled it and before the engine loads it (`Injection`): the push must raise on
both ranks naming the tensor, the flat index and the engine. At PP2, one tensor of the second
stage is then corrupted on the engine: `verify` must raise on both ranks naming it, and a push with
verify off must record no check. Rank 0 saves the log-prob vectors (and the sync metrics) under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from worker_entry import run_worker

from megatron_stepwise import weight_checks, weight_transport
from megatron_stepwise.algo.losses import LossConfig
from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.mcore.weights import convert
from megatron_stepwise.mcore.weights import full_views as W
from megatron_stepwise.mcore.weights.sync import WeightSync
from megatron_stepwise.mcore.weights.sync_verify import PushRecord, WeightMismatch
from megatron_stepwise.steps import Step, TrajectoryID

PROMPT = [5, 17, 42, 99, 3, 250, 64]
LAYOUTS = [("tp2", 2, 1), ("pp2", 1, 2), ("tp1", 1, 1)]
MODES = ["tensor", "disk", "distributed"]


TEMPERATURE = 0.6


def generate(loop, fleet, prompt, **sampling):
    from megatron_stepwise.rollout.engines.protocol import SamplingParams

    params = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 8, **sampling})
    return loop.run_until_complete(fleet.generate(prompt, params))


def sampled_case(loop, fleet, rank, plugins, chunks) -> dict:
    """Engine vs trainer log-probs of tokens sampled at T = 0.6, top-p 0.9, top-k 20."""
    box = [None]
    if rank == 0:
        r = generate(loop, fleet, PROMPT, temperature=TEMPERATURE, top_p=0.9, top_k=20, max_new_tokens=16)
        box = [(r.output_ids, r.logprobs)]
    dist.broadcast_object_list(box, src=0)
    output_ids, engine_logprobs = box[0]
    scored = {name: megatron_logprobs(p, chunks, PROMPT, output_ids).tolist() for name, p in plugins.items()}
    return {"output_ids": output_ids, "engine": engine_logprobs, **scored}


CORRUPTED = "model.layers.1.self_attn.o_proj.weight"  # held by the second stage at PP2; in every model, MoE too


def corrupted_case(loop, fleet, rank, syncers, chunks, cfg, version) -> dict:
    """Engine 0's copy of CORRUPTED is zeroed behind the trainer's back; the last push's record
    must catch it on every rank. Then a push with verify off checks nothing."""
    if rank == 0:
        shape = syncers["distributed"]._last.checks[CORRUPTED].shape

        async def corrupt():
            await fleet.engine(0).call.remote("update_weights_from_tensors", {CORRUPTED: torch.zeros(shape)}, version)

        loop.run_until_complete(corrupt())
    try:
        syncers["distributed"].verify()
        message = None
    except WeightMismatch as e:
        message = str(e)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    off = WeightSync(fleet, "tensor", cfg, loop=loop, bucket_mb=0.05, verify="off")
    off_metrics = off.push(chunks, version)
    off.close()
    return {"messages": messages, "off_metrics": off_metrics, "version": version}


class Injection:
    """On rank 0: changes one element of CORRUPTED, at the `AT`-th sampled position of the push's
    version, after the trainer's record sampled it and before the engine loads it (the file it
    was written to, the tensor sent, or the tensor broadcast). Also counts the fleet's separate
    verify requests."""

    AT = 17

    def __init__(self, fleet):
        self.fleet, self.mode, self.version, self.target = fleet, None, None, None
        self.verify_requests = 0
        self._wrap(fleet, "update_weights_from_disk", self._disk)
        self._wrap(fleet, "update_weights_from_tensors", self._tensors)
        self._wrap(fleet, "verify_weights", self._counted)
        self._wrap(weight_transport, "broadcast", self._broadcast)
        self._wrap(PushRecord, "add", self._recorded)

    def _wrap(self, owner, name, wrapper) -> None:
        original = getattr(owner, name)
        setattr(owner, name, lambda *args, **kwargs: wrapper(original, *args, **kwargs))

    def arm(self, mode: str, version: int) -> None:
        self.mode, self.version, self.target = mode, version, None

    def disarm(self) -> None:
        self.mode = self.target = None

    def where(self, numel: int) -> int:
        return int(weight_checks.sample_positions(CORRUPTED, self.version, numel)[self.AT])

    def _changed(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone().contiguous()
        out.view(-1)[self.where(out.numel())] += 1.0
        return out

    def _disk(self, original, path, *args, **kwargs):
        if self.mode == "disk":
            from safetensors.torch import load_file, save_file

            file = Path(path) / convert.load_hf_index(path)["weight_map"][CORRUPTED]
            tensors = load_file(str(file))
            tensors[CORRUPTED] = self._changed(tensors[CORRUPTED])
            save_file(tensors, str(file), metadata={"format": "pt"})
        return original(path, *args, **kwargs)

    def _tensors(self, original, named, *args, **kwargs):
        if self.mode == "tensor":
            named = [(n, self._changed(t) if n == CORRUPTED else t) for n, t in named]
        return original(named, *args, **kwargs)

    def _recorded(self, original, record, bucket):
        bucket = list(bucket)
        original(record, bucket)  # the record samples the true values (maybe on its thread)
        for name, tensor in bucket:
            if name == CORRUPTED:
                self.target = tensor

    def _broadcast(self, original, group, tensors):
        if self.mode == "distributed":
            tensors = [self._changed(t) if t is self.target else t for t in tensors]
        return original(group, tensors)

    def _counted(self, original, *args, **kwargs):
        self.verify_requests += 1
        return original(*args, **kwargs)


def injected_case(injection, rank, syncer, chunks, mode, version) -> dict:
    """A push whose CORRUPTED tensor is changed on its way to the engine must raise on every rank."""
    if rank == 0:
        injection.arm(mode, version)
    try:
        syncer.push(chunks, version)
        message = None
    except WeightMismatch as e:
        message = str(e)
    finally:
        if rank == 0:
            injection.disarm()
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    where = hits = None
    if rank == 0:
        numel = math.prod(syncer._last.checks[CORRUPTED].shape)
        positions = weight_checks.sample_positions(CORRUPTED, version, numel)
        where = int(positions[Injection.AT])
        hits = int((positions == where).sum())  # 1: one position per stratum (counted, not assumed)
    return {"messages": messages, "where": where, "hits": hits, "version": version}


def megatron_logprobs(plugin, chunks, prompt, response) -> torch.Tensor:
    step = Step(TrajectoryID("consistency", 0), prompt, response, [1] * len(response), is_last_step=True)
    return plugin.compute_logprobs(chunks, [step])[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument(
        "--models",
        default="qwen2:0",
        help="MODEL_TYPE:TIED[,...]: each model in turn, in the same processes (and Ray instance); "
        "its results under OUT/MODEL_TYPE-TIED/",
    )
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    loop = asyncio.new_event_loop() if rank == 0 else None
    for spec in args.models.split(","):
        model_type, tied = spec.split(":")
        run_model(Path(args.out) / f"{model_type}-{tied}", model_type, bool(int(tied)), rank, loop)
        dist.barrier()
    runtime.destroy_distributed()


def run_model(out: Path, model_type: str, tied: bool, rank: int, loop) -> None:
    """Every layout and mode for one model, against a fleet of its own (its engine has the model's
    architecture); writes out/results.json and out/weights_listing.json."""
    out.mkdir(parents=True, exist_ok=True)
    extra = {"head_dim": 24} if model_type.startswith("qwen3") else {}  # explicit, not hidden / heads
    cfg = M.tiny_config(tie_word_embeddings=tied, model_type=model_type, **extra)

    fleet = injection = None
    if rank == 0:
        from megatron_stepwise.rollout.fleet.engine_actor import EngineSpec
        from megatron_stepwise.rollout.fleet.fleet import RolloutFleet

        fleet = RolloutFleet([EngineSpec(kind="local", model_config=cfg, seed=123, num_cpus=0.5)], ray_num_cpus=2)
        loop.run_until_complete(fleet.wait_ready())
        injection = Injection(fleet)

    plugin = StepwisePlugin(LossConfig(), max_tokens_per_microbatch=256)
    plugins = {
        "megatron_t": StepwisePlugin(LossConfig(), max_tokens_per_microbatch=256, temperature=TEMPERATURE),
        "megatron_t1": plugin,
    }
    results: dict = {"disk_versions": []}
    syncers: dict = {}
    version = 0
    for tag, tp, pp in LAYOUTS:
        runtime.init_distributed(tp, pp, seed=1)
        chunks = M.build_model_chunks(cfg)
        if not syncers:  # one per mode, kept across layouts (the distributed group is opened once)
            syncers = {
                mode: WeightSync(fleet, mode, cfg, loop=loop, bucket_mb=0.05, sync_dir=out / "weights")
                for mode in MODES
            }
        for mode in MODES:
            version += 1
            W.init_deterministic(chunks, seed=version)  # new weights: each push must carry them
            box = [None]
            if rank == 0:
                stale = generate(loop, fleet, PROMPT)  # before the push: still the old weights
                box = [stale.output_ids]
            dist.broadcast_object_list(box, src=0)
            before = megatron_logprobs(plugin, chunks, PROMPT, box[0])
            asked = injection.verify_requests if rank == 0 else 0
            metrics = syncers[mode].push(chunks, version)
            if rank == 0:
                metrics["verify_requests"] = injection.verify_requests - asked
                result = generate(loop, fleet, PROMPT)
                box = [(result.output_ids, result.logprobs, result.weight_version)]
            dist.broadcast_object_list(box, src=0)
            output_ids, engine_logprobs, engine_version = box[0]
            ours = megatron_logprobs(plugin, chunks, PROMPT, output_ids)
            if rank == 0:
                if mode == "disk":
                    results["disk_versions"].append(version)
                results[f"{tag}/{mode}"] = {
                    "version": version,
                    "engine_version": engine_version,
                    "engine": engine_logprobs,
                    "megatron": ours.tolist(),
                    "stale_engine": stale.logprobs,
                    "stale_megatron": before.tolist(),
                    "metrics": metrics,
                }
            if mode == "tensor":
                case = sampled_case(loop, fleet, rank, plugins, chunks)
                if rank == 0:
                    results[f"{tag}/sampled"] = case
            dist.barrier()
        for mode in MODES:  # after the pushes above, so their versions stay as they were
            version += 1
            case = injected_case(injection, rank, syncers[mode], chunks, mode, version)
            if rank == 0:
                results[f"{tag}/{mode}/injected"] = case
                if mode == "disk":
                    results["disk_versions"].append(version)
            dist.barrier()
        if tag == "pp2":
            case = corrupted_case(loop, fleet, rank, syncers, chunks, cfg, version)
            if rank == 0:
                results["pp2/corrupted"] = case
            dist.barrier()
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))
        (out / "weights_listing.json").write_text(json.dumps(sorted(p.name for p in (out / "weights").iterdir())))
        loop.run_until_complete(fleet.shutdown())
    for s in syncers.values():
        s.close()


if __name__ == "__main__":
    run_worker(main)
