"""Rank 0 reports every TCP socket its torchrun agent and the ranks listen on, after gloo is up."""

from __future__ import annotations

import json
import os

import psutil
import torch.distributed as dist
from worker_entry import run_worker


def listening(pid: int) -> list[str]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN)


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    mine = listening(os.getpid())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        report = {"agent": listening(os.getppid()), "ranks": everyone, "master_addr": os.environ["MASTER_ADDR"]}
        print("LISTENING " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_worker(main)
