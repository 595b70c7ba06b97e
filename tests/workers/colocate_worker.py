"""Worker of tests/integration/test_colocate.py: the real `Trainer` on one CPU rank, twice (without and with
`rollout.colocate`), its fleet one in-process embedded engine that records every call.

    python tests/workers/colocate_worker.py OUT_JSON RUN_ROOT

Writes, per mode, the recorded calls (generate collapsed into runs), the metrics of every
iteration and the engine's final weights (as lists) to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys

from worker_entry import run_worker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERATIONS = 3


class RecordingFleet:
    """The fleet surface the trainer uses, over one `LocalEngine`, recording each call in `log`."""

    def __init__(self, engine, log: list):
        self.engine, self.log = engine, log
        self.weight_version = 0

    def _record(self, name: str) -> None:
        if not (name == "generate" and self.log and self.log[-1] == "generate"):
            self.log.append(name)

    async def wait_ready(self):
        return await self.engine.health()

    def metrics(self):
        return {"weight_version": self.weight_version}

    async def generate(self, input_ids, sampling, rid=None, session=None):
        self._record("generate")
        return await self.engine.generate(input_ids, sampling, rid=rid, session=session)

    async def update_weights_from_tensors(self, named_tensors, weight_version=None, *, sample_weights=False):
        self._record("update")
        answer = await self.engine.update_weights_from_tensors(named_tensors, weight_version, sample_weights)
        if not sample_weights:  # the version; sampled (weight_sync.verify): the engines' answers
            self.weight_version = answer
            return answer
        self.weight_version = answer["weight_version"]
        return [{"index": 0, **answer}]

    async def verify_weights(self, checks, weight_version):
        return [{"index": 0, **await self.engine.verify_weights(checks, weight_version)}]

    async def release_memory_occupation(self, tags=None):
        self._record("release(" + ",".join(sorted(tags)) + ")")
        await self.engine.release_memory_occupation(tags)

    async def resume_memory_occupation(self, tags=None):
        self._record("resume(" + ",".join(sorted(tags)) + ")")
        await self.engine.resume_memory_occupation(tags)

    async def shutdown(self):
        await self.engine.close()


def run_mode(colocate: bool, run_dir: str) -> dict:
    from megatron_stepwise.compose import components
    from megatron_stepwise.config import load_config
    from megatron_stepwise.hf.tokenizers import load_tokenizer
    from megatron_stepwise.loop.trainer import Trainer
    from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
    from megatron_stepwise.rollout.engines.embedded.hf_model import checkpoint_state

    cfg = load_config(
        os.path.join(REPO, "configs/tiny_cpu.yaml"),
        [
            f"logging.run_dir={run_dir}",
            "logging.progress=false",
            f"trainer.iterations={ITERATIONS}",
            "trainer.eval_every=0",
            "checkpoint.every=0",
            "checkpoint.resume=never",
            "launch.nproc_per_node=1",
            "rollout.num_engines=1",
            "data.prompts_per_iteration=4",
            "data.samples_per_prompt=4",
            "data.prompts_per_minibatch=2",
            f"rollout.colocate={str(colocate).lower()}",
        ],
        world_size=1,
    )
    log: list[str] = []
    engines = []

    def build_fleet(cfg, model, tokenizer):
        engine = LocalEngine(
            model.hf_config, tokenizer=load_tokenizer(components.tokenizer_name(cfg)), seed=7, torch_threads=1
        )
        engines.append(engine)
        return RecordingFleet(engine, log)

    components.build_fleet = build_fleet
    trainer = Trainer(cfg)
    train_step = trainer.training_round.step

    def recorded_train_step(shard):
        log.append("train")
        return train_step(shard)

    trainer.training_round.step = recorded_train_step
    try:
        history = trainer.run()
        engine = engines[0]
        weights = {k: v.tolist() for k, v in checkpoint_state(engine.model).items()}
    finally:
        trainer.close()
    keep = (
        "reward/mean",
        "train/loss",
        "train/grad_norm",
        "weight_version",
        "time/engine_release",
        "time/engine_resume",
        "train/logprob_gap_max",
    )
    return {"log": log, "metrics": [{k: m[k] for k in keep if k in m} for m in history], "weights": weights}


def main() -> None:
    out, root = sys.argv[1], sys.argv[2]
    result = {mode: run_mode(mode == "colocated", os.path.join(root, mode)) for mode in ("separate", "colocated")}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_worker(main)
