"""Re-tokenisation drift with real vocabularies and chat templates (prints measured figures).

The real agent loop in `retokenize` mode runs scripted multi-turn trajectories
(tools/chat_families.py: tool calls and results, user follow-ups, `<think>` blocks, endings on
the end-of-turn token, a stop string or the length limit) whose sampled ids are the tokenizer's
own encoding of natural text (English, accented, CJK, emoji, code), except a chosen share of
turns in which one token is split in two, as a sampling model may do. For each family and share
it reports `rollout/retokenize_drift_rate` (turn boundaries whose re-tokenised chat lost the
sampled ids) and what caused each flagged boundary: non-canonical ids (the split, or a length
cut through a multi-byte character) or the chat template re-rendering the history (Qwen3 and
DeepSeek drop or move reasoning, Llama 3.1 trims replies, GLM re-wraps them).

    STEPWISE_TOKENIZERS_SRC=<extracted llama.cpp-tokenizers> python tools/bench/bench_drift_real.py \
        [--trajectories 300] [--shares 0,0.05,0.3] [--families qwen2.5-instruct,llama-3.1-instruct]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: chat_families

import chat_families  # noqa: E402

from megatron_stepwise.hf.end_of_turn import end_of_turn  # noqa: E402
from megatron_stepwise.hf.tokenizers import load_tokenizer  # noqa: E402


def measure(tok, fam, share: float, n: int, seed: int) -> dict:
    eot = end_of_turn(tok)
    script = chat_families.Scripted(tok, fam, eot, n, seed=seed, noncanonical_share=share)
    runs = chat_families.run_loop(tok, script, eot, "retokenize")
    boundaries = flagged = noncanonical = template = 0
    for i, steps in runs.items():
        for k, step in enumerate(steps[:-1]):
            sampled = script.ids[i][k][0]
            boundaries += 1
            if not step.metadata["retokenize_drift"]:
                continue
            flagged += 1
            if tok(tok.decode(sampled), add_special_tokens=False)["input_ids"] != sampled:
                noncanonical += 1
            else:
                template += 1
    return {
        "boundaries": boundaries,
        "drift_rate": flagged / max(1, boundaries),
        "noncanonical": noncanonical / max(1, boundaries),
        "template": template / max(1, boundaries),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=300, help="scripted trajectories per family and share")
    p.add_argument("--shares", default="0,0.05,0.3", help="shares of turns with one token split in two")
    p.add_argument("--families", default=",".join(chat_families.FAMILIES), help="comma-separated families")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    src = os.environ.get("STEPWISE_TOKENIZERS_SRC")
    if not src:
        print("error: set STEPWISE_TOKENIZERS_SRC to the extracted llama.cpp-tokenizers folder", file=sys.stderr)
        return 2
    shares = [float(s) for s in args.shares.split(",")]
    print(
        f"{'family':26s} {'split share':>11s} {'boundaries':>10s} {'drift rate':>10s} "
        f"{'non-canonical':>13s} {'template':>8s}"
    )
    with tempfile.TemporaryDirectory() as out:
        for name in args.families.split(","):
            tok = load_tokenizer(str(chat_families.build_family(name, src, out)))
            for share in shares:
                r = measure(tok, chat_families.FAMILIES[name], share, args.trajectories, args.seed)
                print(
                    f"{name:26s} {share:11.2f} {r['boundaries']:10d} {r['drift_rate']:10.3f} "
                    f"{r['noncanonical']:13.3f} {r['template']:8.3f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
