"""One micro-batch of step rows -> the model's packed (THD) inputs, with no padding beyond alignment.

Rows (each `prompt + response` of one step) are concatenated into a single sequence of
length S = sum(len) + pad, described to megatron by `PackedSeqParams(qkv_format="thd")`:
attention is causal within each row (TE's fused attention on GPU, `PackedCausalAttention` on
the local path) and RoPE positions restart at every row. `pad` (< `align`) tokens form one
extra segment at the end so S is a multiple of what the layout needs (`alignment_for`).

Context parallelism (CP) splits every row over the CP ranks, load-balanced for causal
attention as Transformer Engine and megatron's RoPE expect: each row is padded to a multiple
of 2*cp (pad tokens at its end, never attended to by its real tokens, never trained; the
padded bounds are `cu_seqlens_padded`), cut into 2*cp chunks, and CP rank r keeps chunks r and
2*cp-1-r (`split_for_context_parallel`). Every rank keeps the global `cu_seqlens`.

A *trained position* is a token with loss_mask 1; its log-prob comes from the hidden state one
position earlier (`pred_index`). Only those hidden states ever reach the output layer. Under
CP a trained token is scored by the rank that holds its predicting position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_stepwise.algo.planner import packed_lengths
from megatron_stepwise.steps import StepBatch, StepwiseBatchError


@dataclass
class PackedMicroBatch:
    """Model inputs for one micro-batch plus where its trained tokens are."""

    tokens: torch.Tensor  # long [1, S]
    position_ids: torch.Tensor  # long [1, S], restarting at 0 per row
    cu_seqlens: torch.Tensor  # int32 [num_segments + 1], includes the alignment pad segment
    max_seqlen: int  # longest segment, padded
    rows: list[int]  # mini-batch row indices packed here, in order
    pred_index: torch.Tensor  # long [N]: packed position whose hidden state predicts a trained token
    targets: torch.Tensor  # long [N]: the trained token ids
    token_index: torch.Tensor  # long [N]: flat index of each trained token in the mini-batch StepBatch
    row_ids: torch.Tensor  # long [N]: mini-batch row of each trained token
    num_real_tokens: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # per trained token, e.g. advantages
    mode: str = "train"  # "train" or "logprobs": what the loss function computes
    loss_scale: float = 1.0  # undoes megatron's averaging over micro-batches and DP (plugin sets it)
    rollout_logprobs_complete: bool = False  # every trained token of the mini-batch has an engine log-prob
    plan_size: int = 1  # micro-batches the plugin planned for this mini-batch and DP rank
    metric_share: float = 0.0  # 1 on exactly one micro-batch of the mini-batch: the metric pairs' denominator
    cu_seqlens_padded: Optional[torch.Tensor] = None  # rows padded for CP (None: same as cu_seqlens)
    token_segment: Optional[torch.Tensor] = None  # long [S]: index in `rows` of each packed position, -1 = padding
    # (alignment pad, CP pad, or a DP padding step)
    minibatch_rows: int = 0  # rows of the whole mini-batch (all DP ranks): the router losses' normaliser
    minibatch_tokens: int = 0  # real tokens of the whole mini-batch
    # int16 [S, layers, topk]: the engine's experts at each packed position (routing replay),
    # -1 where unknown (padding, unreported); None when the mini-batch carries none
    routed_experts: Optional[torch.Tensor] = None

    @property
    def seq_len(self) -> int:
        return int(self.tokens.size(1))

    @property
    def num_trained(self) -> int:
        return int(self.pred_index.numel())

    def packed_seq_params(self, device: torch.device):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device=device, dtype=torch.int32)
        padded = None if self.cu_seqlens_padded is None else self.cu_seqlens_padded.to(device=device, dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )
        # The (padded) segment bounds as host integers, read by `PackedCausalAttention` so that on
        # a GPU no layer has to copy them back from the device (a synchronisation per layer).
        host = self.cu_seqlens if self.cu_seqlens_padded is None else self.cu_seqlens_padded
        params.stepwise_bounds = host.tolist()
        return params


def alignment_for(tp: int, sequence_parallel: bool, cp: int = 1) -> int:
    """Packed length multiple required by the layout: SP splits each CP rank's S / cp tokens
    over TP, CP splits every row into 2 * cp chunks."""
    return (tp if sequence_parallel else 1) * (2 * cp if cp > 1 else 1)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    if x.numel() > 1:
        torch.cumsum(x[:-1], 0, out=out[1:])
    return out


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated aranges [starts[i], starts[i] + lengths[i]) without a Python loop."""
    total = int(lengths.sum())
    return torch.repeat_interleave(starts, lengths) + (
        torch.arange(total) - torch.repeat_interleave(_exclusive_cumsum(lengths), lengths)
    )


def pack_rows(
    batch: StepBatch,
    rows: Sequence[int],
    *,
    align: int = 1,
    pad_token_id: int = 0,
    gather_fields: Sequence[str] = (),
    max_tokens: Optional[int] = None,
    cp: int = 1,
    pad_to: Optional[int] = None,
) -> PackedMicroBatch:
    """Pack `rows` of `batch` into one THD sequence; gather `gather_fields` at trained tokens.

    With `cp` > 1 each row is padded to a multiple of 2 * cp first (`align` must be a multiple
    of 2 * cp, as `alignment_for` gives). An empty `rows` gives a loss-neutral micro-batch of
    `align` pad tokens and no trained token. `pad_to` (a multiple of `align`): pad the packed
    sequence to at least that many tokens.
    """
    rows = [int(r) for r in rows]
    row_t = torch.tensor(rows, dtype=torch.long)
    lens = batch.lengths[row_t] if rows else torch.zeros(0, dtype=torch.long)
    if bool((lens == 0).any()):
        r = rows[int(torch.nonzero(lens == 0)[0])]
        raise StepwiseBatchError(f"step {r}: empty row (no prompt and no response tokens)")
    plens = packed_lengths(lens, cp)
    total, padded_total = int(lens.sum()), int(plens.sum())
    if max_tokens is not None and padded_total > max_tokens:
        raise StepwiseBatchError(
            f"micro-batch of rows {rows[:8]}{'...' if len(rows) > 8 else ''} has {padded_total} tokens, "
            f"over the budget max_tokens={max_tokens}"
        )
    # Flat indices (into the mini-batch) of every real token and its packed position, without
    # a per-token loop.
    within = _ranges(torch.zeros_like(lens), lens)
    flat = _ranges(batch.offsets[:-1][row_t], lens) if rows else within
    row_of = torch.repeat_interleave(row_t, lens) if rows else within
    packed_pos = _ranges(_exclusive_cumsum(plens), lens)

    pad = (-padded_total) % align if rows else max(align, 1)
    if pad_to is not None:
        pad = max(pad, pad_to - padded_total)
    pad_seg = torch.tensor([pad] if pad else [], dtype=torch.long)
    seg_plens, seg_lens = torch.cat([plens, pad_seg]), torch.cat([lens, pad_seg])
    size = padded_total + pad
    tokens = torch.full((size,), pad_token_id, dtype=torch.long)
    tokens[packed_pos] = batch.tokens[flat]
    # DP padding steps are not data: like pad tokens, they belong to no segment the routers count.
    padding = batch.row_fields["is_padding"]
    segment_of_row = torch.tensor([-1 if padding[r] else i for i, r in enumerate(rows)], dtype=torch.long)
    token_segment = torch.full((size,), -1, dtype=torch.long)
    token_segment[packed_pos] = torch.repeat_interleave(segment_of_row, lens)
    routed = batch.token_fields.get("routed_experts")
    if routed is not None:  # carried like the tokens: the engine's experts at each packed position
        packed_routed = torch.full((size, *routed.shape[1:]), -1, dtype=routed.dtype)
        packed_routed[packed_pos] = routed[flat]
        routed = packed_routed
    positions = _ranges(torch.zeros_like(seg_plens), seg_plens)
    cu = torch.zeros(seg_lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(seg_lens, 0, out=cu[1:])
    cu_padded = None
    if cp > 1:
        cu_padded = torch.zeros_like(cu)
        torch.cumsum(seg_plens, 0, out=cu_padded[1:])

    trained = batch.token_fields["loss_mask"][flat] != 0
    bad = trained & (within == 0)
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
        cu_seqlens_padded=cu_padded,
        max_seqlen=int(seg_plens.max()) if seg_plens.numel() else 0,
        rows=rows,
        pred_index=packed_pos[pos] - 1,
        targets=batch.tokens[token_index],
        token_index=token_index,
        row_ids=row_of[pos],
        num_real_tokens=total,
        fields={name: batch.token_fields[name][token_index] for name in gather_fields},
        token_segment=token_segment,
        routed_experts=routed,
    )


def split_for_context_parallel(mb: PackedMicroBatch, cp: int, cp_rank: int) -> PackedMicroBatch:
    """This CP rank's part of a packed micro-batch: chunks r and 2*cp-1-r of every segment, in
    segment order, and the trained positions whose predicting hidden state it holds."""
    cu = (mb.cu_seqlens_padded if mb.cu_seqlens_padded is not None else mb.cu_seqlens).long()
    seg = cu[1:] - cu[:-1]
    if bool((seg % (2 * cp)).any()):
        raise ValueError(f"segments of lengths {seg.tolist()} are not multiples of 2 * cp = {2 * cp}")
    chunk = seg // (2 * cp)
    first, second = cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp - 1 - cp_rank) * chunk
    local = _ranges(torch.stack([first, second], 1).flatten(), chunk.repeat_interleave(2))
    where = torch.full((mb.seq_len,), -1, dtype=torch.long)
    where[local] = torch.arange(local.numel())
    keep = where[mb.pred_index] >= 0
    n = len(mb.rows)  # segments after the rows are alignment padding
    real = torch.zeros(mb.seq_len, dtype=torch.bool)
    real[_ranges(cu[:n], (mb.cu_seqlens[1 : n + 1] - mb.cu_seqlens[:n]).long())] = True
    return dataclasses.replace(
        mb,
        tokens=mb.tokens[:, local],
        position_ids=mb.position_ids[:, local],
        pred_index=where[mb.pred_index[keep]],
        targets=mb.targets[keep],
        token_index=mb.token_index[keep],
        row_ids=mb.row_ids[keep],
        num_real_tokens=int(real[local].sum()),
        fields={k: v[keep] for k, v in mb.fields.items()},
        metric_share=0.0,  # the plugin gives it to one CP rank's micro-batch
        token_segment=None if mb.token_segment is None else mb.token_segment[local],
        routed_experts=None if mb.routed_experts is None else mb.routed_experts[local],
    )
