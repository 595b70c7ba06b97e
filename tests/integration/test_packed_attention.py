"""The local spec's packed attention and fused elementwise blocks, single process.

`PackedCausalAttention` is block-diagonal causal in both implementations (`one_call`: every row
in one padded SDPA call; `per_row`), and the two agree in outputs and gradients within 1e-6
(fp32) with MHA, GQA and MQA, empty and one-token rows; the one-call path reads nothing back
from the device. The fused RoPE equals megatron's unfused THD RoPE (CP ranks included), and the
fused model (compiled RMSNorm, RoPE, SwiGLU) equals the unfused one. TP2 and CP2 run under
torchrun in test_megatron_parallel.py (the `*_one_call` layouts).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_stepwise.mcore.train.local_layers import PackedCausalAttention  # noqa: E402
from megatron_stepwise.mcore.train.packed_layout import padded_rows  # noqa: E402

TOL = 1e-6
MODES = ("one_call", "per_row")


def attention(mode: str, heads: int = 4, groups: int = 2, head_dim: int = 4) -> PackedCausalAttention:
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
    )
    return PackedCausalAttention(
        cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", packed_attention=mode
    )


def packed_params(lengths: list[int], host_bounds: bool = False) -> PackedSeqParams:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    if host_bounds:  # what packing.PackedMicroBatch.packed_seq_params adds
        psp.stepwise_bounds = cu.tolist()
    return psp


def qkv(total: int, heads: int, groups: int, head_dim: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, n, head_dim, generator=g) for n in (heads, groups, groups)]


def run(mode, lengths, heads, groups, host_bounds=False):
    """Output and the gradients of q, k, v under a loss that weighs every output differently."""
    inputs = [t.requires_grad_() for t in qkv(sum(lengths), heads, groups)]
    out = attention(mode, heads, groups)(*inputs, None, packed_seq_params=packed_params(lengths, host_bounds))
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("mode", MODES)
def test_packed_attention_is_block_diagonal_causal_with_gqa(mode):
    t, nh, ng, d = 8, 4, 2, 4
    q, k, v = qkv(t, nh, ng, d)
    out = attention(mode, nh, ng, d)(q, k, v, None, packed_seq_params=packed_params([3, 4, 1]))

    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    allowed = (seg[:, None] == seg[None, :]) & (torch.arange(t)[None, :] <= torch.arange(t)[:, None])
    expected = torch.empty(t, nh, d)
    for head in range(nh):
        kv = head // (nh // ng)
        scores = (q[:, head] @ k[:, kv].t()) / math.sqrt(d)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        expected[:, head] = probs @ v[:, kv]
    torch.testing.assert_close(out, expected.reshape(t, nh * d), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("host_bounds", [False, True], ids=["device_bounds", "host_bounds"])
def test_one_call_matches_per_row_outputs_and_gradients(heads, groups, host_bounds):
    lengths = [5, 1, 0, 9, 3, 2]  # a one-token row, an empty one, the longest in the middle
    out, grads = run("one_call", lengths, heads, groups, host_bounds)
    ref, ref_grads = run("per_row", lengths, heads, groups, host_bounds)
    assert float((out - ref).abs().max()) <= TOL
    for name, got, want in zip("qkv", grads, ref_grads):
        assert float((got - want).abs().max()) <= TOL, f"d{name}"


def test_plain_batches_are_causal_in_both_modes():
    s, b, nh, ng, d = 6, 2, 4, 2, 4
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (nh, ng, ng))
    outs = [attention(mode, nh, ng, d)(q, k, v, None) for mode in MODES]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True, enable_gqa=True
    )
    for out in outs:
        torch.testing.assert_close(out, expected.permute(2, 0, 1, 3).reshape(s, b, -1), rtol=1e-5, atol=1e-6)


def test_one_call_reads_nothing_back_from_the_device(monkeypatch):
    """No .tolist() / .item() / int(tensor) in the one-call forward or backward (each is a
    device-to-host synchronisation on a GPU); the per-row path without host bounds needs one."""

    def host_read(*_a, **_k):
        raise AssertionError("read back from the device")

    lengths = [3, 5, 2]
    inputs = [t.requires_grad_() for t in qkv(sum(lengths), 4, 2)]
    for name in ("tolist", "item", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out = attention("one_call")(*inputs, None, packed_seq_params=packed_params(lengths))
    out.sum().backward()
    with pytest.raises(AssertionError, match="read back"):
        attention("per_row")(*inputs, None, packed_seq_params=packed_params(lengths))


def test_padded_rows_by_hand():
    # rows [0, 2), [2, 5), [5, 6) in slots of 3: past a row's end the slot repeats its last token
    rows = padded_rows(torch.tensor([0, 2, 5, 6]), max_len=3, total=6)
    assert rows.query.tolist() == [[0, 1, 1], [2, 3, 4], [5, 5, 5]]
    assert rows.row.tolist() == [0, 0, 1, 1, 1, 2] and rows.slot.tolist() == [0, 1, 0, 1, 2, 0]


def test_auto_is_per_row_on_cpu(monkeypatch):
    """auto: one_call on a GPU only (measured slower on CPU): on CPU it reads the host bounds."""
    lengths = [3, 5, 2]
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or [0, 3, 8, 10])
    attention("auto")(*qkv(sum(lengths), 4, 2), None, packed_seq_params=packed_params(lengths))
    assert len(reads) == 1  # the per-row path's bounds


def test_an_unknown_implementation_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.packed_attention must be one of auto, one_call, per_row, got 'fast'"):
        attention("fast")


def test_the_config_key_is_validated():
    from megatron_stepwise.config import config_from_dict
    from megatron_stepwise.config.errors import ConfigError

    assert config_from_dict({}).model.packed_attention == "auto"
    with pytest.raises(ConfigError, match="model.packed_attention"):
        config_from_dict({"model": {"packed_attention": "fast"}})


# ---------------------------------------------------------------- fused elementwise blocks


class _Group:  # what megatron's THD RoPE reads of a CP group
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 0), (2, 1)])
def test_fused_rope_equals_megatrons_unfused_thd_rope(cp, rank):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from megatron_stepwise.mcore.train.fused_ops import rope_thd

    lengths = [8, 4, 12, 4]  # global rows, multiples of 2 * cp
    cu = torch.tensor([0, 8, 12, 24, 28], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    t = torch.randn(sum(lengths) // cp, 3, 8, generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    freqs = torch.outer(torch.arange(max(lengths)).float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]  # [max_len, 1, 1, d], as megatron builds it
    want = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_Group(cp, rank))
    got = rope_thd(t, cu, freqs, cp_size=cp, cp_rank=rank)
    assert float((got - want).abs().max()) <= TOL


_FUSED_MODEL = """
import os, torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.packed_seq_params import PackedSeqParams
from megatron_stepwise.mcore.runtime.runtime import destroy_distributed, init_distributed
from megatron_stepwise.mcore.train import fused_ops, model as M
from megatron_stepwise.mcore.weights import full_views as W

init_distributed(1, 1, 1, seed=1)
lengths = [7, 3, 12, 5, 1]
cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
tokens = torch.randint(0, 256, (1, int(cu[-1])), generator=torch.Generator().manual_seed(0))
positions = torch.cat([torch.arange(n) for n in lengths])[None]
runs = {}
for fused in (False, True):
    model = M.build_model_chunks(M.tiny_config(), wrap=False, init=lambda c: W.init_deterministic(c, seed=3),
                                 fused_elementwise=fused)[0]
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
    out = model(tokens, positions, None, packed_seq_params=psp)
    out.pow(2).mean().backward()
    runs[fused] = (out.detach(), {n: p.grad for n, p in model.named_parameters()}, model.config)
config = runs[True][2]
assert config.apply_rope_fusion and config.bias_activation_fusion and not runs[False][2].apply_rope_fusion
assert rope_utils.fused_apply_rotary_pos_emb_thd is fused_ops.rope_thd
out_gap = float((runs[True][0] - runs[False][0]).abs().max())
grad_gap = max(float((g - runs[False][1][n]).abs().max() / runs[False][1][n].abs().max()) for n, g in runs[True][1].items())
print("gaps", out_gap, grad_gap)
destroy_distributed()
"""


@pytest.mark.timeout(600)  # torch.compile of three blocks on a busy 2-core machine
def test_fused_model_equals_the_unfused_one():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", _FUSED_MODEL], env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out_gap, grad_gap = (float(x) for x in proc.stdout.split("gaps")[1].split())
    assert out_gap <= TOL and grad_gap <= TOL, (out_gap, grad_gap)
