"""torchrun worker for tests/integration/test_real_model.py (3 processes): a pretrained model's
weights in real megatron-core chunks at TP1 (DP3), TP3 and PP3 (SmolLM2 has 9 attention heads and
3 KV heads: TP2 cannot split them, TP3 can; PP3 puts 10 of its 30 layers on each stage).

For each layout: import_hf from --hf-dir, the plugin's forward-only log-probs of the case's
response tokens (the path the trainer uses for old/reference log-probs), written by rank 0. At
TP1 also the full logits of the whole sequence and an export_hf of the chunks, for the export
round trip.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from worker_entry import run_worker

from megatron_stepwise.algo.losses import LossConfig
from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.mcore.weights import convert
from megatron_stepwise.steps import Step, TrajectoryID

LAYOUTS = [(1, 1), (3, 1), (1, 3)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--case", required=True, help="json: prompt ids, response ids")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out, hf_dir = Path(args.out), Path(args.hf_dir)
    case = json.loads(Path(args.case).read_text())
    cfg = json.loads((hf_dir / "config.json").read_text())
    step = Step(TrajectoryID("p0", 0), case["prompt"], case["response"], [1] * len(case["response"]), is_last_step=True)
    plugin = StepwisePlugin(LossConfig(), max_tokens_per_microbatch=4096)
    for tp, pp in LAYOUTS:
        layout = runtime.init_distributed(tp, pp, seed=1)
        chunks = M.build_model_chunks(cfg)
        convert.import_hf(chunks, hf_dir)
        logprobs = plugin.compute_logprobs(chunks, [step])[0]
        if layout.rank == 0:
            torch.save(logprobs, out / f"logprobs-tp{tp}pp{pp}.pt")
        if tp == 1 and pp == 1:
            model = chunks[0]
            model.eval()
            ids = case["prompt"] + case["response"]
            with torch.no_grad():
                logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0].float()
            if layout.rank == 0:
                torch.save(logits, out / "logits-tp1pp1.pt")
            convert.export_hf(chunks, out / "export", cfg)
        del chunks
        dist.barrier()
    runtime.destroy_distributed()


if __name__ == "__main__":
    run_worker(main)
