"""`megatron-stepwise train CONFIG [key=value ...]`: run an experiment.

Started without a launcher, it launches itself under torchrun with `launch.nproc_per_node`
processes (single node); under torchrun or srun it is one training rank.

One trainer per run directory: global rank 0 holds `<run_dir>/trainer.lock` for the run (the
self-launcher checks it before starting torchrun); a second trainer is refused with exit code 2.
Every rank dies with its launcher (`lifecycle.die_with_launcher`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from megatron_stepwise.errors import RunFailure, UserError


def register(sub: argparse._SubParsersAction) -> None:
    from megatron_stepwise.cli.config import add_config_arguments

    p = sub.add_parser("train", help="run an RL experiment (self-launches torchrun when needed)")
    add_config_arguments(p)
    p.set_defaults(func=_main)


def _under_launcher() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def _main(args: argparse.Namespace) -> int:
    from megatron_stepwise.cli.config import load_or_report

    cfg = load_or_report(args)
    if cfg is None:
        return 2
    nproc = cfg.launch.nproc_per_node * cfg.launch.nnodes
    if not _under_launcher() and nproc > 1:
        if cfg.launch.nnodes > 1:
            print(
                "error: launch.nnodes > 1: start the job with launch/train_slurm.sbatch (or torchrun on each node)",
                file=sys.stderr,
            )
            return 2
        from megatron_stepwise.rundir.lifecycle import (
            LAUNCHER_PID_ENV,
            LOCK_WAIT_S,
            RUN_DIR_ENV,
            HeldLocks,
            run_locks,
            run_torchrun,
        )
        from megatron_stepwise.rundir.torchrun import single_node_args

        # refuse before torchrun starts (RunDirLocked, a UserError); rank 0 takes the locks itself
        HeldLocks(run_locks(cfg.run_dir, cfg.checkpoint_dir)).probe(LOCK_WAIT_S)
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks die with this process
        os.environ.setdefault("MEGATRON_STEPWISE_COMMAND", json.dumps(sys.argv))  # recorded in run.json
        os.environ[RUN_DIR_ENV] = os.path.abspath(cfg.run_dir)
        torchrun = [
            *single_node_args(),  # the rendezvous store on loopback only
            f"--nproc-per-node={nproc}",
            "-m",
            "megatron_stepwise.cli",
            "train",
            args.config,
            *args.overrides,
        ]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print(
            f"launching: torchrun {' '.join(torchrun)}\n(working directory: {os.getcwd()}; relative paths in the "
            "config resolve here, as with launch/train_local.sh)",
            flush=True,
        )
        return run_torchrun(torchrun)
    return _train(cfg)


def _command_line() -> list[str]:
    """The command the user typed (the self-launcher's, when torchrun started this rank)."""
    launcher = os.environ.get("MEGATRON_STEPWISE_COMMAND")
    return json.loads(launcher) if launcher else list(sys.argv)


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def interrupted_line(cfg) -> str:
    """The one line an interrupted run ends with: the checkpoint the same command resumes from."""
    from megatron_stepwise.mcore.weights.checkpoint_dir import find_latest

    latest = find_latest(cfg.checkpoint_dir)
    if cfg.checkpoint.resume == "never":
        where = "checkpoint.resume=never: rerunning starts over"
    elif latest is None:
        where = f"no checkpoint in {cfg.checkpoint_dir} yet: rerunning starts from iteration 0"
    else:
        where = f"rerun the same command to resume from {latest}"
    return f"interrupted: {where}"


def _end_with_failure(line: str) -> int:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return 1


def _train(cfg) -> int:
    import logging

    from megatron_stepwise.rundir.lifecycle import (
        LOCK_WAIT_S,
        RUN_DIR_ENV,
        HeldLocks,
        die_with_launcher,
        run_locks,
    )

    if _under_launcher():
        die_with_launcher()
    rank = int(os.environ.get("RANK", "0"))
    lock = HeldLocks(run_locks(cfg.run_dir, cfg.checkpoint_dir))
    if rank == 0:
        lock.acquire(LOCK_WAIT_S)  # RunDirLocked, a UserError: cli/main.py ends the command with its line
        os.environ.setdefault(RUN_DIR_ENV, os.path.abspath(cfg.run_dir))  # inherited by Ray's processes

    from megatron_stepwise.mcore.runtime.runtime import silence_megatron_noise

    silence_megatron_noise()
    from megatron_stepwise.loop.trainer import Trainer

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron_stepwise").setLevel(logging.INFO)  # megatron-core's INFO is set-up noise
    if rank == 0:
        from megatron_stepwise.rundir.record import log_to_run_dir

        log_to_run_dir(cfg.run_dir)
    trainer = None
    try:
        trainer = Trainer(cfg)
        if rank == 0:  # after a resume was accepted: the record is of the config that runs
            from megatron_stepwise.rundir.record import write_run_record

            write_run_record(cfg.run_dir, cfg.to_yaml(), _command_line())
        trainer.run()
    except KeyboardInterrupt:  # Ctrl-C: one line saying where a rerun resumes, not every thread's traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards the signal again: let cleanup finish
        if rank == 0:
            sys.stderr.write(interrupted_line(cfg) + "\n")
            sys.stderr.flush()
        return EXIT_INTERRUPTED
    except UserError as e:  # bad input: its line now, before the cleanup (which may wait on the other ranks)
        from megatron_stepwise.cli.main import end_with_user_error

        return end_with_user_error(e)
    except RunFailure as e:  # named by the code that met it: one line per rank, the checkpoint stands
        return _end_with_failure(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}")
    except BaseException as e:  # the fleet lost every engine: its cause in one line, not the trajectories'
        from megatron_stepwise.rollout.engines.protocol import engine_loss

        lost = engine_loss(e)
        if lost is None:
            raise
        return _end_with_failure(f"error: {lost}")
    finally:
        try:
            if trainer is not None:
                trainer.close()
        finally:
            lock.release()
    return 0
