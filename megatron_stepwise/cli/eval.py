"""`megatron-stepwise eval CONFIG [--checkpoint PATH | --hf DIR]`: evaluate a policy, no training.

The policy: an HF directory (`--hf`, e.g. `<run_dir>/hf` of `checkpoint.export_hf`), a Megatron
checkpoint (`--checkpoint`, a `iter_*` directory or a checkpoint directory's latest; loaded in
this process at TP1/PP1 and converted), by default the run's latest checkpoint, else
`model.hf_checkpoint` or the random init. It is served by one embedded engine in this process
and evaluated on every eval set with the `eval` section's settings (offline/evaluate.py). The
metrics are printed and written, with every set's rewards by prompt ("outcomes"), to
`<run_dir>/eval/<name>.json` (name: `iter_<N>`, the HF directory's, or `initial`).
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from megatron_stepwise.cli.config import add_config_arguments

    p = sub.add_parser("eval", help="evaluate a checkpoint or an HF directory on the eval sets (no training)")
    add_config_arguments(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="a Megatron checkpoint (iter_* directory, or a directory of them)")
    src.add_argument("--hf", help="an HF model directory (safetensors)")
    p.add_argument("--out", help="where to write the metrics JSON (default <run_dir>/eval/<source>.json)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from megatron_stepwise.cli.config import load_or_report
    from megatron_stepwise.offline.evaluate import evaluate, single_process_layout, write_result

    args.world_size = 1  # one process: the layout is checked for it
    args.overrides = [*args.overrides, *single_process_layout()]
    cfg = load_or_report(args)
    if cfg is None:
        return 2
    try:  # a CheckpointError or another UserError ends in cli/main.py, with the same one line
        metrics, source, iteration, outcomes = evaluate(cfg, checkpoint=args.checkpoint, hf=args.hf)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or str(cfg.rundir.eval_result(source))
    write_result(out, metrics, source, iteration, outcomes)
    for key in sorted(metrics):
        print(f"{key:40s} {metrics[key]:.4f}")
    print(f"metrics: {out}")
    return 0
