"""One micro-batch of step rows -> the model's packed (THD) inputs, with no padding beyond alignment.

Rows (each `prompt + response` of one step) are concatenated into a single sequence of
length S = sum(len) + pad, described to megatron by `PackedSeqParams(qkv_format="thd")`:
attention is causal within each row (TE's fused attention on GPU, `PackedCausalAttention` on
the local path) and RoPE positions restart at every row. `pad` (< `align`) tokens form one
extra segment at the end so S is a multiple of what sequence parallelism needs (TP size).

A *trained position* is a token with loss_mask 1; its log-prob comes from the hidden state one
position earlier (`pred_index`). Only those hidden states ever reach the output layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_stepwise.types import StepBatch, StepwiseBatchError


@dataclass
class PackedMicroBatch:
    """Model inputs for one micro-batch plus where its trained tokens are."""

    tokens: torch.Tensor  # long [1, S]
    position_ids: torch.Tensor  # long [1, S], restarting at 0 per row
    cu_seqlens: torch.Tensor  # int32 [num_segments + 1], includes the alignment pad segment
    max_seqlen: int
    rows: list[int]  # mini-batch row indices packed here, in order
    pred_index: torch.Tensor  # long [N]: packed position whose hidden state predicts a trained token
    targets: torch.Tensor  # long [N]: the trained token ids
    token_index: torch.Tensor  # long [N]: flat index of each trained token in the mini-batch StepBatch
    row_ids: torch.Tensor  # long [N]: mini-batch row of each trained token
    num_real_tokens: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # per trained token, e.g. advantages
    mode: str = "train"  # "train" or "logprobs": what the loss function computes
    loss_scale: float = 1.0  # undoes megatron's averaging over micro-batches and DP (plugin sets it)

    @property
    def seq_len(self) -> int:
        return int(self.tokens.size(1))

    @property
    def num_trained(self) -> int:
        return int(self.pred_index.numel())

    def packed_seq_params(self, device: torch.device):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device=device, dtype=torch.int32)
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def alignment_for(tp: int, sequence_parallel: bool, cp: int = 1) -> int:
    """Packed length multiple required by the layout (SP splits the sequence over TP)."""
    align = tp if sequence_parallel else 1
    if cp > 1:
        align *= 2 * cp
    return align


def pack_rows(
    batch: StepBatch,
    rows: Sequence[int],
    *,
    align: int = 1,
    pad_token_id: int = 0,
    gather_fields: Sequence[str] = (),
    max_tokens: Optional[int] = None,
) -> PackedMicroBatch:
    """Pack `rows` of `batch` into one THD sequence; gather `gather_fields` at trained tokens.

    An empty `rows` gives a loss-neutral micro-batch of `align` pad tokens and no trained token.
    """
    rows = [int(r) for r in rows]
    starts = batch.offsets[:-1]
    lengths = batch.lengths
    if rows:
        row_t = torch.tensor(rows, dtype=torch.long)
        lens = lengths[row_t]
        if bool((lens == 0).any()):
            r = rows[int(torch.nonzero(lens == 0)[0])]
            raise StepwiseBatchError(f"step {r}: empty row (no prompt and no response tokens)")
        total = int(lens.sum())
        if max_tokens is not None and total > max_tokens:
            raise StepwiseBatchError(
                f"micro-batch of rows {rows[:8]}{'...' if len(rows) > 8 else ''} has {total} tokens, "
                f"over the budget max_tokens={max_tokens}"
            )
        # Flat indices (into the mini-batch) of every packed token, without a per-token loop.
        seg_start = torch.zeros(len(rows), dtype=torch.long)
        torch.cumsum(lens[:-1], 0, out=seg_start[1:])
        within = torch.arange(total) - torch.repeat_interleave(seg_start, lens)
        flat = torch.repeat_interleave(starts[row_t], lens) + within
        row_of = torch.repeat_interleave(row_t, lens)
    else:
        lens = torch.zeros(0, dtype=torch.long)
        total = 0
        within = flat = row_of = torch.zeros(0, dtype=torch.long)

    pad = (-total) % align if total else max(align, 1)
    tokens = torch.cat([batch.tokens[flat], torch.full((pad,), pad_token_id, dtype=torch.long)])
    positions = torch.cat([within, torch.arange(pad)])
    seg_lens = torch.cat([lens, torch.tensor([pad] if pad else [], dtype=torch.long)])
    cu = torch.zeros(seg_lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(seg_lens, 0, out=cu[1:])

    trained = batch.token_fields["loss_mask"][flat] != 0
    first_of_row = within == 0
    bad = trained & first_of_row
    if bool(bad.any()):
        r = int(row_of[bad][0])
        raise StepwiseBatchError(
            f"step {r}: field 'loss_mask' trains the row's first token, which has no preceding context "
            "(empty prompt); a trained token needs at least one token before it"
        )
    pos = torch.nonzero(trained).flatten()
    token_index = flat[pos]
    return PackedMicroBatch(
        tokens=tokens.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=int(seg_lens.max()) if seg_lens.numel() else 0,
        rows=rows,
        pred_index=pos - 1,
        targets=batch.tokens[token_index],
        token_index=token_index,
        row_ids=row_of[pos],
        num_real_tokens=total,
        fields={name: batch.token_fields[name][token_index] for name in gather_fields},
    )


def set_response_field(batch: StepBatch, name: str, values: Sequence[torch.Tensor], dtype=torch.float32) -> None:
    """Store per-step, response-aligned tensors (e.g. advantages) as `batch.token_fields[name]`,
    with 0 at prompt positions."""
    if len(values) != batch.num_rows:
        raise StepwiseBatchError(f"field {name!r}: got {len(values)} tensors for {batch.num_rows} steps")
    resp = batch.response_lens
    for r, v in enumerate(values):
        if v.numel() != int(resp[r]):
            raise StepwiseBatchError(
                f"step {r}: field {name!r} has {v.numel()} values for {int(resp[r])} response tokens"
            )
    out = torch.zeros(batch.tokens.numel(), dtype=dtype)
    if values:
        resp_start = batch.offsets[:-1] + batch.prompt_lens
        idx = torch.repeat_interleave(resp_start, resp) + (
            torch.arange(int(resp.sum())) - torch.repeat_interleave(torch.cumsum(resp, 0) - resp, resp)
        )
        out[idx] = torch.cat([v.detach().to(dtype).flatten() for v in values])
    batch.token_fields[name] = out


def response_values(batch: StepBatch, flat: torch.Tensor) -> list[torch.Tensor]:
    """Split a flat per-token tensor of `batch` into per-step response-aligned tensors."""
    return [flat[batch.response_slice(r)].clone() for r in range(batch.num_rows)]
