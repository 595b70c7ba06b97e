"""Step-wise RL inside Megatron-LM's own training loop, `megatron.training.pretrain`.

Megatron-LM keeps everything it always does (argument parsing, DDP and optimizer setup,
`train_step`, logging, checkpointing); the plugin supplies `forward_step` and the data iterator.
What a user sets, and why:

1. `--dataloader-type external` and a dataset provider with `is_distributed = True`: every rank
   (every TP, PP and CP rank too) gets the same iterator, `plugin.microbatch_stream(minibatches)`.
2. `--micro-batch-size 1` and `--global-batch-size = K x DP`: Megatron-LM runs K micro-batches per
   optimizer step; the stream packs each mini-batch into exactly K (padding with loss-neutral
   empty ones) and raises HostLoopMismatchError if one needs more than K.
3. `--seq-length` = the plugin's `max_tokens_per_microbatch` (tokens per packed micro-batch).
4. A model provider whose model config agrees with the flags the loop reads
   (`--calculate-per-token-loss`, `--sequence-parallel`, `--bf16`) and, with pipeline
   parallelism, has `config.variable_seq_lengths = True` (packed micro-batches differ in length;
   Megatron-LM has no flag for it and sets it False in its arguments). Here the package's
   provider, built from an HF config, does both. Megatron-LM's own `gpt_builder` needs
   `variable_seq_lengths` set on the config it builds and a layer spec with packed-sequence
   attention (TE on GPU; its local spec has none): not tested here.

Rollouts are replaced by synthetic multi-turn steps with GRPO advantages (one optimizer step per
rollout batch, so old-policy log-probs are the current ones). Run it (Megatron-LM's source at
tag core_v0.16.1 on MEGATRON_LM_SRC; any extra Megatron-LM flag is passed through and wins):

    MEGATRON_LM_SRC=/path/to/Megatron-LM torchrun --nproc-per-node 2 examples/megatron_lm_pretrain.py
    ... --nproc-per-node 2 examples/megatron_lm_pretrain.py --pipeline-model-parallel-size 2
    ... --nproc-per-node 2 examples/megatron_lm_pretrain.py --context-parallel-size 2 --calculate-per-token-loss

Without a GPU it runs on gloo with the CPU patches of `megatron_stepwise.mcore.runtime.megatron_lm_cpu`.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Iterator

import torch

from megatron_stepwise.algo.advantages import compute_advantages
from megatron_stepwise.algo.losses import LossConfig
from megatron_stepwise.data.synthetic import AgentWorkload, make_agent_steps
from megatron_stepwise.mcore.train.model import build_gpt_model, tiny_config
from megatron_stepwise.mcore.train.plugin import StepwisePlugin
from megatron_stepwise.steps import StepBatch

HF_CONFIG = tiny_config(num_layers=4)
MAX_TOKENS = 256  # tokens per packed micro-batch: --seq-length
MICROBATCHES = 8  # per optimizer step and DP rank: --global-batch-size / DP


def default_flags(world_size: int, args: list[str]) -> list[str]:
    """Megatron-LM flags for the tiny model; `args` (the user's) come last and win."""
    cfg = HF_CONFIG

    def value(flag: str, default: int) -> int:
        return int(args[args.index(flag) + 1]) if flag in args else default

    tp = value("--tensor-model-parallel-size", 1)
    pp = value("--pipeline-model-parallel-size", 1)
    cp = value("--context-parallel-size", 1)
    dp = world_size // (tp * pp * cp)
    flags = [
        # the model (must describe what the provider builds: Megatron-LM checks and reports it)
        "--num-layers",
        cfg["num_hidden_layers"],
        "--hidden-size",
        cfg["hidden_size"],
        "--ffn-hidden-size",
        cfg["intermediate_size"],
        "--num-attention-heads",
        cfg["num_attention_heads"],
        "--group-query-attention",
        "--num-query-groups",
        cfg["num_key_value_heads"],
        "--max-position-embeddings",
        cfg["max_position_embeddings"],
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        cfg["vocab_size"] - 1,  # + the end-of-document id
        "--make-vocab-size-divisible-by",
        1,
        "--transformer-impl",
        "local",
        # the step-wise data path (points 1-3 of the module docstring)
        "--dataloader-type",
        "external",
        "--micro-batch-size",
        1,
        "--global-batch-size",
        MICROBATCHES * dp,
        "--seq-length",
        MAX_TOKENS,
        # optimisation
        "--train-iters",
        3,
        "--lr",
        1e-3,
        "--min-lr",
        1e-3,
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        0.0,
        "--clip-grad",
        1.0,
        "--adam-eps",
        1e-4,
        "--seed",
        1234,
        "--init-method-std",
        0.02,
        "--attention-dropout",
        0.0,
        "--hidden-dropout",
        0.0,
        # logging: every step; no evaluation (validation is a separate rollout concern)
        "--log-interval",
        1,
        "--eval-iters",
        0,
        "--eval-interval",
        1000,
    ]
    if not torch.cuda.is_available():
        flags += [
            "--distributed-backend",
            "gloo",
            "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion",
            "--no-bias-swiglu-fusion",
            "--no-bias-dropout-fusion",
            "--no-rope-fusion",
            "--no-persist-layer-norm",
        ]
    return [str(f) for f in flags] + args


def make_plugin() -> StepwisePlugin:
    loss = LossConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.28, reduction="token_mean")
    return StepwisePlugin(loss, max_tokens_per_microbatch=MAX_TOKENS, vocab_size=HF_CONFIG["vocab_size"])


def rollout_batches(seed: int = 0) -> Iterator[StepBatch]:
    """Stand-in for the rollout fleet: each optimizer step gets 4 prompts x 4 samples, 1-3 turns
    each, identical on every rank."""
    iteration = 0
    while True:
        w = AgentWorkload(
            num_prompts=4,
            samples_per_prompt=4,
            turns=(1, 3),
            prompt_len=(8, 24),
            obs_len=(4, 12),
            response_len=(4, 16),
            vocab_size=HF_CONFIG["vocab_size"],
            seed=seed + iteration,
        )
        steps = make_agent_steps(w)
        batch = StepBatch.from_steps(steps)
        batch.set_response_field("advantages", compute_advantages(steps, "grpo"))
        yield batch
        iteration += 1


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None, **_):
    """The package's GPT built from an HF config, with the flags the training loop reads."""
    from megatron.training import get_args

    args = get_args()
    overrides = {
        "calculate_per_token_loss": args.calculate_per_token_loss,
        "sequence_parallel": args.sequence_parallel,
        "dtype": args.params_dtype,
    }
    return build_gpt_model(
        HF_CONFIG, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, config_overrides=overrides
    )


def datasets_provider(plugin: StepwisePlugin, train_val_test_num_samples, vp_stage=None, _streams={}):
    """One stream of rollouts; with virtual pipeline stages Megatron-LM asks once per model chunk,
    and every chunk reads the same micro-batches."""
    if vp_stage is None:
        return plugin.microbatch_stream(rollout_batches()), None, None
    if not _streams:
        from megatron.training import get_args

        chunks = get_args().virtual_pipeline_model_parallel_size
        _streams.update(enumerate(plugin.microbatch_streams(rollout_batches(), chunks)))
    return _streams[vp_stage], None, None


def run(plugin: StepwisePlugin, user_flags: list[str], *, model_provider=model_provider) -> None:
    """Megatron-LM's pretrain with the plugin's forward step and data stream."""
    if not os.environ.get("MEGATRON_LM_SRC"):
        sys.exit("set MEGATRON_LM_SRC to a Megatron-LM checkout (tag core_v0.16.1): its megatron/training is needed")
    sys.path.append(os.environ["MEGATRON_LM_SRC"])  # after site-packages: megatron.core stays the wheel's
    from megatron_stepwise.mcore.runtime.megatron_lm_cpu import enable_megatron_lm_cpu

    enable_megatron_lm_cpu()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    provider = functools.partial(datasets_provider, plugin)
    provider.is_distributed = True  # every TP/PP/CP rank reads the stream, not only TP rank 0
    sys.argv = sys.argv[:1] + default_flags(int(os.environ.get("WORLD_SIZE", 1)), user_flags)
    pretrain(provider, model_provider, ModelType.encoder_or_decoder, plugin.forward_step)


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(make_plugin(), sys.argv[1:])
