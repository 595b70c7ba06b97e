"""Rollout routing replay (R3) for MoE RL: the trainer's routers use the engine's experts.

The engine reports, per token and MoE layer, the experts it chose; the steps and packed
micro-batches carry them (`routed_experts`, -1 = unknown), and with `algo.routing_replay: true`
each TopKRouter takes those experts instead of its own top-k wherever they are known, while the
gating weights stay the trainer's (so the router keeps its gradient). `install` gives each router
a `KnownPositionsReplay`; `replaying` sets its targets for exactly one forward pass.

Why (top-k is discontinuous), which positions are replayed, and how it hooks megatron-core 0.16:
docs/megatron.md, 'Rollout routing replay (R3)'; why not megatron's own replay API: 'Routing
replay mechanics'.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_stepwise.errors import UserError
from megatron_stepwise.mcore.train.routers import local_tokens, moe_routers, recomputation


class RoutingReplayError(UserError, ValueError):
    """Routing replay cannot run as configured (a layout, or data that does not fit the model)."""


class KnownPositionsReplay(RouterReplay):
    """One router's replay: the target experts where known, the router's own top-k elsewhere.

    `recorded_topk_idx` keeps the experts the last forward used (tests compare them with the
    engine's)."""

    def __init__(self):  # deliberately not registered in RouterReplay.global_router_replay_instances
        self.target_topk_idx: Optional[torch.Tensor] = None
        self.known: Optional[torch.Tensor] = None
        self.recorded_topk_idx: Optional[torch.Tensor] = None
        self.router_replay_action = None
        self.replay_backward_list: list = []
        self.record = False

    def set_targets(self, targets: Optional[torch.Tensor]) -> None:
        """long [tokens, topk] with -1 rows where unknown (None: route normally)."""
        if targets is None:
            self.target_topk_idx = self.known = None
        else:
            self.target_topk_idx, self.known = targets.clamp(min=0).long(), (targets >= 0).all(-1)

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: Optional[int] = None,
        group_topk: Optional[int] = None,
        default_compute_topk: Optional[Callable] = None,
    ):
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target_topk_idx is not None:
            target = self.target_topk_idx.to(indices.device)
            if target.shape != indices.shape:
                raise RoutingReplayError(
                    f"routing replay: the router routes {tuple(indices.shape)} (tokens, topk) but was given "
                    f"{tuple(target.shape)} replayed experts"
                )
            indices = torch.where(self.known.to(indices.device)[:, None], target, indices)
            probs = scores.gather(1, indices)
        if self.record:
            self.recorded_topk_idx = indices.detach().clone()
        return probs, indices


def install(gpt) -> list:
    """Give every router of one model chunk a `KnownPositionsReplay` (once); returns the routers.
    Replaces the RouterReplay megatron-core made for `moe_enable_routing_replay` (and drops it
    from megatron's global list, which would otherwise keep it alive)."""
    routers = getattr(gpt, "_stepwise_replay_routers", None)
    if routers is not None:
        return routers
    routers = moe_routers(gpt)
    for router in routers:
        if not isinstance(router.router_replay, KnownPositionsReplay):
            old = router.router_replay
            if old is not None and old in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(old)
            router.router_replay = KnownPositionsReplay()
    gpt._stepwise_replay_routers = routers
    return routers


def check_config(config) -> None:
    """Refuse the layouts replay cannot serve, naming the setting."""
    if getattr(config, "moe_router_fusion", False):
        raise RoutingReplayError("algo.routing_replay needs moe_router_fusion=False (the fused router has no replay)")
    recomputed = recomputation(config)
    if recomputed:
        raise RoutingReplayError(
            f"algo.routing_replay with activation recomputation of MoE layers ({recomputed}) is not supported: "
            "a recomputed router would not see its micro-batch's experts"
        )


@contextlib.contextmanager
def replaying(gpt, routed: Optional[torch.Tensor]):
    """Inside: the routers of model chunk `gpt` replay `routed` (int16 [S_local, layers, topk],
    -1 = unknown; None or a dense model: nothing happens)."""
    config = gpt.config
    if routed is None or not getattr(config, "num_moe_experts", None):
        yield
        return
    check_config(config)
    routers = install(gpt)
    routed = local_tokens(routed, config)
    for router in routers:
        layer = router.layer_number - 1  # global, 1-based: the engine reports every decoder layer
        if layer >= routed.size(1) or routed.size(2) != router.topk:
            raise RoutingReplayError(
                f"routing replay: routed experts of shape {tuple(routed.shape)} (tokens, layers, topk) do not cover "
                f"layer {layer} with top-{router.topk}"
            )
        router.router_replay.set_targets(routed[:, layer].to(next(router.parameters()).device))
    try:
        yield
    finally:
        for router in routers:
            router.router_replay.set_targets(None)


def for_microbatch(gpt, mb):
    """`replaying` for one packed micro-batch: its experts when the model config enables replay
    (`moe_enable_routing_replay`, from `algo.routing_replay`) and the mini-batch carries them."""
    enabled = getattr(gpt.config, "moe_enable_routing_replay", False)  # `replaying` skips dense models
    return replaying(gpt, getattr(mb, "routed_experts", None) if enabled else None)


def record_routing(gpt, on: bool = True) -> list:
    """Keep, per router, the experts its last forward used (`router.router_replay.recorded_topk_idx`,
    long [tokens, topk]); returns the routers in layer order. For tests and diagnostics."""
    routers = install(gpt)
    for router in routers:
        router.router_replay.record = on
    return sorted(routers, key=lambda r: r.layer_number)
