"""Log-probs and entropy of chosen tokens, vocab-parallel over TP, without full logits.

Given the hidden states at the positions that predict trained tokens (N of them, usually a
small fraction of the sequence in agent runs) and this rank's shard of the output weight
(V/tp rows), `vocab_parallel_logprobs` returns log p(target) and the entropy of each
position's next-token distribution. Per chunk of tokens it computes the logits shard, takes the
max and the sums (normaliser, target logit, sum p*z) with one MAX and one SUM all-reduce over
the TP group, and keeps only per-token scalars. The backward recomputes each chunk's logits, so
peak memory is one chunk of [chunk, V/tp] fp32 logits whatever N is.

Temperature. The rollout engine reports `log_softmax(logits / T)[token]` (rollout/engines/protocol.py), so
the trainer scores the same distribution: every quantity here (log-probs, entropy, gradients)
is of `softmax(logits / T)`. The division happens on the fp32 logits of each chunk, never on
bf16 hidden states.

The hidden-state gradient of one rank is the partial over its vocab shard: callers route
hidden states through megatron's `copy_to_tensor_model_parallel_region` (or, with sequence
parallelism, `gather_from_sequence_parallel_region`), whose backward sums the partials.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from megatron_stepwise.steps import temperature_problem

# fp32 logits held at once by default: chunk = budget / (V_local * 4 bytes * ~3 temporaries).
DEFAULT_CHUNK_BYTES = 512 * 2**20


def _chunk_tokens(vocab_local: int, chunk_tokens: Optional[int]) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return chunk_tokens
    return max(1, DEFAULT_CHUNK_BYTES // (12 * max(vocab_local, 1)))


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _scaled(logits: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    z = logits.float()
    return z if inv_temperature == 1.0 else z.mul_(inv_temperature)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, group, chunk, with_entropy, inv_temperature):
        n, v_local = hidden.size(0), weight.size(0)
        logprobs, entropy, lse, mean_z = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4))
        local_t = targets - vocab_start
        in_shard = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.clamp(0, v_local - 1)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _scaled(hidden[s:e].to(weight.dtype) @ weight.t(), inv_temperature)  # [c, V/tp] fp32
            zmax = z.max(dim=-1).values
            _all_reduce(zmax, dist.ReduceOp.MAX, group)
            ez = (z - zmax[:, None]).exp_()
            sums = torch.stack(
                [
                    ez.sum(-1),
                    torch.where(in_shard[s:e], z.gather(1, local_t[s:e, None])[:, 0], 0.0),
                    # sum_v exp(z_v) * z_v as a batched dot: no [c, V] temporary
                    torch.bmm(ez.unsqueeze(1), z.unsqueeze(2)).flatten() if with_entropy else torch.zeros_like(zmax),
                ]
            )
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            lse[s:e] = zmax + torch.log(sums[0])
            logprobs[s:e] = sums[1] - lse[s:e]
            mean_z[s:e] = sums[2] / sums[0]
            entropy[s:e] = lse[s:e] - mean_z[s:e]
        ctx.save_for_backward(hidden, weight, local_t, in_shard, lse, mean_z)
        ctx.chunk, ctx.inv_temperature, ctx.with_entropy = chunk, inv_temperature, with_entropy
        if not with_entropy:
            entropy.zero_()
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_t, in_shard, lse, mean_z = ctx.saved_tensors
        n = hidden.size(0)
        need_w = ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        use_ent = ctx.with_entropy and grad_entropy is not None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            h = hidden[s:e].to(weight.dtype)
            z = _scaled(h @ weight.t(), ctx.inv_temperature)
            g_lp = grad_logprobs[s:e, None]
            # dL/dz = g_lp * (onehot(y) - p) - g_ent * p * (z - E_p[z])
            #       = p * (-g_lp + g_ent * E_p[z] - g_ent * z) + g_lp * onehot(y)
            if use_ent:
                g_ent = grad_entropy[s:e, None]
                g = torch.addcmul(-g_lp + g_ent * mean_z[s:e, None], z, g_ent, value=-1.0)
            else:
                g = (-g_lp).expand_as(z).clone()
            g.mul_(z.sub_(lse[s:e, None]).exp_())  # z becomes p in place
            rows = torch.nonzero(in_shard[s:e]).flatten()
            g[rows, local_t[s:e][rows]] += grad_logprobs[s:e][rows]
            g = _scaled(g, ctx.inv_temperature).to(weight.dtype)  # d(logits / T)/d(logits) = 1/T
            grad_hidden[s:e] = (g @ weight).to(hidden.dtype)
            if need_w:
                grad_weight += (g.t() @ h).float()
        grad_weight = grad_weight.to(weight.dtype) if need_w else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    chunk_tokens: Optional[int] = None,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per row of `hidden` [N, h], both fp32 [N], of softmax(logits / T).

    `weight` is this rank's vocab shard [V/tp, h] covering ids [vocab_start, vocab_start + V/tp);
    `group` the TP group (None or size 1: no communication). Differentiable w.r.t. hidden and
    weight; the entropy is zeros (and not differentiated) when `with_entropy` is False.
    """
    check_temperature(temperature)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match")
    if targets.shape != (hidden.size(0),):
        raise ValueError(f"targets {tuple(targets.shape)} must be [N={hidden.size(0)}]")
    chunk = _chunk_tokens(weight.size(0), chunk_tokens)
    return _VocabParallelLogProbs.apply(
        hidden, weight, targets, vocab_start, group, chunk, with_entropy, 1.0 / float(temperature)
    )


def check_temperature(temperature: float) -> None:
    """Training scores sampled tokens; greedy decoding (T = 0) has no distribution to score."""
    why = temperature_problem(temperature, greedy=False)
    if why:
        raise ValueError(
            f"temperature {why}: log-probs are scored as log_softmax(logits / T) at the rollout's "
            "sampling temperature (greedy decoding cannot be trained on)"
        )


def output_weight(gpt_model) -> torch.Tensor:
    """The output projection of a megatron GPTModel's last stage (tied or not)."""
    if gpt_model.share_embeddings_and_output_weights:
        return gpt_model.shared_embedding_or_output_weight()
    return gpt_model.output_layer.weight


def trained_position_logprobs(
    hidden: torch.Tensor,
    pred_index: torch.Tensor,
    targets: torch.Tensor,
    gpt_model,
    *,
    chunk_tokens: Optional[int] = None,
    with_entropy: bool = True,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs/entropy of softmax(logits / temperature) at `pred_index` of a last stage's final
    hidden states.

    `hidden` is what the model returns with its output layer bypassed: [1, S_local, h]
    (S_local = S / tp under sequence parallelism). Works at any TP size. `vocab_size`: the real
    vocabulary when the model's is padded; padding rows are left out of the softmax.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    h = hidden.squeeze(0) if hidden.dim() == 3 else hidden  # [S_local, h]
    if gpt_model.config.sequence_parallel:
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
    else:
        h = copy_to_tensor_model_parallel_region(h)
    weight = output_weight(gpt_model)
    tp_rank = ps.get_tensor_model_parallel_rank()
    vocab_start = tp_rank * weight.size(0)
    if vocab_size is not None and vocab_start + weight.size(0) > vocab_size:
        real_rows = vocab_size - vocab_start
        if real_rows <= 0:
            raise ValueError(
                f"tensor-parallel rank {tp_rank} holds only vocabulary padding (vocab_size={vocab_size}, "
                f"{weight.size(0)} rows per rank): use a smaller tensor_parallel or less vocabulary padding"
            )
        weight = weight[:real_rows]  # a view: padding rows get no logits and no gradient
    selected = h.index_select(0, pred_index.to(h.device))
    return vocab_parallel_logprobs(
        selected,
        weight,
        targets.to(h.device),
        vocab_start=vocab_start,
        group=ps.get_tensor_model_parallel_group(),
        chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
        temperature=temperature,
    )


@contextlib.contextmanager
def output_layer_bypassed(gpt):
    """Make the GPTModel return its final hidden states instead of full-vocabulary logits.

    Shadowing the output layer's `forward` on the instance for one call keeps the user's
    module (names, hooks, checkpoints) untouched; the log-prob head then applies the output
    weight only at trained positions.
    """
    layer = gpt.output_layer
    layer.forward = lambda input_, *_, **__: (input_, None)
    try:
        yield
    finally:
        del layer.forward
