"""Single-process tests of the Megatron pieces: packing, log-probs at trained positions and the
HF-config front end (the packed attention: test_packed_attention.py). (Layout invariance runs
under torchrun in test_megatron_parallel.py.)"""

import pytest
import torch

pytest.importorskip("megatron.core")

from oracles import reference_logprobs  # noqa: E402

from megatron_stepwise.hf.arch import ModelConfigError, arch_from_hf, padded_vocab_size, validate_parallel  # noqa: E402
from megatron_stepwise.mcore.train import model as M  # noqa: E402
from megatron_stepwise.mcore.train.logprobs import vocab_parallel_logprobs  # noqa: E402
from megatron_stepwise.mcore.train.packing import (  # noqa: E402
    alignment_for,
    pack_rows,
    split_for_context_parallel,
)
from megatron_stepwise.steps import Step, StepBatch, StepwiseBatchError, TrajectoryID  # noqa: E402


def small_batch():
    tid = TrajectoryID("p", 0)
    return StepBatch.from_steps(
        [
            Step(tid, [5, 6], [7, 8, 9], [1, 1, 0]),
            Step(tid, [1], [2, 3], [0, 1]),
            Step(tid, [4, 4, 4], [], [], is_last_step=True),
        ]
    )


# ---------------------------------------------------------------- packing


def test_pack_rows_layout_by_hand():
    mb = pack_rows(small_batch(), [1, 0], align=4)
    assert mb.tokens.tolist() == [[1, 2, 3, 5, 6, 7, 8, 9]]  # 8 tokens: already aligned, no pad
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert mb.cu_seqlens.tolist() == [0, 3, 8] and mb.max_seqlen == 5
    # trained tokens: step1's '3' (packed 2), step0's '7','8' (packed 5, 6); predicted one earlier
    assert mb.pred_index.tolist() == [1, 4, 5]
    assert mb.targets.tolist() == [3, 7, 8]
    assert mb.token_index.tolist() == [7, 2, 3]
    assert mb.row_ids.tolist() == [1, 0, 0]
    assert mb.num_real_tokens == 8 and mb.num_trained == 3


def test_pack_rows_pads_to_alignment_as_its_own_segment():
    mb = pack_rows(small_batch(), [2], align=4, pad_token_id=0)
    assert mb.tokens.tolist() == [[4, 4, 4, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0]]
    assert mb.cu_seqlens.tolist() == [0, 3, 4]
    assert mb.num_trained == 0 and mb.num_real_tokens == 3


def test_empty_microbatch_is_loss_neutral_padding():
    mb = pack_rows(small_batch(), [], align=2)
    assert mb.tokens.tolist() == [[0, 0]] and mb.cu_seqlens.tolist() == [0, 2]
    assert mb.num_trained == 0 and mb.num_real_tokens == 0 and mb.rows == []


def test_pack_rows_gathers_fields_at_trained_tokens():
    b = small_batch()
    b.set_response_field("advantages", [torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, -1.0]), torch.zeros(0)])
    mb = pack_rows(b, [0, 1], gather_fields=["advantages"])
    assert mb.fields["advantages"].tolist() == [0.5, 0.5, -1.0]
    assert [v.tolist() for v in b.response_values(b.token_fields["advantages"])] == [[0.5, 0.5, 0.0], [0.0, -1.0], []]


def test_pack_rows_errors_name_the_step_and_budget():
    with pytest.raises(StepwiseBatchError, match=r"max_tokens=4"):
        pack_rows(small_batch(), [0], max_tokens=4)
    tid = TrajectoryID("q", 0)
    b = StepBatch.from_steps([Step(tid, [1], [2], [1]), Step(tid, [], [3, 4], [1, 1], is_last_step=True)])
    with pytest.raises(StepwiseBatchError, match=r"step 1: field 'loss_mask'"):
        pack_rows(b, [0, 1])
    with pytest.raises(StepwiseBatchError, match=r"step 1: field 'x' has 1 values for 2"):
        b.set_response_field("x", [torch.zeros(1), torch.zeros(1)])


def test_context_parallel_packing_by_hand():
    """CP2: each row padded to a multiple of 4 and cut into 4 chunks; rank 0 holds chunks 0 and
    3 of every row, rank 1 chunks 1 and 2 (the layout TE's THD attention and megatron's RoPE use)."""
    b = small_batch()
    mb = pack_rows(b, [1, 0], align=alignment_for(1, False, cp=2), cp=2)
    # row 1 [1, 2, 3] -> +1 pad; row 0 [5, 6, 7, 8, 9] -> +3 pad; 12 tokens, a multiple of 4
    assert mb.tokens.tolist() == [[1, 2, 3, 0, 5, 6, 7, 8, 9, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert mb.cu_seqlens.tolist() == [0, 3, 8] and mb.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert mb.max_seqlen == 8 and mb.num_real_tokens == 8
    assert mb.pred_index.tolist() == [1, 5, 6] and mb.targets.tolist() == [3, 7, 8]
    r0, r1 = (split_for_context_parallel(mb, 2, r) for r in (0, 1))
    # row 1 chunks of 1: [1] [2] [3] [0]; row 0 chunks of 2: [5 6] [7 8] [9 0] [0 0]
    assert r0.tokens.tolist() == [[1, 0, 5, 6, 0, 0]]
    assert r1.tokens.tolist() == [[2, 3, 7, 8, 9, 0]]
    assert r0.position_ids.tolist() == [[0, 3, 0, 1, 6, 7]] and r1.position_ids.tolist() == [[1, 2, 2, 3, 4, 5]]
    # a trained token is scored where its predicting position lives: packed 5 ('6' -> '7') on
    # rank 0 (local 3); packed 1 ('2' -> '3') and 6 ('7' -> '8') on rank 1 (local 0 and 2)
    assert r0.pred_index.tolist() == [3] and r0.targets.tolist() == [7]
    assert r1.pred_index.tolist() == [0, 2] and r1.targets.tolist() == [3, 8]
    assert r0.num_real_tokens + r1.num_real_tokens == mb.num_real_tokens == 8
    assert r0.cu_seqlens.tolist() == mb.cu_seqlens.tolist()  # every rank keeps the global bounds


@pytest.mark.parametrize("cp,tp,sp", [(2, 1, False), (2, 2, True), (4, 1, False), (3, 2, True)])
def test_context_parallel_split_partitions_tokens_and_trained_positions(cp, tp, sp):
    """Over the CP ranks every packed position is held exactly once, every trained token is
    scored exactly once with its own target and fields, and each rank's length suits SP."""
    gen = torch.Generator().manual_seed(cp * 10 + tp)
    tid = TrajectoryID("r", 0)
    steps = []
    for i in range(7):
        p, r = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 7, (1,), generator=gen))
        steps.append(
            Step(
                tid,
                torch.randint(1, 50, (p,), generator=gen),
                torch.randint(1, 50, (r,), generator=gen),
                torch.randint(0, 2, (r,), generator=gen),
                is_last_step=i == 6,
            )
        )
    b = StepBatch.from_steps(steps)
    b.token_fields["advantages"] = torch.arange(b.tokens.numel(), dtype=torch.float32)
    mb = pack_rows(b, [3, 0, 6, 2], align=alignment_for(tp, sp, cp), cp=cp, gather_fields=["advantages"])
    parts = [split_for_context_parallel(mb, cp, r) for r in range(cp)]
    assert sorted(torch.cat([p.tokens[0] for p in parts]).tolist()) == sorted(mb.tokens[0].tolist())
    assert all(p.seq_len == mb.seq_len // cp and p.seq_len % (tp if sp else 1) == 0 for p in parts)
    assert sorted(torch.cat([p.token_index for p in parts]).tolist()) == sorted(mb.token_index.tolist())
    for p in parts:
        assert torch.equal(b.tokens[p.token_index], p.targets)
        assert torch.equal(p.fields["advantages"], b.token_fields["advantages"][p.token_index])
    assert sum(p.num_real_tokens for p in parts) == mb.num_real_tokens


# ---------------------------------------------------------------- log-probs


@pytest.mark.parametrize("chunk,temperature", [(1, 1.0), (5, 1.0), (1000, 1.0), (5, 0.6), (1000, 1.7)])
def test_logprobs_and_entropy_match_full_logits_with_gradients(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    n, h, v = 23, 16, 50
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(v, h, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)

    lp, ent = vocab_parallel_logprobs(hidden, weight, targets, chunk_tokens=chunk, temperature=temperature)
    (a * lp + b * ent).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    # The oracle divides the full logits by T, as the rollout engine does.
    scaled = torch.log_softmax((hidden @ weight.t()).detach() / temperature, -1)
    torch.testing.assert_close(lp.detach(), scaled.gather(1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    lp_ref, ent_ref = reference_logprobs(hidden @ weight.t(), targets, temperature)
    (a * lp_ref + b * ent_ref).sum().backward()

    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0, -1.0, float("nan"), float("inf")])
def test_logprobs_refuse_a_temperature_that_is_not_positive_and_finite(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0.0001"):
        vocab_parallel_logprobs(torch.zeros(1, 4), torch.zeros(3, 4), torch.tensor([0]), temperature=temperature)


def test_logprobs_without_entropy_and_with_no_rows():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 8, generator=g, requires_grad=True)
    weight = torch.randn(10, 8, generator=g, requires_grad=True)
    targets = torch.tensor([0, 9, 3, 3])
    lp, ent = vocab_parallel_logprobs(hidden, weight, targets, with_entropy=False)
    assert torch.equal(ent, torch.zeros(4))
    lp.sum().backward()
    hg = hidden.grad.clone()
    hidden.grad = None
    reference_logprobs(hidden @ weight.t(), targets)[0].sum().backward()
    torch.testing.assert_close(hg, hidden.grad, rtol=1e-5, atol=1e-6)

    empty = hidden[:0]
    lp0, ent0 = vocab_parallel_logprobs(empty, weight, targets[:0])
    assert lp0.shape == (0,) and ent0.shape == (0,)
    weight.grad = None
    (lp0.sum() + ent0.sum()).backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_logprobs_shard_offset_selects_the_right_vocabulary_slice():
    # One rank holding ids [20, 40): targets outside its shard contribute only to the normaliser.
    g = torch.Generator().manual_seed(2)
    hidden, full = torch.randn(6, 8, generator=g), torch.randn(40, 8, generator=g)
    targets = torch.tensor([25, 39, 20, 30, 21, 38])
    lp, ent = vocab_parallel_logprobs(hidden, full[20:], targets, vocab_start=20)
    lp_ref, ent_ref = reference_logprobs(hidden @ full[20:].t(), targets - 20)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- HF config front end


def test_arch_from_transformers_configs():
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config

    llama = arch_from_hf(
        LlamaConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        )
    )
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (8, 2, 8)
    assert llama.rope_theta == 500000.0 and llama.rope_scaling_factor is None
    assert not llama.qkv_bias and llama.tie_word_embeddings
    qwen = arch_from_hf(
        Qwen2Config(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    )
    assert qwen.qkv_bias and qwen.model_type == "qwen2"
    mixtral = arch_from_hf(
        MixtralConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=2,
            output_router_logits=True,
        )
    )
    # The expert width is intermediate_size; top-k renormalised; Llama attention; theta 1e6.
    assert (mixtral.num_experts, mixtral.moe_topk, mixtral.moe_ffn_hidden_size) == (6, 2, 96)
    assert mixtral.moe_norm_topk and not mixtral.qk_norm and not mixtral.qkv_bias
    assert (mixtral.num_heads, mixtral.num_kv_heads, mixtral.head_dim, mixtral.rope_theta) == (8, 2, 8, 1e6)
    # the same from the hub's config.json keys (and with an explicit theta)
    hub = {**M.tiny_config(model_type="mixtral"), "rope_theta": 1e6, "num_local_experts": 8}
    assert arch_from_hf(hub).num_experts == 8 and arch_from_hf(hub).rope_theta == 1e6


@pytest.mark.parametrize(
    "key, value",
    [("sliding_window", 4096), ("router_jitter_noise", 0.01), ("num_local_experts", 0), ("num_experts_per_tok", 5)],
)
def test_mixtral_configs_this_builder_cannot_match_are_refused_by_name(key, value):
    with pytest.raises(ModelConfigError, match=f"{key}={value}"):
        arch_from_hf({**M.tiny_config(model_type="mixtral"), key: value})


def test_llama3_rope_scaling_and_unsupported_configs():
    cfg = M.tiny_config(model_type="llama")
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert arch_from_hf(cfg).rope_scaling_factor == 32.0
    cfg["rope_scaling"]["low_freq_factor"] = 2.0
    with pytest.raises(ModelConfigError, match="low_freq_factor"):
        arch_from_hf(cfg)
    with pytest.raises(ModelConfigError, match="model_type 'gpt2'"):
        arch_from_hf({**M.tiny_config(), "model_type": "gpt2"})
    with pytest.raises(ModelConfigError, match="hidden_act"):
        arch_from_hf({**M.tiny_config(), "hidden_act": "gelu"})


@pytest.mark.parametrize(
    "overrides, tp, pp, key",
    [
        ({"num_heads": 6, "num_kv_heads": 6, "hidden_size": 48}, 4, 1, "num_attention_heads=6"),
        ({"num_kv_heads": 1}, 2, 1, "num_key_value_heads=1"),
        ({"ffn_hidden_size": 129}, 2, 1, "intermediate_size=129"),
        ({"vocab_size": 5, "num_kv_heads": 4}, 4, 1, "vocab_size=5 is too small"),  # a whole TP shard of padding
        ({"num_layers": 3}, 1, 2, "num_hidden_layers=3"),
    ],
)
def test_validate_parallel_names_the_key(overrides, tp, pp, key):
    arch = arch_from_hf(M.tiny_config(**overrides))
    with pytest.raises(ModelConfigError, match=key):
        validate_parallel(arch, tp=tp, pp=pp)


def test_vocabulary_is_padded_to_a_multiple_of_tp():
    assert [padded_vocab_size(v, 2) for v in (21, 256, 257)] == [22, 256, 258]
    assert padded_vocab_size(151_665, 8) == 151_672
    validate_parallel(arch_from_hf(M.tiny_config(vocab_size=257)), tp=2, pp=1)  # padded, accepted


def test_tokenizer_larger_than_model_vocab_is_rejected():
    arch = arch_from_hf(M.tiny_config(vocab_size=256))
    validate_parallel(arch, tp=1, pp=1, tokenizer_vocab_size=250)  # smaller: fine (padded vocab)
    with pytest.raises(ModelConfigError, match="tokenizer has 300 tokens"):
        validate_parallel(arch, tp=1, pp=1, tokenizer_vocab_size=300)


# ---------------------------------------------------------------- launcher environment


def test_launch_env_from_torchrun_slurm_and_alone():
    from megatron_stepwise.mcore.runtime.runtime import launch_env

    tr = launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.master_addr, tr.master_port) == (3, 4, 1, "n1", 1234)
    sl = launch_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (sl.rank, sl.world_size, sl.local_rank, sl.master_addr) == (5, 8, 1, "10.0.0.7")
    assert sl.master_port == 20000 + 123456 % 20000
    alone = launch_env({})
    assert (alone.rank, alone.world_size, alone.master_addr) == (0, 1, "127.0.0.1")
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        launch_env({"RANK": "4", "WORLD_SIZE": "4"})


_LONE_RANK = """
import os, socket, sys
held = socket.socket()
try:
    held.bind(("127.0.0.1", 29500)); held.listen()   # the default port, taken by someone else
except OSError:
    pass                                              # already taken: the same situation
from megatron_stepwise.mcore.runtime.runtime import init_distributed
layout = init_distributed()
print("port", os.environ["MASTER_PORT"], "dp", layout.dp)
"""


def test_a_lone_process_starts_while_the_default_port_is_taken():
    """Replay and eval run as a world of one; two of them (or one beside a torchrun job on 29500)
    must not collide on the default rendezvous port."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-c", _LONE_RANK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    port = int(out.stdout.split()[1])
    assert port != 29500 and out.stdout.split()[3] == "1"
