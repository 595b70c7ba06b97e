"""torchrun worker for tests/integration/test_convert_distributed.py (2 processes).

For each layout (TP2, then PP2, then EP2 for MoE checkpoints, in the same processes) and each HF
checkpoint under --hf-root:
import_hf into real DDP-wrapped megatron chunks, export_hf to a directory, stream the buckets to
rank 0 (small buckets, so several per stage) and, at PP1, megatron's own forward logits for a
fixed sequence. Rank 0 writes what it got under --out; the test compares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from worker_entry import run_worker

from megatron_stepwise.mcore.runtime import runtime
from megatron_stepwise.mcore.train import model as M
from megatron_stepwise.mcore.weights import convert

SEQUENCE = [3, 17, 42, 7, 99, 128, 5, 250, 11, 64, 1, 200]


def megatron_logits(chunks, tokens: list[int]) -> torch.Tensor:
    """Full-vocabulary logits [S, V] of megatron's forward (TP-gathered), PP1 only."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    model = chunks[0]
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([tokens])
        logits = model(ids, torch.arange(len(tokens))[None], None)
    return gather_from_tensor_model_parallel_region(logits)[0].float()


def bad_inputs(hf_root: Path, out: Path) -> dict:
    """User mistakes raise the same clear error on every rank (no rank left waiting)."""
    errors = {}
    qwen = M.build_model_chunks(json.loads((hf_root / "qwen2-untied" / "config.json").read_text()))
    try:
        convert.import_hf(qwen, hf_root / "llama-tied")
    except convert.WeightConversionError as e:
        errors["import_mismatch"] = str(e)
    try:
        convert.export_hf(
            qwen, hf_root / "qwen2-untied", json.loads((hf_root / "qwen2-untied" / "config.json").read_text())
        )
    except convert.WeightConversionError as e:
        errors["export_non_empty"] = str(e)
    alive = torch.ones(1)
    dist.all_reduce(alive)
    errors["alive_ranks"] = int(alive.item())
    return errors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None)
    args = p.parse_args()
    out = Path(args.out)
    report = {}
    for tp, pp, ep in [(2, 1, 1), (1, 2, 1), (1, 1, 2)]:
        layout = runtime.init_distributed(tp, pp, expert_parallel=ep, seed=1)
        for src in sorted(Path(args.hf_root).iterdir()):
            cfg = json.loads((src / "config.json").read_text())
            if ep > 1 and not (cfg.get("num_experts") or cfg.get("num_local_experts")):
                continue  # expert parallelism: MoE checkpoints only
            tag = f"{src.name}-tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "")
            chunks = M.build_model_chunks(cfg)
            convert.import_hf(chunks, src)
            convert.export_hf(chunks, out / tag, cfg, tokenizer=args.tokenizer)
            streamed, n_buckets = {}, 0
            for bucket in convert.stream_hf_buckets(chunks, M.arch_from_hf(cfg), bucket_mb=0.05):
                streamed.update(bucket)
                n_buckets += 1
            if layout.rank == 0:
                from safetensors.torch import save_file

                save_file(streamed, str(out / f"{tag}-streamed.safetensors"))
                report[tag] = {"buckets": n_buckets}
            if pp == 1:
                logits = megatron_logits(chunks, SEQUENCE)
                if layout.rank == 0:
                    torch.save(logits, out / f"{tag}-logits.pt")
            dist.barrier()
        if tp == 2:
            report["errors"] = bad_inputs(Path(args.hf_root), out)
    if dist.get_rank() == 0:
        (out / "report.json").write_text(json.dumps(report))
    runtime.destroy_distributed()


if __name__ == "__main__":
    run_worker(main)
