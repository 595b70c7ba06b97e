"""`megatron-stepwise train CONFIG [key=value ...]`: run an experiment.

Started without a launcher, it launches itself under torchrun with `launch.nproc_per_node`
processes (single node); under torchrun or srun it is one training rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from megatron_stepwise.config.commands import add_config_arguments

    p = sub.add_parser("train", help="run an RL experiment (self-launches torchrun when needed)")
    add_config_arguments(p)
    p.set_defaults(func=_main)


def _under_launcher() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def _main(args: argparse.Namespace) -> int:
    from megatron_stepwise.config.commands import load_or_report

    cfg = load_or_report(args)
    if cfg is None:
        return 2
    nproc = cfg.launch.nproc_per_node * cfg.launch.nnodes
    if not _under_launcher() and nproc > 1:
        if cfg.launch.nnodes > 1:
            print("error: launch.nnodes > 1: start the job with launch/train_slurm.sbatch (or torchrun on each node)",
                  file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megatron_stepwise.cli", "train", args.config, *args.overrides]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        print("launching:", " ".join(cmd), flush=True)
        return subprocess.call(cmd, env=env)
    return _train(cfg)


def _train(cfg) -> int:
    import logging

    from megatron_stepwise.megatron.runtime import silence_megatron_noise

    silence_megatron_noise()
    from megatron_stepwise.trainer import Trainer

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron_stepwise").setLevel(logging.INFO)  # megatron-core's INFO is set-up noise
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    return 0
