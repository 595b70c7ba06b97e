"""Megatron <-> HF mapping (pure functions): hand-computed layouts, bit-identical round trips, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_stepwise.hf.arch import arch_from_hf
from megatron_stepwise.mcore.train.model import tiny_config
from megatron_stepwise.mcore.weights import hf_mapping as H


def hf_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A real transformers model's state dict (random init), as saved by save_pretrained (MoE
    experts one by one, as on the hub)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_stepwise.rollout.engines.embedded.hf_model import checkpoint_state

    fields = dict(cfg)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = checkpoint_state(model)
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight")  # save_pretrained drops the tied copy
    # Norm weights init to exactly 1 and biases to 0: perturb them so a swap would be caught.
    gen = torch.Generator().manual_seed(seed + 1)
    for k, v in state.items():
        if v.dim() == 1:
            v.add_(torch.randn(v.shape, generator=gen))
    return state


CASES = [
    pytest.param("qwen2", False, id="qwen2-untied"),
    pytest.param("qwen2", True, id="qwen2-tied"),
    pytest.param("llama", False, id="llama-untied"),
    pytest.param("llama", True, id="llama-tied"),
    pytest.param("qwen3", False, id="qwen3-untied"),
    pytest.param("qwen3", True, id="qwen3-tied"),
    pytest.param("qwen3_moe", False, id="qwen3moe-untied"),
    pytest.param("mixtral", False, id="mixtral-untied"),
    pytest.param("mixtral", True, id="mixtral-tied"),
]
# Qwen3: an explicit head_dim that is not hidden_size / num_heads (as in the real Qwen3 models).
EXTRA = {"qwen3": {"head_dim": 24}, "qwen3_moe": {"head_dim": 24}}


@pytest.mark.parametrize("model_type,tied", CASES)
@pytest.mark.parametrize("te_spec", [False, True], ids=["local-norms", "te-norms"])
def test_hf_megatron_hf_round_trip_is_bit_identical(model_type, tied, te_spec):
    cfg = tiny_config(model_type=model_type, tie_word_embeddings=tied, num_layers=2, **EXTRA.get(model_type, {}))
    arch = arch_from_hf(cfg)
    state = hf_state(cfg)
    canonical = H.hf_to_canonical(state, arch, te_spec=te_spec)
    assert set(canonical) == set(H.canonical_names(arch, te_spec=te_spec))
    assert ("output_layer.weight" in canonical) == (not tied)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in canonical) == (model_type == "qwen2")
    assert ("decoder.layers.1.self_attention.k_layernorm.weight" in canonical) == model_type.startswith("qwen3")
    moe = model_type in ("qwen3_moe", "mixtral")
    assert ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in canonical) == moe
    back = H.canonical_to_hf(canonical, arch)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_mixtral_experts_take_the_hub_names_w1_gate_w3_up_w2_down(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config(model_type="mixtral", num_layers=1)
    arch = arch_from_hf(cfg)
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size, arch.moe_norm_topk) == (4, 2, 128, True)
    names = H.hf_names(arch)
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert H.hf_names_for("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", arch) == (
        "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "model.layers.0.block_sparse_moe.experts.3.w3.weight",
    )
    assert H.hf_names_for("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight", arch) == (
        "model.layers.0.block_sparse_moe.experts.3.w2.weight",
    )
    # ... which are the names transformers itself writes (and reads back into its fused experts).
    fields = dict(cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(saved) == sorted(names)
    fc1 = H.from_hf("decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight", saved, arch)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj[2]  # transformers' [gate; up]
    assert torch.equal(fc1, gate_up)
    assert torch.equal(saved["model.layers.0.block_sparse_moe.experts.2.w1.weight"], gate_up[:128])
    fc2 = H.from_hf("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight", saved, arch)
    assert torch.equal(fc2, model.model.layers[0].mlp.experts.down_proj[2])


def test_qkv_rows_are_grouped_per_query_group_by_hand():
    # 4 query heads in 2 groups, head_dim 1, hidden 1: rows are easy to follow.
    arch = arch_from_hf(tiny_config(hidden_size=4, num_heads=4, num_kv_heads=2, num_layers=1))
    arch = dataclasses.replace(arch, hidden_size=1, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    hf = {
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
    }
    qkv = H.from_hf("decoder.layers.0.self_attention.linear_qkv.weight", hf, arch)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert qkv.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    split = dict(H.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", qkv, arch))
    assert torch.equal(split["model.layers.0.self_attn.k_proj.weight"], k)


def test_fc1_is_gate_then_up():
    arch = arch_from_hf(tiny_config(hidden_size=4, ffn_hidden_size=2, num_heads=1, num_kv_heads=1, num_layers=1))
    gate, up = torch.full((2, 4), 1.0), torch.full((2, 4), 2.0)
    fc1 = H.from_hf(
        "decoder.layers.0.mlp.linear_fc1.weight",
        {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up},
        arch,
    )
    assert fc1[:, 0].tolist() == [1, 1, 2, 2]


def test_vocab_padding_is_zero_filled_on_import_and_stripped_on_export():
    cfg = tiny_config(model_type="llama", vocab_size=250, num_layers=1)
    arch = arch_from_hf(cfg)
    state = hf_state(cfg)
    canonical = H.hf_to_canonical(state, arch, vocab_rows=256)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert canonical[name].shape == (256, arch.hidden_size)
        assert torch.count_nonzero(canonical[name][250:]) == 0
    back = H.canonical_to_hf(canonical, arch)
    assert torch.equal(back["lm_head.weight"], state["lm_head.weight"])
    assert back["model.embed_tokens.weight"].shape == (250, arch.hidden_size)


def test_exported_tensors_do_not_share_storage():
    # safetensors refuses tensors that share memory; the q/k/v split must copy.
    arch = arch_from_hf(tiny_config(num_layers=1))
    qkv = torch.randn(arch.head_dim * (arch.num_heads + 2 * arch.num_kv_heads), arch.hidden_size)
    parts = [t for _, t in H.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", qkv, arch)]
    ptrs = {t.untyped_storage().data_ptr() for t in parts} | {qkv.untyped_storage().data_ptr()}
    assert len(ptrs) == 4


def test_bad_checkpoints_name_the_tensor():
    cfg = tiny_config(num_layers=2)
    arch = arch_from_hf(cfg)
    state = hf_state(cfg)

    missing = dict(state)
    missing.pop("model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(H.WeightConversionError, match=r"missing 1 tensor.*layers\.1\.self_attn\.k_proj"):
        H.hf_to_canonical(missing, arch)

    extra = dict(state, **{"model.layers.2.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(H.WeightConversionError, match=r"layers \[2\] are beyond num_hidden_layers=2"):
        H.hf_to_canonical(extra, arch)

    wrong = dict(state)
    wrong["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3 * arch.head_dim, arch.hidden_size)
    with pytest.raises(H.WeightConversionError, match=r"k_proj\.weight: shape \(48, 64\)"):
        H.hf_to_canonical(wrong, arch)

    with pytest.raises(H.WeightConversionError, match="no Hugging Face mapping for megatron parameter 'decoder.foo'"):
        H.to_hf("decoder.foo", torch.zeros(1), arch)


def test_ignores_rotary_buffers_and_a_stored_tied_lm_head():
    cfg = tiny_config(model_type="llama", tie_word_embeddings=True, num_layers=1)
    arch = arch_from_hf(cfg)
    state = hf_state(cfg)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    canonical = H.hf_to_canonical(state, arch)
    assert "output_layer.weight" not in canonical
