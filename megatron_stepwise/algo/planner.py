"""Micro-batch planning: balance rows across data-parallel ranks, then pack each rank's
rows into token-budget micro-batches.

A row of s tokens costs `s + attention_weight * s**2`; ranks are balanced on that cost
(greedy, then exchanges), then each rank's rows are spread over the fewest micro-batches every
rank can share. Deterministic: every tie is broken by row index. `plan_stats` reports the
computed tokens and the efficiency (real / computed).

The cost model's derivation, what counts as computed tokens, and the algorithm step by step:
docs/megatron.md, 'Micro-batch planning: cost model and algorithm'.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from megatron_stepwise.steps import StepwiseBatchError

DEFAULT_ATTENTION_WEIGHT = 1.0 / 24576

Plan = list[list[list[int]]]  # plan[rank][micro] -> row indices

_PARTNERS = 8  # lighter ranks tried per exchange round


def packed_lengths(lengths: torch.Tensor, cp: int) -> torch.Tensor:
    """Row lengths as packed: padded to a multiple of 2 * cp under CP, unchanged without."""
    return lengths + (-lengths) % (2 * cp) if cp > 1 else lengths


def pad_to_multiple(n: Any, multiple: int) -> Any:
    """Round `n` (int, numpy array or tensor) up to a multiple of `multiple`."""
    if int(multiple) < 1:
        raise ValueError(f"alignment multiple must be >= 1, got {multiple}")
    if multiple == 1:
        return n
    return (n + multiple - 1) // multiple * multiple


def row_cost(lengths: Any, attention_weight: float = DEFAULT_ATTENTION_WEIGHT) -> np.ndarray:
    """Estimated compute of each row, in token equivalents (see module docstring)."""
    s = np.asarray(lengths, dtype=np.float64)
    return s + attention_weight * s * s


def _as_lengths(lengths: Any) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError("lengths must be whole numbers of tokens")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"lengths[{i}] = {arr[i]} is negative")
    return arr


def plan_microbatches(
    lengths: Any,
    *,
    dp_size: int,
    max_tokens: int,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
    seq_align: int = 1,
    micro_align: int = 1,
) -> Plan:
    """Assign rows to DP ranks and token-budget micro-batches: `plan[rank][micro] -> [row indices]`.

    Every row index appears exactly once; every micro-batch's aligned token sum is
    <= `max_tokens`; every rank has the same number of micro-batches (at least one; some
    may be empty and must be loss-neutral downstream); ranks are balanced by
    `row_cost`. A row longer than the budget raises `StepwiseBatchError`.
    """
    if int(dp_size) < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if int(max_tokens) < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if attention_weight < 0:
        raise ValueError(f"attention_weight must be >= 0, got {attention_weight}")
    lens = _as_lengths(lengths)
    tokens = pad_to_multiple(lens, seq_align)
    capacity = int(max_tokens) // int(micro_align) * int(micro_align)
    over = np.flatnonzero(tokens > capacity)
    if over.size:
        i = int(over[0])
        aligned = f" ({tokens[i]} after aligning to {seq_align})" if tokens[i] != lens[i] else ""
        raise StepwiseBatchError(
            f"row {i} has {lens[i]} tokens{aligned}, more than max_tokens={max_tokens}"
            + (f" (usable {capacity} with micro_align={micro_align})" if capacity != max_tokens else "")
        )

    cost = row_cost(tokens, attention_weight)
    rank_of = _balance_ranks(cost, int(dp_size))
    rows_by_rank = _rows_by_rank(rank_of, tokens, int(dp_size))
    return _pack_ranks(rows_by_rank, tokens.tolist(), capacity)


# ---------------------------------------------------------------- rank balancing


def _balance_ranks(cost: np.ndarray, dp: int) -> np.ndarray:
    rank_of = _lpt(cost, dp)
    _exchange_refine(cost, rank_of, dp)
    return rank_of


def _lpt(cost: np.ndarray, dp: int) -> np.ndarray:
    """Longest processing time first: each row (largest first) to the least-loaded rank."""
    order = np.argsort(-cost, kind="stable").tolist()
    c = cost.tolist()
    ranks = [0] * len(c)
    heap = [(0.0, r) for r in range(dp)]
    for i in order:
        load, r = heap[0]
        ranks[i] = r
        heapq.heapreplace(heap, (load + c[i], r))
    return np.asarray(ranks, dtype=np.int64)


def _exchange_refine(cost: np.ndarray, rank_of: np.ndarray, dp: int, max_rounds: Optional[int] = None) -> None:
    """Move or swap rows from the heaviest rank to a lighter one while that lowers the heavier load.

    Each accepted exchange strictly lowers the sum of squared loads, so this terminates;
    the round cap only bounds the time on adversarial inputs.
    """
    if dp < 2 or cost.size < 2:
        return
    loads = np.bincount(rank_of, weights=cost, minlength=dp)
    tol = 1e-9 * max(float(loads.max()), 1.0)
    # Within 1e-4 of the mean the cost model's own error dominates: stop there.
    good_enough = float(loads.mean()) * (1 + 1e-4)
    for _ in range(max_rounds or 8 * dp + 32):
        heavy = int(np.argmax(loads))
        if loads[heavy] <= good_enough:
            return
        # The lightest few ranks are the useful partners; trying all would cost O(dp) scans.
        for light in np.argsort(loads, kind="stable")[:_PARTNERS].tolist():
            if light == heavy:
                return
            gap = loads[heavy] - loads[light]
            if gap <= tol:
                return
            move = _best_exchange(cost, rank_of, heavy, light, gap, tol)
            if move is not None:
                a, b = move
                rank_of[a] = light
                delta = cost[a]
                if b >= 0:
                    rank_of[b] = heavy
                    delta -= cost[b]
                loads[heavy] -= delta
                loads[light] += delta
                break
        else:
            return  # no partner can take load off the heaviest rank


def _best_exchange(
    cost: np.ndarray, rank_of: np.ndarray, heavy: int, light: int, gap: float, tol: float
) -> Optional[tuple[int, int]]:
    """(row from heavy, row from light or -1 for a plain move) whose cost difference is
    closest to gap/2, among those that strictly lower the heavier of the two loads."""
    a_idx = np.flatnonzero(rank_of == heavy)
    b_idx = np.flatnonzero(rank_of == light)
    b_order = np.argsort(cost[b_idx], kind="stable")
    b_idx = np.concatenate([[-1], b_idx[b_order]])  # -1: move without swapping back
    b_cost = np.concatenate([[0.0], cost[b_idx[1:]]])
    a_cost = cost[a_idx]
    # For each a, the b's whose cost is nearest a - gap/2 (the exchange that halves the gap).
    pos = np.searchsorted(b_cost, a_cost - gap / 2)
    best: Optional[tuple[float, int, int]] = None
    for cand in (np.clip(pos - 1, 0, b_cost.size - 1), np.clip(pos, 0, b_cost.size - 1)):
        delta = a_cost - b_cost[cand]
        ok = (delta > tol) & (delta < gap - tol)
        if not ok.any():
            continue
        score = np.where(ok, np.abs(gap - 2 * delta), np.inf)
        k = int(np.argmin(score))
        if best is None or score[k] < best[0]:
            best = (float(score[k]), int(a_idx[k]), int(b_idx[cand[k]]))
    return None if best is None else (best[1], best[2])


def _rows_by_rank(rank_of: np.ndarray, tokens: np.ndarray, dp: int) -> list[list[int]]:
    """Each rank's rows, longest first (ties by index)."""
    order = np.lexsort((np.arange(tokens.size), -tokens))
    order = order[np.argsort(rank_of[order], kind="stable")]
    counts = np.bincount(rank_of, minlength=dp)
    return [chunk.tolist() for chunk in np.split(order, np.cumsum(counts)[:-1])]


# ---------------------------------------------------------------- micro-batch packing


def _pack_ranks(rows_by_rank: list[list[int]], tokens: list[int], capacity: int) -> Plan:
    rank_tokens = [sum(tokens[i] for i in rows) for rows in rows_by_rank]
    m = max(1, max(-(-t // capacity) for t in rank_tokens))
    while True:
        plan: Plan = []
        for rows in rows_by_rank:
            bins = _worst_fit(rows, tokens, capacity, m) or _best_fit(rows, tokens, capacity, m)
            if bins is None:
                m = max(m + 1, len(_best_fit(rows, tokens, capacity, None) or []))
                break
            plan.append(_ordered(bins, tokens, m))
        else:
            return plan


def _worst_fit(rows: list[int], tokens: list[int], capacity: int, m: int) -> Optional[list[list[int]]]:
    """Each row (longest first) to the emptiest of m micro-batches; None if one overflows."""
    heap = [(0, b) for b in range(m)]
    bins: list[list[int]] = [[] for _ in range(m)]
    for i in rows:
        load, b = heap[0]
        if load + tokens[i] > capacity:
            return None  # the emptiest one has the most room: nothing fits
        bins[b].append(i)
        heapq.heapreplace(heap, (load + tokens[i], b))
    return bins


def _best_fit(rows: list[int], tokens: list[int], capacity: int, m: Optional[int]) -> Optional[list[list[int]]]:
    """Each row (longest first) to the fullest micro-batch it fits in, opening a new one only
    when none fits; None if that would need more than m."""
    free: list[tuple[int, int]] = []  # sorted (room left, bin)
    bins: list[list[int]] = []
    for i in rows:
        t = tokens[i]
        k = bisect.bisect_left(free, (t, -1))
        if k < len(free):
            room, b = free.pop(k)
        else:
            if m is not None and len(bins) >= m:
                return None
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (room - t, b))
    return bins


def _ordered(bins: list[list[int]], tokens: list[int], m: int) -> list[list[int]]:
    """Rows ascending inside a micro-batch; heaviest micro-batch first; empty ones last."""
    bins = [sorted(b) for b in bins] + [[] for _ in range(m - len(bins))]
    return sorted(bins, key=lambda b: (-sum(tokens[i] for i in b), b[0] if b else 1 << 62))


# ---------------------------------------------------------------- reporting


@dataclass
class PlanStats:
    """What a plan computes; see the module docstring for the token accounting."""

    num_ranks: int
    micro_per_rank: int
    empty_micro: int
    real_tokens: int
    packed_tokens: int  # computed tokens with packing (real + alignment + empty dummies)
    padded_tokens: int  # computed tokens when every row is padded to its micro-batch's longest
    longest_row: int
    largest_micro: int  # tokens of the largest packed micro-batch
    rank_tokens: list[int]
    rank_costs: list[float]

    @property
    def packed_efficiency(self) -> float:
        return self.real_tokens / self.packed_tokens if self.packed_tokens else 1.0

    @property
    def padded_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def dp_balance(self) -> float:
        """max rank cost / mean rank cost (1.0 is perfect)."""
        mean = sum(self.rank_costs) / len(self.rank_costs)
        return max(self.rank_costs) / mean if mean > 0 else 1.0


def plan_stats(
    lengths: Any,
    plan: Plan,
    *,
    seq_align: int = 1,
    micro_align: int = 1,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
) -> PlanStats:
    lens = _as_lengths(lengths)
    aligned = pad_to_multiple(lens, seq_align)
    cost = row_cost(aligned, attention_weight)
    dummy_packed = pad_to_multiple(pad_to_multiple(1, seq_align), micro_align)
    dummy_padded = pad_to_multiple(1, seq_align)
    packed = padded = largest = empty = 0
    rank_tokens, rank_costs = [], []
    for micros in plan:
        rows_of_rank = [i for mb in micros for i in mb]
        rank_tokens.append(int(lens[rows_of_rank].sum()) if rows_of_rank else 0)
        rank_costs.append(float(cost[rows_of_rank].sum()) if rows_of_rank else 0.0)
        for mb in micros:
            if not mb:
                empty += 1
                packed += dummy_packed
                padded += dummy_padded
                continue
            a = aligned[mb]
            size = int(pad_to_multiple(int(a.sum()), micro_align))
            packed += size
            largest = max(largest, size)
            padded += len(mb) * int(a.max())
    return PlanStats(
        num_ranks=len(plan),
        micro_per_rank=len(plan[0]) if plan else 0,
        empty_micro=empty,
        real_tokens=int(lens.sum()),
        packed_tokens=packed,
        padded_tokens=padded,
        longest_row=int(lens.max()) if lens.size else 0,
        largest_micro=largest,
        rank_tokens=rank_tokens,
        rank_costs=rank_costs,
    )
