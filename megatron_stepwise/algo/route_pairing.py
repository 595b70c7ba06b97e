"""Provenance check: each trained token's route and log-prob came from one forward pass.

The log-prob of the token at row position q is computed from the logits at position q - 1, by
the forward pass that ran position q - 1; routing replay gives the trainer's routers, at q - 1,
the experts recorded for that position. Both must be that same forward's, or the trainer
replays a routing the engine never used for that token (a retract that re-recorded earlier
positions, a continuation that overwrote them, a merge that took another turn's routes).
Steps carry the ids (`Step.route_forwards`, `Step.logprob_forwards`); this compares them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_stepwise.steps import StepBatch


@dataclass
class RoutePairing:
    """`checked`: trained tokens whose route and log-prob forwards are both known; `unknown`:
    trained tokens where either is not; `mismatches`: (row, response token index, log-prob
    forward, route forward) of the first `limit` trained tokens whose ids differ; `total_mismatches`
    counts them all."""

    checked: int = 0
    unknown: int = 0
    total_mismatches: int = 0
    mismatches: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.total_mismatches == 0


def check_route_pairing(batch: StepBatch, limit: int = 20) -> RoutePairing:
    """Compare `logprob_forwards[q]` with `route_forwards[q - 1]` at every trained token q."""
    out = RoutePairing()
    routes, logprobs = batch.token_fields.get("route_forwards"), batch.token_fields.get("logprob_forwards")
    trained = batch.token_fields["loss_mask"] != 0
    if routes is None or logprobs is None:
        out.unknown = int(trained.sum())
        return out
    starts = batch.offsets[:-1] + batch.prompt_lens  # first response position of every row
    row_start = torch.repeat_interleave(batch.offsets[:-1], batch.lengths)
    position = torch.arange(batch.tokens.numel())
    trained &= position > row_start  # (a row's first token has no position before it)
    previous = torch.roll(routes, 1)
    known = trained & (previous >= 0) & (logprobs >= 0)
    out.checked = int(known.sum())
    out.unknown = int((trained & ~known).sum())
    bad = torch.nonzero(known & (previous != logprobs)).flatten()
    out.total_mismatches = int(bad.numel())
    rows = batch.row_of_token()
    for i in bad[:limit].tolist():
        r = int(rows[i])
        out.mismatches.append((r, i - int(starts[r]), int(logprobs[i]), int(previous[i])))
    return out


def describe_mismatches(pairing: RoutePairing, batch: StepBatch, where: str = "") -> list[str]:
    """One line per recorded mismatch, naming the row, its trajectory and the response token."""
    return [
        f"{where}row {r} (trajectory {batch.trajectory_ids[r]}), response token {k}: its log-prob came from "
        f"forward {lp}, the route of the position before it from forward {route}"
        for r, k, lp, route in pairing.mismatches
    ]
