"""The multi-node path on two real hosts: two network namespaces of this machine (tools/two_nodes.sh)
with their own addresses and hostnames, sharing the filesystem as cluster nodes do.

Host a runs the Ray head (no CPUs for actors) and training rank 0; host b runs a Ray worker, training
rank 1, and so every engine and agent worker. torchrun rendezvouses across the hosts, rank 0's
replica fetches its rows from the workers on b, and the weight pushes cross the link. The run must
repeat the one-node run exactly. Needs root (as CI has); skips elsewhere, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import two_hosts
from two_hosts import REFERENCE_RUN, ray_cluster, start_training, wait_for

# Two Ray nodes and two launches (the one-node reference and the two-node run) on a 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

RUN = (*REFERENCE_RUN, "checkpoint.every=0")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_cluster(tmp_path_factory.mktemp("hosts")) as hosts_head_env:
        yield hosts_head_env


@pytest.fixture(scope="module")
def one_node_reference(tmp_path_factory):
    return two_hosts.one_node_reference(tmp_path_factory)


def _train_on_both(hosts, head: str, env: dict, run_dir: Path, *extra: str) -> None:
    """torchrun on each host (one rank each), rendezvousing at host a, as on two cluster nodes."""
    procs = start_training(hosts, head, env, run_dir, *RUN, *extra)
    for proc, host in zip(procs, "ab"):
        wait_for(lambda p=proc: p.poll() is not None, f"the training on host {host}", timeout_s=900)
    for proc, host in zip(procs, "ab"):
        log = (run_dir.parent / f"torchrun_{host}.log").read_text()
        assert proc.returncode == 0, f"host {host}:\n{log[-4000:]}"


@pytest.mark.parametrize("sync_mode", ["tensor", "disk", "distributed"])
def test_two_node_run_repeats_the_one_node_run(cluster, one_node_reference, tmp_path, sync_mode):
    """Each weight-sync mode across the hosts (the engines on b): through Ray, through the shared
    filesystem, through a process group between rank 0 on a and the engines on b."""
    hosts, head, env = cluster
    run_dir = tmp_path / "run"
    before = hosts.link_bytes()
    _train_on_both(hosts, head, env, run_dir, f"weight_sync.mode={sync_mode}")
    after = hosts.link_bytes()

    m = _metrics(run_dir)
    assert [r["iteration"] for r in m] == [r["iteration"] for r in one_node_reference]
    for r, ref in zip(m, one_node_reference):
        keys = [k for k in ref if k.startswith(("reward/", "eval/", "rollout/", "train/loss", "advantages/"))]
        assert keys and {k: r[k] for k in keys} == {k: ref[k] for k in keys}, r["iteration"]
        assert r["agents/rows_held"] == 1.0
        assert r["train/logprob_gap_max"] < 1e-4  # the engines on b sample from the trainer's weights

    # Where things ran: the driver on a; every engine and agent worker on b (a offers Ray no CPU).
    log = (run_dir / "train.log").read_text()
    a, b = hosts.ip["a"], hosts.ip["b"]
    assert f"placement: driver {a}; engines {b} x2; agent workers {b} x2" in log, log[:3000]
    assert json.loads((run_dir / "run.json").read_text())["starts"][0]["host"] == hosts.name["a"]

    # The link carried rank 0's share of the rows from b to a, every iteration.
    iterations = len(m)
    rows = sum(r["handoff/rows_fetched_bytes"] for r in m)
    moved = {h: {k: (after[h][k] - before[h][k]) / iterations for k in after[h]} for h in after}
    print(
        f"two hosts, per iteration: a received {moved['a']['received']:.0f} B, sent {moved['a']['sent']:.0f} B; "
        f"b received {moved['b']['received']:.0f} B, sent {moved['b']['sent']:.0f} B; rows fetched by a's "
        f"replica {rows / iterations:.0f} B; weight push {m[-1]['weight_sync/bytes']:.0f} B"
    )
    assert rows > 0 and moved["a"]["received"] >= rows / iterations
    assert moved["a"]["received"] == pytest.approx(moved["b"]["sent"], rel=0.01)  # one wire, two ends
