"""MoE router losses in the step-wise loss: load balancing and z-loss, invariant to every split.

megatron-core's router losses are per micro-batch, so they change with packing and DP/CP
splits. Here both terms are functions of each step's own tokens, summed with mini-batch-wide
normalisers fixed before the schedule runs: balance (`algo.loss.router_aux_coef`, per row like
DeepSeek-V3's sequence-wise loss) and z-loss (`algo.loss.router_z_coef`, ST-MoE). The gradient
enters through `MoEAuxLossAutoScaler`, weighted like the policy loss. Statistics are reduced
once per mini-batch into `moe/aux_loss`, `moe/z_loss`, `moe/expert_load_max|min`.

Formulas, split invariance and metrics: docs/megatron.md, 'Router losses and expert-load metrics';
the auto-scaler's scale: 'Router loss formulas'.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_stepwise.mcore.runtime.runtime import comm_device
from megatron_stepwise.mcore.train.routers import local_tokens, moe_routers, recomputation


@dataclass
class RoutedMicroBatch:
    """What the routers need to know about the micro-batch being run."""

    token_segment: torch.Tensor  # long [S_local]: micro-batch row of each packed position, -1 = padding
    row_tokens: torch.Tensor  # long [rows]: real tokens of each row (whole row, all CP ranks)
    minibatch_rows: int  # rows in the whole mini-batch (all DP ranks)
    minibatch_tokens: int  # real tokens in the whole mini-batch
    loss_scale: float  # the policy loss's micro-batch scale (undoes megatron's averaging)


def install(gpt) -> bool:
    """Wrap the routers of one model chunk (once); False when it has none (a dense model)."""
    routers = moe_routers(gpt)
    for router in routers:
        if not getattr(router, "_stepwise_wrapped", False):
            router.routing = functools.partial(_routing, router, router.routing)
            router._stepwise_wrapped = True
    return bool(routers)


def check_recompute(config) -> None:
    """Refuse the recompute settings that re-run routers (`routers.recomputation`)."""
    recomputed = recomputation(config)
    if recomputed:
        raise ValueError(
            f"algo.loss.router_aux_coef / router_z_coef with activation recomputation of MoE layers ({recomputed}) "
            "is not supported: recompute other modules, or set the router coefficients to 0"
        )


# The micro-batch whose forward is running, and the RouterLosses that set it. The routers are
# wrapped once per model, but any number of plugins may drive that model (one for log-probs, one
# for training...): each forward reports to the one running it.
_RUNNING: contextvars.ContextVar = contextvars.ContextVar("stepwise_router_losses", default=None)


class RouterLosses:
    """Adds the balance and z losses to the backward of the micro-batch set by `running(...)`, and
    keeps their statistics, through the routers `install` wrapped."""

    def __init__(self, aux_coef: float = 0.0, z_coef: float = 0.0):
        if aux_coef < 0 or z_coef < 0:
            raise ValueError(f"router loss coefficients must be >= 0, got aux={aux_coef}, z={z_coef}")
        self.aux_coef, self.z_coef = float(aux_coef), float(z_coef)
        self._stats: dict[int, torch.Tensor] = {}  # layer number -> [aux, z, tokens per expert...] float64

    @property
    def active(self) -> bool:
        return bool(self.aux_coef or self.z_coef)

    @contextlib.contextmanager
    def running(self, mb: Optional[RoutedMicroBatch]):
        """The micro-batch whose forward runs inside (None: routers add nothing, e.g. log-probs)."""
        token = _RUNNING.set(None if mb is None else (self, mb))
        try:
            yield
        finally:
            _RUNNING.reset(token)

    def clear(self) -> None:
        """Forget the statistics gathered so far (a host loop that never reduced them)."""
        self._stats = {}

    # ----------------------------------------------------------------- the wrapped routing
    def add_losses(
        self, router, mb: RoutedMicroBatch, logits: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> torch.Tensor:
        """This micro-batch's router losses for one layer, attached to `probs`; statistics kept."""
        experts = router.config.num_moe_experts
        logits = logits.reshape(-1, experts).float()
        segment = local_tokens(mb.token_segment, router.config).to(logits.device)
        if segment.numel() != logits.size(0):
            raise RuntimeError(
                f"router saw {logits.size(0)} tokens but the micro-batch has {segment.numel()} on this rank"
            )
        valid = torch.nonzero(segment >= 0).flatten()  # padding positions are not tokens of any row
        seg, logits = segment[valid], logits[valid]
        rows = int(mb.row_tokens.numel())
        routed = routing_map.reshape(-1, experts)[valid].to(torch.float64)
        counts = torch.zeros(rows, experts, dtype=torch.float64, device=logits.device).index_add_(0, seg, routed)
        counts = _sum_over_token_split(counts, router.config)
        scores = torch.softmax(logits, dim=-1)
        prob_sums = torch.zeros(rows, experts, dtype=scores.dtype, device=logits.device).index_add_(0, seg, scores)
        row_tokens = mb.row_tokens.to(device=logits.device, dtype=torch.float64)
        per_row = experts / (router.topk * row_tokens.clamp(min=1) ** 2)
        balance = ((counts * per_row[:, None]).to(scores.dtype) * prob_sums).sum() / max(mb.minibatch_rows, 1)
        z = (torch.logsumexp(logits, dim=-1) ** 2).sum() / max(mb.minibatch_tokens, 1)
        self._record(router.layer_number, balance, z, routed.sum(0))
        if self.active:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            loss = (self.aux_coef * balance + self.z_coef * z) * mb.loss_scale
            probs = MoEAuxLossAutoScaler.apply(probs, loss)
        return probs

    def _record(self, layer: int, balance: torch.Tensor, z: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        row = torch.cat([torch.stack([balance.detach(), z.detach()]).double().cpu(), tokens_per_expert.detach().cpu()])
        self._stats[layer] = self._stats[layer] + row if layer in self._stats else row

    # ----------------------------------------------------------------- metrics
    def reduce(self, config) -> dict[str, float]:
        """The mini-batch's router metrics for a model of `config`, identical on every rank (a
        collective over the world for a MoE model: every rank must call it); statistics reset."""
        from megatron.core import parallel_state as ps

        if not config.num_moe_experts:
            return {}
        table = torch.zeros(config.num_layers, 2 + config.num_moe_experts, dtype=torch.float64)
        # Without sequence parallelism every TP rank routes the same tokens: count them once.
        replicated = config.tensor_model_parallel_size > 1 and not config.sequence_parallel
        if not (replicated and ps.get_tensor_model_parallel_rank() != 0):
            for layer, row in self._stats.items():
                table[layer - 1] += row  # layer numbers are global and 1-based
        self._stats = {}
        if dist.is_initialized() and dist.get_world_size() > 1:
            buf = table.to(comm_device())
            dist.all_reduce(buf)
            table = buf.cpu()
        tokens = table[:, 2:]
        moe = tokens.sum(1) > 0
        if not bool(moe.any()):
            return {}
        load = tokens[moe] / tokens[moe].mean(1, keepdim=True)
        return {
            "moe/aux_loss": float(table[moe, 0].mean()),
            "moe/z_loss": float(table[moe, 1].mean()),
            "moe/expert_load_max": float(load.max()),
            "moe/expert_load_min": float(load.min()),
        }


def _routing(router, routing, logits: torch.Tensor, *args, **kwargs):
    """megatron's `TopKRouter.routing`, then the running micro-batch's losses (training only)."""
    probs, routing_map = routing(logits, *args, **kwargs)
    running = _RUNNING.get()
    if running is not None and router.training and torch.is_grad_enabled():
        losses, mb = running
        probs = losses.add_losses(router, mb, logits, probs, routing_map)
    return probs, routing_map


def _sum_over_token_split(counts: torch.Tensor, config) -> torch.Tensor:
    """Sum per-row counts over the ranks that hold parts of the same rows: CP, and TP under
    sequence parallelism."""
    from megatron.core import parallel_state as ps

    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        group = ps.get_tensor_and_context_parallel_group()
    elif ps.get_context_parallel_world_size() > 1:
        group = ps.get_context_parallel_group()
    else:
        return counts
    if dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts
