"""Megatron (megatron-core 0.16) integration.

- `runtime`: process groups (torchrun/SLURM env), NCCL on GPU, gloo + `cpu_compat` on CPU.
- `model`: GPTModel from a Llama/Qwen2 HF config; `tiny_config()` for tests.
- `packing`: step rows -> THD packed micro-batches; `logprobs`: vocab-parallel log-probs and
  entropy at trained positions only; `weights`: full (unsharded) parameter views.
- `plugin`: `StepwisePlugin` (forward_step / train_minibatch / compute_logprobs).

Submodules import megatron-core; import them explicitly.
"""
