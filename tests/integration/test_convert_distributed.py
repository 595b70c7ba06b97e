"""HF -> Megatron (TP2, PP2) -> HF through real megatron-core chunks, and HF logits of an export.

One torchrun launch (2 processes) runs both layouts; see tests/workers/weights_worker.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_ok, run_torchrun
from weights_helpers import hf_model, load_json, make_hf_dir, make_tokenizer_dir, read_hf_dir

from megatron_stepwise.mcore.train.model import tiny_config

pytestmark = pytest.mark.distributed

CHECKPOINTS = {
    "qwen2-untied": tiny_config(model_type="qwen2", tie_word_embeddings=False),
    "llama-tied": tiny_config(model_type="llama", tie_word_embeddings=True),
    # QK RMSNorm per head and an explicit head_dim other than hidden / heads
    "qwen3-untied": tiny_config(model_type="qwen3", tie_word_embeddings=False, head_dim=24),
    # 4 experts, top-2, renormalised (EP1: the experts are whole on every rank)
    "qwen3moe-untied": tiny_config(model_type="qwen3_moe", tie_word_embeddings=False, num_layers=4),
    # Mixtral: 4 experts of intermediate_size, top-2 always renormalised, hub names
    # (block_sparse_moe.experts.e.w1/w2/w3) as transformers' save_pretrained writes them
    "mixtral-untied": tiny_config(model_type="mixtral", tie_word_embeddings=False, num_layers=4),
}
LAYOUTS = ["tp2pp1", "tp1pp2"]
# every checkpoint at every layout, and the MoE ones with their experts split over 2 EP ranks
CASES = [(name, layout) for name in CHECKPOINTS for layout in LAYOUTS] + [
    ("qwen3moe-untied", "tp1pp1ep2"),
    ("mixtral-untied", "tp1pp1ep2"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    for i, (name, cfg) in enumerate(CHECKPOINTS.items()):
        make_hf_dir(root / "hf" / name, cfg, seed=i)
    make_tokenizer_dir(root / "tokenizer", vocab_size=256)
    (root / "out").mkdir()
    proc = run_torchrun(
        "weights_worker.py",
        2,
        ["--hf-root", str(root / "hf"), "--out", str(root / "out"), "--tokenizer", str(root / "tokenizer")],
    )
    check_ok(proc)
    return root


def assert_bit_identical(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("name,layout", CASES)
def test_round_trip_through_megatron_chunks_is_bit_identical(run, name, layout):
    original = read_hf_dir(run / "hf" / name)
    exported = run / "out" / f"{name}-{layout}"
    assert_bit_identical(read_hf_dir(exported), original)
    index = load_json(exported / "model.safetensors.index.json")
    assert sorted(index["weight_map"]) == sorted(original)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    if layout == "tp1pp2":  # each stage wrote its own shards
        assert {f.split("-")[1] for f in index["weight_map"].values()} == {"pp000", "pp001"}


@pytest.mark.parametrize("name,layout", CASES)
def test_streamed_buckets_reach_rank0_complete(run, name, layout):
    from safetensors.torch import load_file

    streamed = load_file(str(run / "out" / f"{name}-{layout}-streamed.safetensors"))
    assert_bit_identical(streamed, read_hf_dir(run / "hf" / name))
    # 50 KB buckets: the 64 KB embedding is a bucket alone, the layers need several.
    assert load_json(run / "out" / "report.json")[f"{name}-{layout}"]["buckets"] >= 4


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_export_loads_in_transformers_with_megatron_logits(run, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from weights_worker import SEQUENCE

    exported = run / "out" / f"{name}-tp2pp1"
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(torch.tensor([SEQUENCE])).logits[0]
    megatron = torch.load(run / "out" / f"{name}-tp2pp1-logits.pt")
    assert hf_logits.shape == megatron.shape == (len(SEQUENCE), CHECKPOINTS[name]["vocab_size"])
    assert (hf_logits - megatron).abs().max().item() < 1e-4
    # and it is the same model as the source checkpoint (not merely self-consistent)
    with torch.no_grad():
        source = hf_model(CHECKPOINTS[name], seed=list(CHECKPOINTS).index(name))(torch.tensor([SEQUENCE])).logits[0]
    assert torch.equal(source, hf_logits)
    assert AutoTokenizer.from_pretrained(str(exported)).convert_tokens_to_ids("t5") == 5


def test_bad_inputs_raise_clear_errors_on_every_rank(run):
    errors = load_json(run / "out" / "report.json")["errors"]
    assert errors["import_mismatch"] == (
        "HF config qkv bias (qwen2 / attention_bias)=False but the megatron model has add_qkv_bias=True"
    )
    assert "exists and is not empty (pass overwrite=True)" in errors["export_non_empty"]
    assert errors["alive_ranks"] == 2
