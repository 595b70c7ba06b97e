"""Rollout: the engines and where they run (SGLang servers, GPUs), async training, colocation."""

from __future__ import annotations

import re

from megatron_stepwise.config.checker import Checker
from megatron_stepwise.config.probes import Probes
from megatron_stepwise.config.schema import ExperimentConfig

SGLANG_INSTALL_HINT = "pip install 'megatron-stepwise[sglang]'"  # README says the same
_SERVER_RE = re.compile(r"^(https?://)?[A-Za-z0-9_.\-]+:\d{1,5}/?$")


def check_rollout(cfg: ExperimentConfig, check: Checker, probes: Probes) -> None:
    ro, sg, launch = cfg.rollout, cfg.rollout.sglang, cfg.launch
    for i, server in enumerate(sg.servers):
        if not _SERVER_RE.match(server):
            check.fail("rollout.sglang.servers", f"item {i} {server!r} is not host:port or http://host:port")
    if sg.router_url and not _SERVER_RE.match(sg.router_url):
        check.fail("rollout.sglang.router_url", f"{sg.router_url!r} is not http://host:port")
    if sg.router_url and cfg.algo.routing_replay:
        # sglang-router 0.3.x forwards /generate without return_routed_experts
        check.fail(
            "rollout.sglang.router_url",
            "routing replay (algo.routing_replay) needs the routed experts, "
            "which sglang-router drops; unset router_url (the fleet routes "
            "itself) or algo.routing_replay",
            "algo.routing_replay",
        )
    if ro.engine == "embedded":
        for key in ("servers", "router_url"):
            if getattr(sg, key):
                check.fail(
                    f"rollout.sglang.{key}",
                    "is set but rollout.engine is embedded; set rollout.engine=sglang to use SGLang servers",
                    "rollout.engine",
                )
        if ro.engine_tp != 1:
            check.fail(
                "rollout.engine_tp", "the embedded engine is one CPU process; engine_tp must be 1", "rollout.engine"
            )
        return
    # SGLang: either servers already running, or servers the fleet launches on GPUs.
    if sg.servers:
        if len(sg.servers) != ro.num_engines:
            check.fail(
                "rollout.num_engines",
                f"is {ro.num_engines} but rollout.sglang.servers lists {len(sg.servers)} servers",
                "rollout.sglang.servers",
            )
        return
    if sg.router_url:
        check.fail(
            "rollout.sglang.servers",
            "rollout.sglang.router_url is set but no servers are listed: weight updates go to every server directly",
            "rollout.sglang.router_url",
        )
        return
    if not probes.has_module("sglang"):
        check.fail(
            "rollout.engine",
            "sglang launches servers but the sglang package is not installed "
            f"({SGLANG_INSTALL_HINT}), and no running servers are "
            "listed in rollout.sglang.servers",
        )
    if launch.gpus_per_node and ro.engine_tp > launch.gpus_per_node:
        check.fail(
            "rollout.engine_tp",
            f"an engine cannot span nodes: engine_tp {ro.engine_tp} > launch.gpus_per_node {launch.gpus_per_node}",
            "launch.gpus_per_node",
        )
        return
    need, have = ro.num_engines * ro.engine_tp, launch.rollout_gpus()
    if ro.colocate:  # the engines share the training GPUs (and take any rollout-only node's)
        have = (launch.nnodes + launch.rollout_nodes) * launch.gpus_per_node
    if need > have:
        check.fail(
            "rollout.num_engines",
            f"{ro.num_engines} engines x engine_tp {ro.engine_tp} need {need} "
            f"GPUs but the launch layout leaves {have} to rollout (launch: "
            f"{launch.nnodes} training nodes with {launch.gpus_per_node} GPUs, "
            f"{launch.nproc_per_node} used for training, rollout_nodes "
            f"{launch.rollout_nodes})",
            "rollout.engine_tp",
            "launch.nnodes",
            "launch.gpus_per_node",
            "launch.nproc_per_node",
            "launch.rollout_nodes",
        )


def check_async(cfg: ExperimentConfig, check: Checker) -> None:
    a = cfg.async_
    if not a.enabled:
        return
    if a.max_staleness == 0:
        check.fail(
            "async.max_staleness",
            "0 allows no overlap of rollout and training; set async.enabled=false for synchronous training",
            "async.enabled",
        )
    if cfg.algo.loss.tis == "none":
        check.fail(
            "algo.loss.tis",
            "async.enabled=true trains on rollouts of older weights: set "
            "algo.loss.tis to token or sequence to correct for the policy lag",
            "async.enabled",
        )
    if cfg.data.epochs != 1:
        check.fail(
            "data.epochs",
            f"{cfg.data.epochs}: async.enabled=true trains each mini-batch once, as "
            "its groups arrive; set data.epochs=1",
            "async.enabled",
        )
    if a.pause_mode == "in_place" and cfg.rollout.engine != "embedded":
        check.fail(
            "async.pause_mode",
            f"in_place keeps a paused turn's KV as computed, which only the embedded engine does; "
            f"rollout.engine is {cfg.rollout.engine}: use retract or abort",
            "rollout.engine",
        )


def check_colocate(cfg: ExperimentConfig, check: Checker) -> None:
    ro = cfg.rollout
    if not ro.colocate:
        return
    if cfg.async_.enabled:
        check.fail(
            "rollout.colocate",
            "true gives the engines' memory to training between rollouts, so rollout "
            "cannot overlap training as async.enabled=true needs; set one of them "
            "to false",
            "async.enabled",
        )
    if ro.engine == "sglang" and cfg.weight_sync.mode == "distributed":
        check.fail(
            "rollout.colocate",
            "true puts an engine on the GPU of a training rank, and one NCCL group "
            "cannot hold two ranks on the same GPU: set weight_sync.mode=tensor "
            "(CUDA IPC handles) or disk",
            "weight_sync.mode",
        )
    launch = cfg.launch
    if ro.engine == "sglang" and cfg.weight_sync.mode == "tensor" and launch.nnodes + launch.rollout_nodes > 1:
        check.fail(
            "rollout.colocate",
            "true with weight_sync.mode=tensor sends CUDA IPC handles of rank 0's "
            "tensors, which only engines on rank 0's node can open; on "
            f"{launch.nnodes + launch.rollout_nodes} nodes set weight_sync.mode=disk",
            "weight_sync.mode",
            "launch.nnodes",
            "launch.rollout_nodes",
        )
