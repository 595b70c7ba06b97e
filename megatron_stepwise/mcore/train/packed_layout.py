"""Index maps that put a THD packed micro-batch into one padded batch, for a single attention call.

`PackedCausalAttention`'s one-call path (`model.packed_attention`) gathers every packed row into
its own slot of a [rows, longest row] batch, runs one causal SDPA over all the rows and gathers
the real positions back. Slot positions past a row's end repeat its last token: causal
attention keeps them out of the real positions' results and their outputs are dropped, so
their gradients are exact zeros. The maps are computed on the device from `cu_seqlens`, plus
one host integer the packer already has (the longest row), so no layer waits on a
device-to-host copy; they are built once per micro-batch and shared by its layers.

Under context parallelism (`packing.split_for_context_parallel`: rank r holds chunks r and
2cp-1-r of every row) a row's key slots are its whole sequence rebuilt from the CP group's
gathered keys, its query slots the rank's two chunks, and a position mask keeps each query to
the keys at or before its place in the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# PackedSeqParams attribute the maps of a micro-batch are cached under (one object per micro-batch).
_CACHE = "_stepwise_padded_rows"


@dataclass(frozen=True)
class PaddedRows:
    """Where each packed position goes in the padded batch and back."""

    query: torch.Tensor  # long [B, Lq]: packed (local) position feeding each query slot
    key_rank: Optional[torch.Tensor]  # long [B, Lk]: CP rank holding each key slot (None without CP)
    key: torch.Tensor  # long [B, Lk]: packed (local) position of each key slot on that rank
    mask: Optional[torch.Tensor]  # bool [B, 1, Lq, Lk] may-attend (None: plain causal)
    row: torch.Tensor  # long [T]: batch row of each packed position
    slot: torch.Tensor  # long [T]: its query slot

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """[B, n, Lq, hn] -> [T, n, hn] at the packed positions."""
        return out.transpose(1, 2)[self.row, self.slot]


def _rows_of(ends: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(total, device=ends.device)
    return pos, torch.searchsorted(ends, pos, right=True)  # row r holds [ends[r-1], ends[r])


def padded_rows(cu_seqlens: torch.Tensor, max_len: int, total: int) -> PaddedRows:
    """Causal rows [cu[i], cu[i+1]) of a [total] packed sequence, each in a slot of `max_len`."""
    cu = cu_seqlens.long()
    starts, ends = cu[:-1], cu[1:]
    offsets = torch.arange(max_len, device=cu.device)
    last = (ends - 1).clamp(min=0).clamp(max=max(total - 1, 0))
    index = (starts[:, None] + offsets).minimum(last[:, None])
    pos, row = _rows_of(ends, total)
    return PaddedRows(query=index, key_rank=None, key=index, mask=None, row=row, slot=pos - starts[row])


def context_parallel_rows(cu_seqlens: torch.Tensor, max_len: int, cp: int, rank: int, total: int) -> PaddedRows:
    """The rows of global (padded) bounds `cu_seqlens`, each a multiple of 2 * cp, on CP rank
    `rank` holding `total` local positions: row i's chunk length is c = len_i / (2cp), its local
    positions [cu[i] / cp, + 2c) are chunks rank and 2cp-1-rank."""
    cu = cu_seqlens.long()
    starts = cu[:-1] // cp
    chunk = (cu[1:] - cu[:-1]) // (2 * cp)
    c = chunk.clamp(min=1)[:, None]  # empty rows: any valid index, never read
    c_max = max(max_len // (2 * cp), 1)
    last = max(total - 1, 0)
    # Key slot j of row i: chunk j // c, in rank order for the first cp chunks, reversed after.
    j = torch.arange(2 * cp * c_max, device=cu.device)[None].minimum(2 * cp * c - 1)
    part, offset = j // c, j % c
    late = part >= cp
    key_rank = torch.where(late, 2 * cp - 1 - part, part)
    key = (starts[:, None] + offset + late * c).clamp(max=last)
    # Query slots: this rank's first chunk in [0, c_max), its second in [c_max, 2 c_max).
    q = torch.arange(2 * c_max, device=cu.device)
    second = q >= c_max
    q_offset = (q - second * c_max)[None].minimum(c - 1)
    query = (starts[:, None] + second * c + q_offset).clamp(max=last)
    place = torch.where(second, 2 * cp - 1 - rank, rank)[None] * c + q_offset  # [B, 2 c_max] in the row
    mask = (torch.arange(key.size(1), device=cu.device)[None, None] <= place[:, :, None]).unsqueeze(1)
    pos, row = _rows_of(cu[1:] // cp, total)
    within = pos - starts[row]
    later = within >= chunk[row]
    slot = within - later * chunk[row] + later * c_max
    return PaddedRows(query=query, key_rank=key_rank, key=key, mask=mask, row=row, slot=slot)


def cached_rows(packed_seq_params, build) -> PaddedRows:
    """`build()` once per micro-batch: its layers share one PackedSeqParams object."""
    rows = getattr(packed_seq_params, _CACHE, None)
    if rows is None:
        rows = build()
        setattr(packed_seq_params, _CACHE, rows)
    return rows


def longest_row(packed_seq_params, bounds: Optional[list[int]], cu_seqlens: torch.Tensor) -> int:
    """The longest (padded) row as a host integer: from the packer's host bounds or
    `max_seqlen_q`; a device-to-host copy only for PackedSeqParams built with neither."""
    if bounds is not None:
        return max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    if packed_seq_params.max_seqlen_q is not None:
        return int(packed_seq_params.max_seqlen_q)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
